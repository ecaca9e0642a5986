"""Why a Slurm job ended without completing, in one line, from what the job left in its folder.

``status`` prints it under the component table, so the operator need not open a log to learn why:
- a job whose time-out requeues were spent says so (the worker of task 0 records it,
  :data:`NOT_REQUEUED_FILENAME`), with how many the recipe allowed;
- a component task that died first names itself and its last error line (:mod:`launcher.deaths`);
- a job that failed before any component started (a site path the batch script requires is unset, a
  ``job.setup`` line that fails, a bad ``DSPARK_VENV``) has its reason only in the batch script's own
  log (``logs/batch_<id>.out``): its first error line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from launcher.deaths import LAST_WORDS_BYTES, LAST_WORDS_CHARS, read_first_death
from runtime.files import atomic_write_text

NOT_REQUEUED_FILENAME = "not_requeued.json"
"""In the job folder: why task 0 did not requeue the job at its time-out signal (written once per end)."""

_BATCH_ERROR = re.compile(
    r"(slurm_script: line \d+: |^srun: error: |^sbatch: error: |(^|\] )error: |^\[dspark\] .*\bfailed\b"
    r"|^\w*(Error|Exception)\b|: command not found$|: No such file or directory$)"
)
"""A line of the batch log that says something went wrong (bash's own errors name the script's line)."""
_SCRIPT_PREFIX = re.compile(r"^\S*slurm_script: line (\d+): ")


def batch_log_path(job_dir: Path, job_id: str) -> Path:
    """The batch script's own log of a job the launcher submitted (``#SBATCH --output``)."""
    return job_dir / "logs" / f"batch_{job_id}.out"


def first_batch_error(path: Path) -> str:
    """The first error line of a batch log (bash's ``slurm_script: line N:`` prefix made readable), or ''."""
    try:
        with path.open("rb") as handle:
            text = handle.read(LAST_WORDS_BYTES).decode(errors="replace")
    except OSError:
        return ""
    for raw in text.splitlines():
        line = raw.strip()
        if _BATCH_ERROR.search(line):
            line = _SCRIPT_PREFIX.sub(lambda m: f"batch script line {m.group(1)}: ", line)
            return line if len(line) <= LAST_WORDS_CHARS else line[: LAST_WORDS_CHARS - 4] + " ..."
    return ""


def record_not_requeued(job_dir: Path, reason: str, max_requeues: int) -> None:
    """Task 0 at a time-out signal it could not requeue on: say why, for ``status``."""
    payload = {"reason": reason, "max_requeues": max_requeues}
    atomic_write_text(job_dir / NOT_REQUEUED_FILENAME, json.dumps(payload) + "\n")


def not_requeued_line(reason: str, max_requeues: int) -> str:
    """``not requeued: ...`` in the operator's words (submitit says ``timed-out too many times``)."""
    if "too many times" in reason:
        return (
            f"not requeued: the job reached its time limit again after its {max_requeues} requeue(s) "
            "(job.max_requeues) were spent"
        )
    return f"not requeued: {reason.removeprefix('Job not requeued because: ').rstrip('.')}"


def failure_reason(job_dir: Path, job_id: str, component_logs: list[Path]) -> str:
    """One line saying why the job ended without completing, or '' when its folder does not say.
    ``component_logs``: the job's task logs (none of them there: the components never started)."""
    try:
        spent = json.loads((job_dir / NOT_REQUEUED_FILENAME).read_text())
        return not_requeued_line(str(spent["reason"]), int(spent["max_requeues"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    death = read_first_death(job_dir)
    if death is not None:
        return f"the cause: {death.cause()}"
    batch_error = first_batch_error(batch_log_path(job_dir, job_id))
    if not batch_error:
        return ""
    if not any(path.exists() for path in component_logs):
        return f"the batch script failed before its components started: {batch_error}"
    return f"the batch log says: {batch_error}"
