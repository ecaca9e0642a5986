"""A refusal a component expects (a corrupt checkpoint, a data file that is not the recipe's, a taken
port, ...) reaches the operator as one line: the exception's message, which names the file and the
fix. The traceback goes to ``logs/COMPONENT_RANK.traceback.txt`` in the job folder, for whoever
debugs the component itself, not onto the console the launcher echoes."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from runtime.files import atomic_write_text

EXIT_REFUSED = 1
"""A component's exit code after a refusal: a failed task (what an uncaught exception gives, so the
supervisor and Slurm treat it the same), its reason said once."""


def traceback_path(job_dir: Path, component: str, rank: int) -> Path:
    """Where the traceback of a component task's refusal is kept."""
    return job_dir / "logs" / f"{component}_{rank}.traceback.txt"


def report_refusal(exc: BaseException, job_dir: Path, component: str, rank: int) -> int:
    """Write the current exception's traceback beside the logs, print ``[COMPONENT rank N] error:
    MESSAGE (traceback: FILE)`` once to stderr, and return :data:`EXIT_REFUSED`. Call it from the
    ``except`` block that caught ``exc``."""
    target = traceback_path(job_dir, component, rank)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(target, traceback.format_exc())
        where = f" (traceback: {target})"
    except OSError:
        traceback.print_exc()  # nowhere to put it: the log gets it after all
        where = ""
    print(f"[{component} rank {rank}] error: {exc}{where}", file=sys.stderr, flush=True)
    return EXIT_REFUSED
