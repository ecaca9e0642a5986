"""``--local``: both components as process groups on this machine, same environment contract as
Slurm, everything on loopback.

The supervision rule is the batch script's: the trainer decides the outcome (when it ends, the
capture component is stopped); a capture failure stops the trainer and fails the run.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from launcher.component import start_component, stop_processes
from launcher.deaths import Death, first_cause, last_words, order_deaths, same_reason
from launcher.environment import COMPONENTS, current_environment, local_placement
from launcher.jobs import JobRecord, write_local_status
from runtime.files import DiskFullError
from runtime.recipe import ResolvedRecipe
from runtime.shared.contracts import TRAINER_EXIT_STOPPED, probe_again_command, resume_command
from runtime.shared.lifecycle import exit_text

POLL_INTERVAL_S = 0.5
PEER_REFUSAL_WAIT_S = 5.0
"""How long the supervisor lets the other ranks of a component finish refusing after one rank refused:
every rank refuses a corrupt checkpoint together, and the rank whose exit is seen first is a race."""
_TRACEBACK_START = re.compile(
    r"^(Traceback \(most recent call last\):|Exception in |Exception ignored (in|on) "
    r"|During handling of the above exception|The above exception was the direct cause)"
)
"""The first line of a traceback block in a task's log (or of the next part of a chained one)."""
_OWN_LINE = re.compile(r"^(\[\w+( rank \d+)?\] |\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")
"""A line the component itself writes (``[trainer] ...``, ``[trainer rank 0] error: ...``, a logged line)."""
PROBE_CAPTURE_FINISH_S = 15.0
"""How long a probe's capture may take to end on its own after the trainer passed (it then stops its link
master); only a capture still running after that is stopped."""
STATUS_RESERVE_BYTES = 256 * 1024
"""Space the supervisor holds in the job folder (a hidden file) and gives up when the disk fills, so that
the summary it writes last still fits: a full disk must not leave ``local_status.json`` saying RUNNING."""
STATUS_RESERVE_FILENAME = ".local_status.reserve"


@dataclass
class LocalTask:
    """One running component task."""

    component: str
    rank: int
    process: subprocess.Popen[bytes]
    log: IO[bytes]
    log_path: Path
    echo_offset: int = 0
    in_traceback: bool = False
    """The echo is inside a traceback block of this task's log (kept in the log, not on the console)."""
    tracebacks: int = 0
    """Traceback blocks of this task's log left off the console so far."""


class LocalRun:
    """Starts, watches and stops the component tasks of one ``--local`` job."""

    def __init__(self, resolved: ResolvedRecipe, record: JobRecord, probe: bool, echo: bool = True) -> None:
        self.resolved = resolved
        self.record = record
        self.probe = probe
        self.echo = echo
        self.tasks: list[LocalTask] = []
        self.status: dict[str, dict[str, object]] = {}
        self._stop_requested = False
        self._round = 0
        self.deaths: dict[tuple[str, int], Death] = {}
        self.first_death: Death | None = None
        """Tasks that ended badly on their own, by (component, rank), with the poll round they were seen in."""
        self.stop_grace_s = float(resolved.recipe.job.stop_grace_s)

    def _start(self) -> None:
        self._hold_status_reserve()
        base_env = current_environment()
        for component in COMPONENTS:
            world = self.record.components[component]
            for rank in range(world):
                log_path = self.record.log_path(component, rank)
                log_path.parent.mkdir(parents=True, exist_ok=True)
                log = log_path.open("ab")
                process = start_component(
                    self.resolved.recipe,
                    local_placement(component, rank, world),
                    self.resolved.job_dir,
                    self.resolved.path,
                    base_env,
                    probe=self.probe,
                    cwd=self.resolved.repo_root,
                    stdout=log,
                )
                self.tasks.append(LocalTask(component, rank, process, log, log_path))
            self.status[component] = {
                "state": "RUNNING",
                "tasks": world,
                "exit_codes": {},
                "started_at": time.time(),
                # what `status` and `cancel` need when this supervisor is gone (kill -9)
                "pids": {str(t.rank): t.process.pid for t in self._component_tasks(component)},
            }
        self._save_status()

    def _hold_status_reserve(self) -> None:
        with contextlib.suppress(OSError):  # a disk already full: nothing to hold
            (self.resolved.job_dir / STATUS_RESERVE_FILENAME).write_bytes(b"\0" * STATUS_RESERVE_BYTES)

    def _save_status(self) -> None:
        try:
            try:
                write_local_status(self.resolved.job_dir, self.status)
            except DiskFullError:
                reserve = self.resolved.job_dir / STATUS_RESERVE_FILENAME
                if not reserve.exists():
                    raise
                reserve.unlink()  # give up the held space: the summary must be true
                write_local_status(self.resolved.job_dir, self.status)
        except OSError as exc:
            # A full disk must not crash the supervisor (its children would be left unwatched): the
            # terminal gets the reason; the components keep running and are stopped as usual.
            print(
                f"[local] cannot record the component states in {self.resolved.job_dir} ({exc.strerror or exc}); "
                f"states now: {self.status}",
                file=sys.stderr,
                flush=True,
            )

    def _component_tasks(self, component: str) -> list[LocalTask]:
        return [t for t in self.tasks if t.component == component]

    def _component_exit(self, component: str) -> int | None:
        """None while any task runs; else the first non-zero exit code, or 0."""
        codes = [t.process.poll() for t in self._component_tasks(component)]
        if any(c is None for c in codes):
            failed = [c for c in codes if c not in (None, 0)]
            return failed[0] if failed else None  # one failed rank fails the component at once
        return next((c for c in codes if c != 0), 0)

    def _finish(self, component: str, code: int, state: str | None = None) -> None:
        self._note_deaths(component)  # tasks of it that ended badly on their own before this stop
        stop_processes([t.process for t in self._component_tasks(component)], self.stop_grace_s)
        codes = {str(t.rank): t.process.returncode for t in self._component_tasks(component)}
        self.status[component] = {
            "state": state or ("COMPLETED" if code == 0 else "FAILED"),
            "tasks": len(codes),
            "exit_codes": codes,
            "started_at": self.status.get(component, {}).get("started_at"),
            "ended_at": time.time(),
        }
        first = self.first_death
        if first is not None:  # why it ended, for `status`
            own = order_deaths([d for d in self.deaths.values() if d.component == component])
            if first.component == component:
                reason = first.describe()
            elif own:
                reason = f"{own[0].describe()}, after {first.component} rank {first.rank} died first"
            else:
                reason = f"stopped after {first.component} rank {first.rank} died"
            self.status[component]["reason"] = reason
        self._save_status()

    def _echo_logs(self) -> None:
        if not self.echo:
            return
        for task in self.tasks:
            if task.rank != 0:
                continue
            try:
                with task.log_path.open("rb") as handle:
                    handle.seek(task.echo_offset)
                    chunk = handle.read()
            except FileNotFoundError:
                continue
            if not chunk:
                continue
            complete = chunk.rfind(b"\n") + 1
            if complete == 0:
                continue
            task.echo_offset += complete
            prefix = f"[{task.component}]"
            for line in chunk[:complete].decode(errors="replace").splitlines():
                if self._traceback_line(task, line):
                    continue
                # The trainer's own lines already start with "[trainer]" and a refusal with
                # "[trainer rank 0]" (runtime/shared/refusal.py): no second prefix.
                named = line.startswith((prefix, f"[{task.component} rank "))
                print(line if named else f"{prefix} {line}", flush=True)

    def _traceback_line(self, task: LocalTask, line: str) -> bool:
        """Whether ``line`` belongs to a traceback block (Python's, a library thread's, an ignored exception's):
        those stay in the task's log, and the console gets one line for the first block of the task, naming
        its last line and the log. A peer's consequence and a writer thread's failure on a full disk must not
        bury the cause between the first line and the summary."""
        text = line.removeprefix(f"[rank{task.rank}]: ")
        if _TRACEBACK_START.match(text) or (task.in_traceback and (not text.strip() or text[:1].isspace())):
            task.in_traceback = True
            return True
        if not task.in_traceback:
            return bool(task.tracebacks) and not text.strip()  # the blank line between two blocks
        # The exception's own line ends the block; so does a line of the program's own (a "[trainer rank 0]
        # error: ..." refusal, a logged line), which is shown: a block cut short must not take it along.
        own = _OWN_LINE.match(text) is not None
        task.in_traceback = False
        task.tracebacks += 1
        # After another task's death a traceback is its consequence: the summary lists it, after the cause.
        others_died = any(t is not task and t.process.poll() not in (None, 0) for t in self.tasks)
        if task.tracebacks == 1 and not others_died:
            ending = "" if own else f" ending `{text.strip()[:200]}`"
            print(f"[{task.component}] (a traceback{ending}: in {task.log_path})", flush=True)
        return not own

    def _request_stop(self, signum: int, frame: object) -> None:
        self._stop_requested = True

    def run(self) -> int:
        """Run to completion; returns the job's exit code (the trainer's, or the capture failure's)."""
        previous = {s: signal.signal(s, self._request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._start()
            return self._supervise()
        finally:
            stop_processes([t.process for t in self.tasks], self.stop_grace_s)
            for task in self.tasks:
                task.log.close()
            with contextlib.suppress(OSError):
                (self.resolved.job_dir / STATUS_RESERVE_FILENAME).unlink()
            self._echo_logs()
            self._repeat_the_cause()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _stop_keeping_the_work(self) -> int:
        """Ctrl-C or SIGTERM: the trainer first, while the capture and its Mooncake master still serve
        the samples of the step it is in (it finishes that step, checkpoints and leaves), then the
        capture. Stopped the other way round, the trainer waits for samples that never come and is
        killed after the grace period without a checkpoint."""
        print(
            "[local] stop requested: the trainer finishes its step (or drops it when its samples do not come "
            "within a second) and writes a checkpoint (up to "
            f"job.stop_grace_s = {self.stop_grace_s:.0f} s), then the capture and the Mooncake master stop",
            file=sys.stderr,
            flush=True,
        )
        trainer = self._component_tasks("trainer")
        stop_processes([t.process for t in trainer], self.stop_grace_s)
        kept = all(t.process.returncode in (TRAINER_EXIT_STOPPED, 0) for t in trainer)
        self._finish("trainer", 130, state="STOPPED" if kept else "CANCELLED")
        self._finish("capture", 130, state="STOPPED")
        print(self._stop_summary(kept), file=sys.stderr, flush=True)
        return 130

    def _stop_summary(self, kept: bool) -> str:
        """What the stop kept and how to go on, from trainer rank 0's log."""
        log = self.record.log_path("trainer", 0)
        text = log.read_text(errors="replace") if log.exists() else ""
        stopped = [line for line in text.splitlines() if "stopped after step" in line]
        resume = self.resume_command()
        if self.probe:  # the probe keeps nothing: no step boundary, no checkpoint
            return f"[local] STOPPED the probe (it measures the site and keeps nothing); run it again with `{resume}`"
        if kept and stopped:
            where = stopped[-1].split("[trainer] ", 1)[-1]
            return f"[local] STOPPED: {where}; resume with `{resume}`"
        return (
            f"[local] STOPPED without a new checkpoint (the trainer did not reach its step boundary within "
            f"job.stop_grace_s = {self.stop_grace_s:.0f} s); `{resume}` continues from the last one there is"
        )

    def how_to_go_on(self) -> str:
        """``resume with `...``` (a probe: ``run the probe again with `...```)."""
        verb = "run the probe again with" if self.probe else "resume with"
        return f"{verb} `{self.resume_command()}`"

    def resume_command(self) -> str:
        """The command that continues this job from its newest checkpoint (a probe: runs it again)."""
        if self.probe:
            return probe_again_command(self.record.job_dir, self.record.recipe_source, local=True)
        return resume_command(self.record.job_dir, local=True)

    def _note_deaths(self, component: str | None = None) -> None:
        """Record every task seen ended badly for the first time, with this poll round (a new one); with
        ``component``, only its tasks, counted after the current round (about to be stopped)."""
        if component is None:
            self._round += 1
        for task in self._component_tasks(component) if component else self.tasks:
            code = task.process.poll()
            key = (task.component, task.rank)
            if code not in (None, 0) and key not in self.deaths:
                seen = self._round if component is None else self._round + 1
                self.deaths[key] = Death(task.component, task.rank, code, seen, last_words(task.log_path))

    def _report_first_death(self) -> Death | None:
        """Print the cause of the failure: the first task that died, with its exit and the resume command."""
        self._note_deaths()  # one that died after this round's look, before the exit check that saw it
        ordered = order_deaths(list(self.deaths.values()))
        if not ordered:
            return None
        first = self.first_death = first_cause(ordered)
        resume = "" if first.says_how_to_resume() else f"; {self.how_to_go_on()}"
        print(f"[local] FAILED: {first.pointed()}{resume}", file=sys.stderr, flush=True)
        return first

    def _repeat_the_cause(self) -> None:
        """The last line of a failed run names the cause again: the logs echoed after the first death are
        mostly its peers' reactions (connection resets, aborts), which must not read as the cause."""
        first = self.first_death
        if first is None:
            return
        print(
            f"[local] the cause, above: {first.cause()} (what its peers logged after it are consequences); "
            f"{self.how_to_go_on()}",
            file=sys.stderr,
            flush=True,
        )

    def _report_consequences(self, first: Death | None) -> None:
        """After the stop: the other tasks that had died on their own, named as what followed the cause."""
        rest = [d for d in order_deaths(list(self.deaths.values())) if d != first]
        if first is None or not rest:
            return
        # Peers that refused with the cause's own words are one item, not the same line again each.
        same = [d for d in rest if d.refused() and same_reason(d, first)]
        listed = "; ".join(d.describe() for d in rest if d not in same)
        if same:
            ranks = ", ".join(str(d.rank) for d in same)
            codes = {exit_text(d.code) for d in same}
            listed = "; ".join(
                filter(
                    None,
                    [f"{same[0].component} rank(s) {ranks} {', '.join(sorted(codes))} with the same error", listed],
                )
            )
        print(
            f"[local] after {first.component} rank {first.rank} (consequences, not the cause): {listed}",
            file=sys.stderr,
            flush=True,
        )

    def _let_peers_refuse(self, component: str) -> None:
        """When a rank of ``component`` refused in its own words, give its running peers up to
        :data:`PEER_REFUSAL_WAIT_S` to end on their own: those refusing the same thing then count as one
        cause, named by the lowest rank (whose line the console shows), instead of whichever exit won."""
        if not any(d.component == component and d.refused() for d in self.deaths.values()):
            return
        deadline = time.monotonic() + PEER_REFUSAL_WAIT_S
        tasks = self._component_tasks(component)
        while time.monotonic() < deadline and any(t.process.poll() is None for t in tasks):
            time.sleep(0.1)
        self._echo_logs()
        self._note_deaths()

    def _let_probe_capture_finish(self) -> int | None:
        """A probe whose trainer passed: the capture's part ends on its own once trainer rank 0 has read
        the link objects (it stops its master and exits 0). Wait for that, up to
        :data:`PROBE_CAPTURE_FINISH_S` (or ``job.stop_grace_s`` if shorter), rather than stop it mid-way;
        returns its exit as :meth:`_component_exit` does (None: still running)."""
        deadline = time.monotonic() + min(PROBE_CAPTURE_FINISH_S, self.stop_grace_s)
        while (code := self._component_exit("capture")) is None and time.monotonic() < deadline:
            if self._stop_requested:  # Ctrl-C: stop it now
                break
            time.sleep(0.1)
        self._echo_logs()
        return code

    def _supervise(self) -> int:
        while True:
            self._echo_logs()
            if self._stop_requested:
                return self._stop_keeping_the_work()
            self._note_deaths()
            trainer_code = self._component_exit("trainer")
            if trainer_code is not None:
                if trainer_code != 0:
                    self._let_peers_refuse("trainer")
                first = self._report_first_death() if trainer_code != 0 else None
                self._finish("trainer", trainer_code)
                capture_code = self._component_exit("capture")
                if capture_code is None and trainer_code == 0 and self.probe:
                    capture_code = self._let_probe_capture_finish()
                if capture_code is None:
                    # The trainer is done: the capture's job is too. SIGTERM makes it finish the sample
                    # being written and exit 0, which is a completed capture (as on Slurm, where the
                    # stop file ends it); anything else, or a failed trainer, leaves it STOPPED.
                    capture = [t.process for t in self._component_tasks("capture")]
                    stop_processes(capture, self.stop_grace_s)
                    clean = trainer_code == 0 and all(p.returncode == 0 for p in capture)
                    self._finish("capture", 0, state="COMPLETED" if clean else "STOPPED")
                else:
                    self._finish("capture", capture_code)
                self._report_consequences(first)
                return trainer_code
            capture_code = self._component_exit("capture")
            if capture_code not in (None, 0) and self.status["capture"]["state"] == "RUNNING":
                first = self._report_first_death()
                print("[local] stopping the trainer", file=sys.stderr, flush=True)
                self._finish("capture", capture_code)
                self._finish("trainer", capture_code, state="CANCELLED")
                self._report_consequences(first)
                return capture_code
            if capture_code == 0 and self.status["capture"]["state"] == "RUNNING":
                self._finish("capture", 0)
            time.sleep(POLL_INTERVAL_S)
