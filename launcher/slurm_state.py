"""Reading heterogeneous-job state from ``sacct``.

sacct reports a hetjob's components as ``123+0`` and ``123+1`` (plus steps such as ``123+1.0``
and ``123+0.batch``). submitit's own parser does not know the ``+`` form, so a hetjob's status
would stay UNKNOWN and a component that died without a result would make ``result()`` wait
forever. This module parses the form and folds the components into one job state.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

from launcher.slurm_args import checked_job_id

SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "Elapsed", "NodeList", "Reason")

PENDING_STATES = {"PENDING", "REQUEUED", "RESIZING", "SUSPENDED", "REQUEUE_HOLD", "REQUEUE_FED"}
ACTIVE_STATES = {"RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING"}
SUCCESS_STATES = {"COMPLETED"}
# Everything else that sacct can say (FAILED, CANCELLED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY,
# PREEMPTED, BOOT_FAIL, DEADLINE, REVOKED) is terminal and not a success.


@dataclass
class ComponentState:
    """One het component (``123+1``) as sacct reports it."""

    offset: int
    state: str
    exit_code: str = ""
    elapsed: str = ""
    nodes: str = ""
    reason: str = ""
    """Why a pending component waits (sacct's Reason: ``Resources``, ``Priority`` ...)."""
    steps: dict[str, str] = field(default_factory=dict)
    """Step id (``batch``, ``0`` ...) -> state."""

    @property
    def terminal(self) -> bool:
        """The component has ended."""
        return base_state(self.state) not in PENDING_STATES | ACTIVE_STATES

    @property
    def failed(self) -> bool:
        """The component ended in anything but COMPLETED."""
        return self.terminal and base_state(self.state) not in SUCCESS_STATES


def base_state(state: str) -> str:
    """``CANCELLED by 0`` -> ``CANCELLED``."""
    return state.split()[0].upper() if state.strip() else "UNKNOWN"


def parse_sacct(text: str, job_id: str) -> dict[int, ComponentState]:
    """Components of job ``job_id`` from ``sacct --parsable2`` output (header line first).

    A plain (non-het) job is returned as component 0.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return {}
    names = lines[0].split("|")
    components: dict[int, ComponentState] = {}
    steps: list[tuple[int, str, str]] = []
    for line in lines[1:]:
        row = dict(zip(names, line.split("|"), strict=False))
        raw_id = row.get("JobID", "")
        main, _, step = raw_id.partition(".")
        base, plus, offset_text = main.partition("+")
        if base != job_id:
            continue
        offset = int(offset_text) if plus and offset_text.isdigit() else 0
        if step:
            steps.append((offset, step, row.get("State", "")))
            continue
        components[offset] = ComponentState(
            offset=offset,
            state=row.get("State", "UNKNOWN") or "UNKNOWN",
            exit_code=row.get("ExitCode", ""),
            elapsed=row.get("Elapsed", ""),
            nodes=row.get("NodeList", ""),
            reason="" if row.get("Reason", "") in ("", "None") else row.get("Reason", ""),
        )
    for offset, step, state in steps:
        if offset in components:
            components[offset].steps[step] = state
    return components


def fold_state(components: dict[int, ComponentState]) -> str:
    """One state for the whole job: a failed component makes the job FAILED (or its own failure
    state) even while the other still runs, so nobody waits on a job that cannot succeed."""
    if not components:
        return "UNKNOWN"
    ordered = [components[k] for k in sorted(components)]
    failed = [c for c in ordered if c.failed]
    if failed:
        return base_state(failed[0].state)
    states = {base_state(c.state) for c in ordered}
    if states <= SUCCESS_STATES:
        return "COMPLETED"
    if states & ACTIVE_STATES:
        return "RUNNING"
    if states & PENDING_STATES:
        return "PENDING"
    return "RUNNING"


class SlurmUnreachableError(RuntimeError):
    """sacct is missing, does not answer, or cannot reach the Slurm database."""


SLURM_FIX = (
    "fix: run this on a login node of the cluster that ran the job; on this machine's test cluster, "
    "start it with `tools/slurm_local up` (`tools/slurm_local status` says what runs)"
)
"""What to do when Slurm cannot be reached."""


def query_sacct(job_id: str, timeout_s: float = 30.0) -> str:
    """Run sacct for ``job_id`` (all components and steps); raises SlurmUnreachableError when unavailable."""
    command = ["sacct", "-j", checked_job_id(job_id), "-o", ",".join(SACCT_FIELDS), "--parsable2", "--noconvert"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError as exc:
        raise SlurmUnreachableError("sacct is not installed here") from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmUnreachableError(f"sacct did not answer within {timeout_s:.0f} s") from exc
    if done.returncode != 0:
        first = next((line for line in done.stderr.splitlines() if line.strip()), "no error text")
        raise SlurmUnreachableError(f"sacct cannot reach Slurm (exit {done.returncode}: {first.strip()})")
    return done.stdout
