"""Keep native libraries' log lines out of a component's console.

The Mooncake client logs through glog without initialising it, so every line (including the
E-level "metadata not found" that each healthy client start prints while it registers its own
segment) goes straight to file descriptor 2, and GLOG_* variables cannot route it. A component
started by the launcher therefore points fd 2 at a per-task file beside its log
(``logs/native_{component}_{rank}.log``) and gives Python's ``sys.stderr`` (tracebacks, logging,
warnings) a duplicate of the original fd 2, which stays the task's console.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

NATIVE_LOG_PATTERN = "native_{component}_{rank}.log"
"""File name (in the job's ``logs/``) of one task's native-library output."""


def native_log_path(job_dir: Path, component: str, rank: int | str) -> Path:
    """Where one component task's native-library output goes."""
    return job_dir / "logs" / NATIVE_LOG_PATTERN.format(component=component, rank=rank)


def route_native_output(environ: dict[str, str] | None = None) -> Path | None:
    """Point fd 2 at the task's native log when the launcher started this component (the contract
    variables DSPARK_JOB_DIR, DSPARK_COMPONENT, DSPARK_TASK_RANK are set); returns the file, or None.

    Call it before logging is configured: handlers bind to ``sys.stderr`` when they are made.
    """
    env = os.environ if environ is None else environ
    job_dir, component, rank = env.get("DSPARK_JOB_DIR"), env.get("DSPARK_COMPONENT"), env.get("DSPARK_TASK_RANK")
    if not (job_dir and component and rank is not None):
        return None
    path = native_log_path(Path(job_dir), component, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    console = os.dup(2)
    native = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(native, 2)
    os.close(native)
    sys.stderr = os.fdopen(console, "w", buffering=1, errors="backslashreplace")
    print(f"native library output (Mooncake glog, ...) goes to {path}", file=sys.stderr)
    return path
