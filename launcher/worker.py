"""``python3 -m launcher.worker --component NAME --job-dir DIR``: one srun task of a hetjob.

Loads the submitit payload, derives the task's environment from its own het group's Slurm
variables, runs the component's runtime entry point as a child, and writes a submitit result file
under a job-wide task id. On the time-out signal only task 0 (trainer rank 0) checkpoints the
payload and requeues the job; every task stops its child cleanly on SIGTERM.

Stop order: the trainer first, then the capture; stopped the other way round, the trainer waits for
samples that never come and is killed without a checkpoint. On the time-out signal trainer rank 0's task
stops the trainer (a checkpoint at its next step boundary) while the capture serves, writes the stop
file, and only then requeues. On SIGTERM (``scancel``, the requeue, preemption) a capture task keeps its
component serving until the stop file appears or ``job.stop_grace_s`` has passed. Slurm signals every
process of a step, though, and the Mooncake master stops on SIGTERM by itself: after a plain ``scancel``
or a preemption the trainer drops the step whose samples stop coming and checkpoints the last one it
finished (runtime/trainer/loop.py), within the cluster's KillWait when the checkpoint is quick enough.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys
import time
import traceback
import types
from pathlib import Path

from submitit.core import job_environment, utils
from submitit.slurm.slurm import SlurmJobEnvironment

from launcher.component import STOP_GRACE_S, signal_group, start_component, stop_process
from launcher.deaths import Death, claim_first_death
from launcher.environment import COMPONENTS, current_environment, slurm_placement
from launcher.failure_reason import not_requeued_line, record_not_requeued
from launcher.hetjob import SUBMITIT_DIRNAME, ComponentJob, task_index
from launcher.jobs import CAPTURE_STOP_FILENAME
from launcher.plots import plot_metrics
from runtime.recipe import RESOLVED_FILENAME, load_resolved
from runtime.shared import contracts
from runtime.shared.contracts import how_to_go_on, resume_command_of

STOP_POLL_S = 1.0
"""How often a capture task looks for the batch script's stop file."""
SUBMISSION_WAIT_S = 120.0
"""How long a task waits for the payload pickle (submitit writes it just after sbatch returns)."""


class HetTaskEnvironment(SlurmJobEnvironment):
    """submitit's Slurm environment with the leader's job id and a job-wide task id, so that only
    task 0 (trainer rank 0) acts on a requeue signal."""

    _leader_job_id = ""
    _task = 0

    @classmethod
    def create(cls, leader_job_id: str, task: int) -> HetTaskEnvironment:
        """An environment for one task (submitit's JobEnvironment.__new__ takes no arguments)."""
        env = cls()
        env._leader_job_id = leader_job_id
        env._task = task
        return env

    @property
    def job_id(self) -> str:
        return self._leader_job_id

    @property
    def global_rank(self) -> int:
        return self._task


class ComponentSignalHandler(job_environment.SignalHandler):
    """submitit's handler, plus: stop the child cleanly before exiting, and forward SIGTERM."""

    child: object = None
    stopped_by_signal = False
    defer_stop = False
    """A capture task: on SIGTERM keep the component up until the trainer has stopped (module docstring)."""
    stop_requested_at: float | None = None
    """When a deferred stop was asked for (monotonic seconds)."""
    on_child_stopped: object = None
    """Called after :meth:`_exit` stopped the child (trainer rank 0: tell the capture it may stop)."""
    grace_s: float = STOP_GRACE_S
    """The recipe's ``job.stop_grace_s``: how long the child gets between SIGTERM and SIGKILL."""

    def forward_stop(self, signum: int, frame: types.FrameType | None = None) -> None:
        """SIGTERM from Slurm (cancel, preemption, requeue): pass it to the child's process group.
        The task then exits without a result file: sacct's state (CANCELLED, TIMEOUT, REQUEUED) is
        the truth, and an error result would outlive a requeue."""
        self.stopped_by_signal = True
        if self.defer_stop:
            self._logger.warning(
                f"caught {signal.Signals(signum).name}; the capture keeps serving until the trainer has stopped "
                f"(up to job.stop_grace_s = {self.grace_s:.0f} s), then stops"
            )
            self.stop_requested_at = time.monotonic()
            return
        self._logger.warning(f"caught {signal.Signals(signum).name}; stopping the component")
        if self.child is not None:
            signal_group(self.child, signal.SIGTERM)  # type: ignore[arg-type]

    def _exit(self) -> None:
        if self.child is not None:
            stop_process(self.child, self.grace_s)  # type: ignore[arg-type]
            if callable(self.on_child_stopped):
                self.on_child_stopped()
        super()._exit()

    stop_trainer_before_requeue = False
    """Trainer rank 0's task: on the time-out signal, stop the trainer (a checkpoint at its next step
    boundary, every rank at the same one) while the capture and its Mooncake master still serve, and
    only then requeue. The requeue's SIGTERM reaches every process of every step at once (the master
    stops on it by itself), so a checkpoint left for then would find no data to finish its step with."""

    def checkpoint_and_try_requeue(self, signum: int, frame: types.FrameType | None = None) -> None:
        """The time-out signal (USR2): the trainer stops first when this task leads it, then submitit's
        own handling (task 0 checkpoints the payload and requeues the job)."""
        if self.stop_trainer_before_requeue and self.child is not None and self.child.poll() is None:  # type: ignore[attr-defined]
            self._logger.warning(
                f"caught {signal.Signals(signum).name}: stopping the trainer at its next step boundary (a checkpoint) "
                f"before the requeue, up to job.stop_grace_s = {self.grace_s:.0f} s"
            )
            signal_group(self.child, signal.SIGTERM)  # type: ignore[arg-type]
            deadline = time.monotonic() + self.grace_s
            while time.monotonic() < deadline and self.child.poll() is None:  # type: ignore[attr-defined]
                time.sleep(0.2)
            self._logger.warning(f"the trainer has stopped (exit {self.child.poll()}); requeuing")  # type: ignore[attr-defined]
            if callable(self.on_child_stopped):
                self.on_child_stopped()
        super().checkpoint_and_try_requeue(signum, frame)

    def deferred_stop_due(self) -> bool:
        """A deferred stop whose wait for the trainer has run out."""
        return self.stop_requested_at is not None and time.monotonic() - self.stop_requested_at >= self.grace_s


def tell_capture_to_stop(job_dir: Path) -> None:
    """The trainer has stopped (trainer rank 0's task, after its child ended): the capture tasks may stop."""
    with contextlib.suppress(OSError):
        (job_dir / CAPTURE_STOP_FILENAME).touch()


def _wait_for_submission(path: Path) -> utils.DelayedSubmission:
    deadline = time.monotonic() + SUBMISSION_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"waited {SUBMISSION_WAIT_S:.0f} s for the job payload {path}; it is written by "
                "`python3 -m launcher` after sbatch returns, or by `launcher resolve` in a manual sbatch"
            )
        time.sleep(1)
    return utils.DelayedSubmission.load(path)


def _death_line(job_dir: Path, death: Death) -> str:
    """The line a task whose child ended badly prints: the cause (the job's first death, recorded in the
    shared job folder by whichever task saw its own first), with the resume command; a later death is
    named a consequence of that cause."""
    first = claim_first_death(job_dir, death)
    resume = how_to_go_on(job_dir)
    if (first.component, first.rank) == (death.component, death.rank):
        return f"FAILED (the first task to die): {death.describe()}; {resume}"
    return f"{death.describe()}: a consequence of {first.describe()}, which died first (the cause); {resume}"


def main(argv: list[str] | None = None) -> int:
    """Run one component task; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="python3 -m launcher.worker", description=__doc__)
    parser.add_argument("--component", required=True, choices=COMPONENTS)
    parser.add_argument("--job-dir", required=True, type=Path)
    parser.add_argument("--probe", action="store_true", help="run the environment probe instead of the runtime")
    args = parser.parse_args(argv)

    job_dir: Path = args.job_dir.resolve()
    resolved = load_resolved(job_dir / RESOLVED_FILENAME)
    recipe = resolved.recipe
    env = current_environment()
    leader = env.get(contracts.ENV_SLURM_JOB_ID) or env["SLURM_JOB_ID"]
    placement = slurm_placement(recipe, args.component, env)
    task = task_index(args.component, placement.rank, recipe.trainer_world_size)
    paths = utils.JobPaths(job_dir / SUBMITIT_DIRNAME, job_id=leader, task_id=task)
    log = f"[worker {args.component}/{placement.rank} task {task} on {socket.gethostname()}]"
    print(f"{log} job {leader}; capture host {placement.capture_host}; bind {placement.bind_address}", flush=True)

    # A result left by this task's run before a requeue must not describe this run.
    paths.result_pickle.unlink(missing_ok=True)
    delayed = _wait_for_submission(paths.submitted_pickle)
    payload = delayed.function
    if not isinstance(payload, ComponentJob):
        raise TypeError(f"{paths.submitted_pickle} holds {type(payload).__name__}, not a ComponentJob")
    handler = ComponentSignalHandler(HetTaskEnvironment.create(leader, task), paths, delayed)
    handler.grace_s = recipe.job.stop_grace_s
    handler.defer_stop = args.component == "capture"
    trainer_leader = args.component == "trainer" and placement.rank == 0
    if trainer_leader:
        handler.on_child_stopped = lambda: tell_capture_to_stop(job_dir)
        handler.stop_trainer_before_requeue = True
    signal.signal(signal.SIGTERM, handler.forward_stop)
    signal.signal(SlurmJobEnvironment._usr_sig(), handler.checkpoint_and_try_requeue)

    started = time.time()
    try:
        child = start_component(
            recipe,
            placement,
            job_dir,
            resolved.path,
            env,
            probe=args.probe or payload.probe,
            cwd=resolved.repo_root,
            # Slurm may requeue on its own (node failure) without our payload counting it.
            requeue_count=max(payload.requeue_count, int(env.get("SLURM_RESTART_COUNT") or 0)),
        )
        handler.child = child
        stopped_on_request = False
        stop_file = job_dir / CAPTURE_STOP_FILENAME
        while (code := child.poll()) is None:
            if args.component == "capture" and not stopped_on_request and stop_file.exists():
                # The trainer is done; the capture component has nothing left to serve.
                print(f"{log} the trainer has ended ({stop_file.name}); stopping the capture component", flush=True)
                stopped_on_request = True
                stop_process(child, recipe.job.stop_grace_s)
            elif handler.deferred_stop_due() and not stopped_on_request:
                print(
                    f"{log} the trainer has not stopped within job.stop_grace_s = {recipe.job.stop_grace_s} s; "
                    "stopping the capture component",
                    flush=True,
                )
                stopped_on_request = True
                stop_process(child, recipe.job.stop_grace_s)
            time.sleep(STOP_POLL_S)
        if trainer_leader and handler.stopped_by_signal:
            tell_capture_to_stop(job_dir)  # its checkpoint is written: the capture and the master may go
        if stopped_on_request:
            code = 0
        if handler.stopped_by_signal:
            print(f"{log} stopped by a signal (exit {code}); no result file", flush=True)
            return 128 + signal.SIGTERM
        if args.component == "trainer" and code == contracts.TRAINER_EXIT_STOPPED:
            # Another rank asked (trainer rank 0's task, before a requeue): every rank stopped at the same
            # step boundary with the checkpoint written. The requeue, not this task, decides what follows.
            print(
                f"{log} the trainer stopped at a step boundary with a checkpoint (exit {code}); no result file",
                flush=True,
            )
            return code
        result = {
            "component": args.component,
            "rank": placement.rank,
            "exit_code": code,
            "elapsed_s": round(time.time() - started, 3),
            "requeue_count": payload.requeue_count,
        }
        if code != 0:  # one line, with the log that says why; the reason goes into the result file
            task_log = job_dir / "logs" / f"{leader}_{args.component}_{placement.rank}.out"
            death = _death_line(job_dir, Death(args.component, placement.rank, code))
            print(f"{log} {death}; log {task_log}", file=sys.stderr, flush=True)
            _record_error(paths, f"{args.component} task {placement.rank} exited with code {code}")
            return 1
        with utils.temporary_save_path(paths.result_pickle) as tmp:
            utils.cloudpickle_dump(("success", result), tmp)
        print(f"{log} finished in {result['elapsed_s']} s", flush=True)
        if args.component == "trainer" and placement.rank == 0 and not (args.probe or payload.probe):  # no training
            ok, message = plot_metrics(job_dir, resolved.repo_root)
            print(f"{log} {message}", flush=True)
        return 0
    except utils.UncompletedJobError as exc:  # task 0 at a time-out whose requeues are spent: say so, no trace
        line = not_requeued_line(str(exc), recipe.job.max_requeues)
        with contextlib.suppress(OSError):
            record_not_requeued(job_dir, str(exc), recipe.job.max_requeues)
        print(f"{log} {line}; resume with `{resume_command_of(job_dir)}`", file=sys.stderr, flush=True)
        _record_error(paths, line)
        return 1
    except Exception:
        trace = traceback.format_exc()
        print(f"{log} failed:\n{trace}", file=sys.stderr, flush=True)
        _record_error(paths, trace)
        return 1


def _record_error(paths: utils.JobPaths, reason: str) -> None:
    """The task's result file says it failed, and why (``status`` counts it)."""
    paths.result_pickle.unlink(missing_ok=True)
    with utils.temporary_save_path(paths.result_pickle) as tmp:
        utils.cloudpickle_dump(("error", reason), tmp)


if __name__ == "__main__":
    sys.exit(main())
