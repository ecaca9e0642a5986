"""``status``, ``logs`` and ``cancel`` for a job, Slurm or local."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from submitit.core import utils

from launcher.failure_reason import batch_log_path, failure_reason
from launcher.hetjob import SUBMITIT_DIRNAME, task_index
from launcher.jobs import JobRecord, newest_checkpoint, read_local_status
from launcher.slurm_args import checked_job_id
from launcher.slurm_state import (
    SLURM_FIX,
    ComponentState,
    SlurmUnreachableError,
    base_state,
    fold_state,
    parse_sacct,
    query_sacct,
)
from runtime.shared.contracts import probe_again_command, resume_command
from runtime.user_errors import UserError, file_kind_problem

TERMINAL_JOB_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "STOPPED",
    "LOST",
}


@dataclass
class ComponentReport:
    """One component's state for an operator."""

    name: str
    het_group: int | None
    """None for a ``job.layout: one_node`` job (its components are steps of one plain job)."""
    state: str
    tasks: int
    results: dict[int, str] = field(default_factory=dict)
    """Rank -> ``success`` / ``error`` from the task result files."""
    exit_code: str = ""
    nodes: str = ""
    elapsed: str = ""
    reason: str = ""
    """Why a pending component waits (sacct's Reason), empty otherwise."""

    def describe(self) -> str:
        """``trainer PENDING (Resources)``, or ``capture RUNNING``."""
        return f"{self.name} {self.state}" + (f" ({self.reason})" if self.reason else "")


@dataclass
class JobReport:
    """A job's state: one line per component plus the folded job state."""

    record: JobRecord
    state: str
    components: list[ComponentReport]
    note: str = ""
    slurm_unreachable: bool = False
    """sacct could not be asked: the state is unknown, not merely pending."""
    unlisted: bool = False
    """sacct answered but does not list the job: just submitted, or long gone from its records."""
    resume_hint: str = ""
    """For a job that ended without completing: its newest complete checkpoint and the command that
    continues from it."""
    eval_line: str = ""
    """The evaluation that goes with the run: the Slurm eval job's state, or where a local run's results are."""

    @property
    def failed(self) -> bool:
        """The job ended in anything but success."""
        return self.state in TERMINAL_JOB_STATES and self.state != "COMPLETED"

    def render(self) -> str:
        """A small table for the terminal or a log."""
        lines = [
            f"job {self.record.job_id} ({self.record.mode}) '{self.record.name}': {self.state}",
            f"  folder {self.record.job_dir}",
            *([f"  {describe_parent(self.record.parent)}"] if self.record.parent else []),
            f"  {'component':<10} {'group':>5} {'state':<12} {'exit':<6} {'tasks ok':<9} {'elapsed':<10} nodes",
        ]
        for c in self.components:
            ok = sum(1 for r in c.results.values() if r == "success")
            lines.append(
                f"  {c.name:<10} {'-' if c.het_group is None else c.het_group:>5} {c.state:<12} {c.exit_code or '-':<6} "
                f"{ok}/{c.tasks:<7} {c.elapsed or '-':<10} {c.nodes or '-'}"
                + (f"  (waiting: {c.reason})" if c.reason else "")
            )
        if self.note:
            lines.append(f"  note: {self.note}")
        if self.resume_hint:
            lines.append(f"  {self.resume_hint}")
        if self.eval_line:
            lines.append(f"  {self.eval_line}")
        return "\n".join(lines)


def _task_results(record: JobRecord, component: str, tasks: int) -> dict[int, str]:
    folder = Path(record.job_dir) / SUBMITIT_DIRNAME
    results: dict[int, str] = {}
    for rank in range(tasks):
        task = task_index(component, rank, record.trainer_world_size)
        path = utils.JobPaths(folder, job_id=record.job_id, task_id=task).result_pickle
        if path.exists():
            try:
                outcome, _ = utils.pickle_load(path)
            except Exception:  # a result being written right now; report it next time
                continue
            results[rank] = str(outcome)
    return results


def job_report(record: JobRecord) -> JobReport:
    """The current state of a job. Never waits on a job: one sacct call, with a timeout."""
    if record.mode == "local":
        return _local_report(record)
    note = ""
    unreachable = False
    try:
        components = parse_sacct(query_sacct(record.job_id), record.job_id)
    except SlurmUnreachableError as exc:
        components, note, unreachable = {}, str(exc), True
    reports = []
    for group, (name, tasks) in enumerate(record.components.items()):
        # A one-node job is one plain job: both components are its steps, and its state is theirs.
        sacct: ComponentState | None = components.get(0 if record.one_node else group)
        results = _task_results(record, name, tasks)
        # Not listed yet right after submission: the job waits to be scheduled.
        state = sacct.state.split()[0] if sacct else ("UNKNOWN" if unreachable else "PENDING")
        if any(r == "error" for r in results.values()) and state in {"RUNNING", "COMPLETING", "UNKNOWN"}:
            state = "FAILED"
        reports.append(
            ComponentReport(
                name=name,
                het_group=None if record.one_node else group,
                state=state,
                tasks=tasks,
                results=results,
                exit_code=sacct.exit_code if sacct else "",
                nodes=sacct.nodes if sacct else "",
                elapsed=sacct.elapsed if sacct else "",
                reason=sacct.reason if sacct and state in {"PENDING", "REQUEUED"} else "",
            )
        )
    if components:
        state = fold_state(components)
    elif not note:
        state, note = "PENDING", "sacct does not list the job yet (it appears a few seconds after submission)"
    else:
        state = "UNKNOWN"
    if any(r.state == "FAILED" for r in reports) and state not in TERMINAL_JOB_STATES:
        state = "FAILED"
    if state in TERMINAL_JOB_STATES - {"COMPLETED"}:
        reason = failure_reason(Path(record.job_dir), record.job_id, log_files(record, None, None))
        note = "; ".join(part for part in (note, reason) if part)
    return JobReport(
        record=record,
        state=state,
        components=reports,
        note=note,
        slurm_unreachable=unreachable,
        unlisted=not components and not unreachable,
        resume_hint=resume_hint(record) if state in TERMINAL_JOB_STATES - {"COMPLETED"} else "",
        eval_line=_eval_job_line(record) if not unreachable else "",
    )


def _eval_job_line(record: JobRecord) -> str:
    """The state of the eval job submitted with a Slurm training job (``eval.after_training``)."""
    if not record.eval_job_id:
        return ""
    try:
        found = parse_sacct(query_sacct(record.eval_job_id), record.eval_job_id).get(0)
    except SlurmUnreachableError as exc:
        return f"eval job {record.eval_job_id} (after training): state unknown ({exc})"
    if found is None:
        return f"eval job {record.eval_job_id} (after training): PENDING (waits for this job to complete)"
    reason = f" ({found.reason})" if found.reason else ""
    where = f"; results in {Path(record.job_dir) / 'eval'}" if base_state(found.state) == "COMPLETED" else ""
    return f"eval job {record.eval_job_id} (after training): {base_state(found.state)}{reason}{where}"


def describe_parent(parent: dict[str, str]) -> str:
    """``continues job X (the same run) from CHECKPOINT`` or ``forked from job X at CHECKPOINT (a new run)``."""
    where = f"job {parent.get('job_id')} ({parent.get('job_dir')})"
    if parent.get("kind") == "fork":
        return f"parent: forked from {where} at {parent.get('checkpoint')} (a new run, its recipe may differ)"
    return f"parent: resumes {where} from {parent.get('checkpoint')} (the same run)"


def resume_hint(record: JobRecord) -> str:
    """The newest complete checkpoint of an ended job and the command that continues from it."""
    if record.probe:
        command = probe_again_command(record.job_dir, record.recipe_source, local=record.mode == "local")
        return f"a probe keeps nothing to resume; run it again with `{command}`"
    command = resume_command(record.job_dir, local=record.mode == "local")
    try:
        newest = newest_checkpoint(record)
    except (OSError, ValueError, UserError) as exc:  # a damaged or missing resolved recipe: say so, keep the status
        return f"checkpoints: cannot be listed ({exc}); `{command}` continues from the newest one there is"
    if newest is None:
        return f"checkpoints: none complete; `{command}` runs the same run again from its start"
    return f"checkpoint: newest complete {newest}; resume with `{command}`"


def _local_report(record: JobRecord) -> JobReport:
    status = read_local_status(Path(record.job_dir))
    supervisor_alive = is_local_supervisor(record)
    notes: list[str] = []
    trainer_finished = _trainer_finished_line(record)
    reports = []
    for group, (name, tasks) in enumerate(record.components.items()):
        entry = status.get(name, {})
        state = str(entry.get("state", "PENDING"))
        if state == "RUNNING" and not supervisor_alive:
            # The supervisor died (kill -9) before it recorded the end: say what really happened.
            leftover = component_pids(record, name)
            if leftover:
                state = "ORPHANED"
                notes.append(
                    f"{name} task(s) {', '.join(map(str, leftover))} still run without their supervisor; "
                    f"`python3 -m launcher cancel {record.command_ref}` stops them"
                )
            elif trainer_finished:
                state = "COMPLETED" if name == "trainer" else "STOPPED"
            else:
                state = "LOST"
        if entry.get("reason") and state in {"FAILED", "CANCELLED", "STOPPED"}:
            notes.append(f"{name} {state}: {entry['reason']}")
        codes = entry.get("exit_codes", {}) or {}
        results = {int(rank): ("success" if code == 0 else "error") for rank, code in dict(codes).items()}
        exit_code = ",".join(sorted({str(c) for c in dict(codes).values()})) if codes else ""
        reports.append(
            ComponentReport(name, group, state, tasks, results, exit_code, "localhost", _elapsed(entry, state))
        )
    states = {r.state for r in reports}
    if "FAILED" in states or "LOST" in states:
        state = "FAILED"
    elif "ORPHANED" in states:
        state = "ORPHANED"
    elif "CANCELLED" in states and "FAILED" not in states and not supervisor_alive:
        state = "CANCELLED"
    elif all(r.state == "COMPLETED" or (r.state == "STOPPED" and r.name != "trainer") for r in reports) and reports:
        state = "COMPLETED"  # the capture stops when the trainer is done
    elif all(r.state in {"COMPLETED", "STOPPED"} for r in reports) and reports:
        state = "STOPPED"  # the trainer was stopped (Ctrl-C, SIGTERM) with its checkpoint
    elif "RUNNING" in states:
        state = "RUNNING"
    else:
        state = "PENDING" if supervisor_alive else "UNKNOWN"
    if not supervisor_alive and state not in TERMINAL_JOB_STATES | {"ORPHANED"}:
        notes.append("the local supervisor is not running")
    elif not supervisor_alive and any(s == "RUNNING" for s in (str(e.get("state")) for e in status.values())):
        notes.append(
            f"the local supervisor (pid {record.supervisor_pid}) died before recording the end"
            + (f"; the trainer log says: {trainer_finished}" if trainer_finished else "")
        )
    return JobReport(
        record=record,
        state=state,
        components=reports,
        note="; ".join(notes),
        resume_hint=resume_hint(record) if state in TERMINAL_JOB_STATES - {"COMPLETED"} else "",
    )


def _elapsed(entry: dict, state: str) -> str:
    """``H:MM:SS`` a local component ran (so far, while it runs), as sacct writes Elapsed; empty if unknown."""
    started = entry.get("started_at")
    if not isinstance(started, int | float):
        return ""
    ended = entry.get("ended_at")
    if not isinstance(ended, int | float):
        if state != "RUNNING":
            return ""  # it ended without a record of when (its supervisor died)
        ended = time.time()
    seconds = max(0, int(ended - started))
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _trainer_finished_line(record: JobRecord) -> str:
    """The trainer's "finished N steps" line from rank 0's log, or empty."""
    path = record.log_path("trainer", 0)
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, path.stat().st_size - 65536))
            tail = handle.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line for line in tail.splitlines() if "[trainer] finished " in line]
    return lines[-1].strip() if lines else ""


def component_pids(record: JobRecord, component: str) -> list[int]:
    """Component task processes of this local job that are still alive (checked against their
    environment, so a reused pid is never taken for one of ours)."""
    entry = read_local_status(Path(record.job_dir)).get(component, {})
    found = []
    for pid in dict(entry.get("pids", {}) or {}).values():
        try:
            environ = Path(f"/proc/{int(pid)}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"DSPARK_JOB_DIR={record.job_dir}".encode() in environ:
            found.append(int(pid))
    return found


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _process_start_epoch_s(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), from /proc; None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot_s = next(
            float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot_s + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time in clock ticks


SUPERVISOR_LOCK = ".supervisor.lock"
"""Held open (flock) in the job folder by a ``--local`` supervisor for as long as it runs."""


def is_local_supervisor(record: JobRecord) -> bool:
    """The recorded supervisor pid is still this job's supervisor: a launcher process that started
    before the job was recorded. After the run ended the pid may belong to anything else."""
    pid = record.supervisor_pid
    if not pid or not _pid_alive(pid):
        return False
    try:
        arguments = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        recorded_s = dt.datetime.fromisoformat(record.submitted_at).timestamp()
    except (OSError, ValueError):
        return False
    started_s = _process_start_epoch_s(pid)
    # The supervisor is `python3 -m launcher ... --local`: a process that merely mentions the launcher
    # (an editor, a test run of tests/test_launcher_*.py) is not one. The record's time has whole
    # seconds; the supervisor started before it wrote the record.
    runs_launcher = any(a == "-m" and b == "launcher" for a, b in zip(arguments, arguments[1:], strict=False))
    if not (runs_launcher and "--local" in arguments and started_s is not None and started_s <= recorded_s + 1.0):
        return False
    # The supervisor holds SUPERVISOR_LOCK of its own job folder open while it runs: a copy of a
    # running job's folder (its job.json names the original's supervisor) is not that supervisor's job,
    # and neither is a copy made without its dot files (no lock there at all): only the process that
    # holds this very folder's lock is signalled.
    lock = Path(record.job_dir) / SUPERVISOR_LOCK
    if not lock.exists():
        return False
    try:
        held = {os.path.realpath(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    except OSError:
        return False
    return os.path.realpath(lock) in held


def running_local_jobs(runs_dir: Path) -> list[JobRecord]:
    """The ``--local`` jobs of ``runs_dir`` whose supervisor still runs (see :func:`is_local_supervisor`)."""
    from launcher.jobs import INDEX_DIRNAME, LATEST_ALIAS, JobLookupError, find_record

    index = runs_dir / INDEX_DIRNAME
    running = []
    for link in sorted(index.iterdir()) if index.is_dir() else []:
        if link.name == LATEST_ALIAS or link.name.startswith(".") or not link.name.startswith("local-"):
            continue
        try:
            record = find_record(link.name, runs_dir)
        except (OSError, JobLookupError):
            continue  # a damaged or half-written record is not a running job
        if record.mode == "local" and is_local_supervisor(record):
            running.append(record)
    return running


def cancel_job(record: JobRecord) -> str:
    """Cancel every component of the job; returns what was done."""
    if record.mode == "local":
        if is_local_supervisor(record):
            os.kill(record.supervisor_pid, signal.SIGTERM)  # type: ignore[arg-type]
            return f"sent SIGTERM to the local supervisor (pid {record.supervisor_pid})"
        leftover = [pid for name in record.components for pid in component_pids(record, name)]
        if not leftover:
            raise CancelError(
                f"job {record.job_id} is not running (its supervisor and every component task have ended), so "
                f"nothing was cancelled; fix: none needed (`python3 -m launcher status {record.command_ref}` shows how it "
                "ended)"
            )
        _stop_groups(leftover)
        return f"the supervisor was gone; stopped {len(leftover)} leftover component task(s): {leftover}"
    # Ask Slurm first: a job that already ended is reported as such and nothing is signalled (scancel
    # of an ended job succeeds silently, and the operator would read "cancelled").
    report = job_report(record)
    if not report.slurm_unreachable and report.state in TERMINAL_JOB_STATES:
        raise CancelError(
            f"job {record.job_id} already ended ({report.state}), so nothing was signalled; fix: none needed "
            f"(`python3 -m launcher status {record.command_ref}` shows how it ended)"
        )
    # The leader id cancels all het components at once.
    done = subprocess.run(
        ["scancel", checked_job_id(record.job_id)], capture_output=True, text=True, timeout=60, check=False
    )
    if "invalid job id" in done.stderr.lower():
        raise CancelError(
            f"Slurm does not know job {record.job_id} (scancel: {done.stderr.strip()}): it ended long ago, or ran on "
            f"another cluster; nothing was cancelled. `python3 -m launcher status {record.command_ref}` shows what is known"
        )
    if done.returncode != 0:
        raise CancelError(f"scancel {record.job_id} failed: {done.stderr.strip()}")
    return f"scancel {record.job_id}: both components cancelled"


class FollowError(UserError):
    """``logs --follow`` cannot tell when the job ends; the message says why and what to do."""


class CancelError(UserError):
    """``cancel`` could not cancel the job; the message says why and what to do."""


def _stop_groups(pids: list[int], grace_s: float = 30.0) -> None:
    """SIGTERM each task's process group (components run in their own sessions), SIGKILL after grace."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_pid_alive(pid) for pid in pids):
        time.sleep(0.2)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def log_files(record: JobRecord, component: str | None, rank: int | None) -> list[Path]:
    """Log files of the selected components/ranks, in het group and rank order."""
    files = []
    for name, tasks in record.components.items():
        if component and name != component:
            continue
        for r in range(tasks):
            if rank is None or r == rank:
                files.append(record.log_path(name, r))
    return files


def print_logs(
    record: JobRecord, component: str | None, rank: int | None, follow: bool, poll_s: float = 1.0, out: object = None
) -> None:
    """Print the selected logs with a header per file; with ``follow``, keep printing new lines
    until the job reaches a terminal state."""
    stream = out or sys.stdout
    files = log_files(record, component, rank)
    # A Slurm job that failed before its components started has only its batch script's log: shown
    # while no task log exists (a missing site variable, a failed job.setup line say why there).
    batch_log = batch_log_path(Path(record.job_dir), record.job_id) if record.mode == "slurm" else None
    offsets = {path: 0 for path in [*files, *([batch_log] if batch_log else [])]}
    headers_printed: set[Path] = set()

    def drain() -> None:
        shown = files if any(p.exists() for p in files) or batch_log is None else [*files, batch_log]
        for path in shown:
            if not path.exists():
                continue
            kind = file_kind_problem(path)
            if kind is not None:  # a FIFO would block the read for ever
                if path not in headers_printed:
                    print(f"==> {path} <==\n(skipped: it is {kind}, not a regular log file)", file=stream)
                    headers_printed.add(path)
                continue
            with path.open("rb") as handle:
                handle.seek(offsets[path])
                chunk = handle.read()
            if not chunk:
                continue
            if path not in headers_printed:
                print(f"==> {path} <==", file=stream)
                headers_printed.add(path)
            offsets[path] += len(chunk)
            stream.write(chunk.decode(errors="replace"))  # type: ignore[attr-defined]
        stream.flush()  # type: ignore[attr-defined]

    drain()
    if not follow:
        missing = [p for p in files if not p.exists()]
        if missing and len(missing) == len(files):
            shown = batch_log is not None and batch_log in headers_printed
            print(
                f"(no component logs{' (the batch log above is all the job wrote)' if shown else ' yet'}: "
                f"{', '.join(str(p) for p in missing)})",
                file=stream,
            )
        return
    while True:
        report = job_report(record)
        if report.slurm_unreachable:  # it would never see the job end: say so now, not after a silent hour
            raise FollowError(
                f"cannot follow job {record.job_id}: {report.note}, so its end cannot be seen; the logs above are what "
                f"it has written so far. {SLURM_FIX} (without --follow, `logs` prints the logs once)"
            )
        state = report.state
        drain()
        if state in TERMINAL_JOB_STATES:
            print(f"==> job {record.job_id} ended: {state} <==", file=stream)
            return
        time.sleep(poll_s)
