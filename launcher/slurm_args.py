"""Values that reach Slurm's own parsers, not the shell: made safe where they are built.

Shell quoting (``shell_word``) keeps a value one word; Slurm then reads some words again:
- a job id given to ``scancel``/``sacct``/``squeue`` must be a job id, never an option
  (``--user=root``, ``--me``) or a list (``1,2``): :func:`checked_job_id`;
- a path in ``--output`` is a filename pattern in which ``%j``, ``%x``, ``%u``, ... expand:
  :func:`output_pattern` keeps a literal ``%`` literal (``%%``); inside a batch script the job folder
  is a shell variable, expanded the same way by :data:`JOB_DIR_IN_OUTPUT`;
- ``--export=A=1,B=2`` splits at commas, so values are never put there: the eval job's settings travel
  in the submitting process's environment (``--export=ALL``), see :func:`export_environment`.
"""

from __future__ import annotations

import re

from runtime.user_errors import UserError

SLURM_JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+)?")
"""A Slurm job id: digits, or ``123_4`` for an array task."""
LOCAL_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""A ``--local`` job's id (``local-`` and its folder's name): a plain word, never an option, a list or
terminal escape codes (it is printed and named in commands)."""
JOB_DIR_IN_OUTPUT = "${DSPARK_JOB_DIR//%/%%}"
"""The job folder in a batch script's ``srun --output=`` (bash doubles every ``%``, Slurm reads ``%%``
as one)."""


class SlurmArgumentError(UserError):
    """A value that would be read by Slurm as something else; names it and the fix."""


def job_id_problem(job_id: str, mode: str) -> str | None:
    """Why ``job_id`` is not the id of a job of ``mode`` (``slurm`` or ``local``), or None."""
    pattern = SLURM_JOB_ID if mode == "slurm" else LOCAL_JOB_ID
    if pattern.fullmatch(job_id):
        return None
    shape = "digits, or 123_4 for an array task" if mode == "slurm" else "letters, digits, _ . - and no leading -"
    return f"job id {job_id!r} is not a {mode} job id ({shape})"


def checked_job_id(job_id: str) -> str:
    """``job_id`` for a Slurm command's argument list; refused when it is not a Slurm job id (an option
    such as ``--me`` would cancel every job of the operator)."""
    problem = job_id_problem(job_id, "slurm")
    if problem:
        raise SlurmArgumentError(f"{problem}: it is never passed to a Slurm command. Fix: give the job's own id")
    return job_id


def output_pattern(path: str) -> str:
    """``path`` for ``--output``/``--error``: every literal ``%`` doubled, so Slurm's filename patterns
    (``%j``, ``%x``, ...) do not rewrite a folder name that contains one."""
    return path.replace("%", "%%")


def export_environment(values: dict[str, str]) -> dict[str, str]:
    """Variables a submitted job gets through the submitting process's environment (sbatch
    ``--export=ALL``) rather than inside ``--export=``, which splits at commas: a folder named
    ``a,PATH=/x`` stays one value. Names must be plain; values must be one line."""
    for name, value in values.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or "\n" in value or "\x00" in value:
            raise SlurmArgumentError(f"{name}={value!r} cannot be passed to a job; fix: use a one-line value")
    return dict(values)
