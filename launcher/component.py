"""Run one component task: its command, its environment, and a child process that is stopped cleanly.

Shared by the Slurm worker (one per srun task) and the ``--local`` supervisor so that both start
exactly the same command under the same environment contract. :func:`run_attached` runs the launcher's
other children (``eval --local``, the data.prepare_commands, the plots) so that they die with it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from launcher.environment import TaskPlacement, component_environment
from runtime.recipe import Recipe
from runtime.shared.contracts import ENV_PARENT_PID
from runtime.shared.lifecycle import FORWARDED_SIGNALS, die_with_parent, exit_text

RUNTIME_MODULES = {"capture": "runtime.capture", "trainer": "runtime.trainer"}
PROBE_MODULE = "runtime.probe"
STOP_GRACE_S = 30.0
"""Seconds a child gets between SIGTERM and SIGKILL."""


def component_command(component: str, recipe_path: Path, probe: bool) -> list[str]:
    """The command line of one component task (the worker's own interpreter runs it)."""
    module = PROBE_MODULE if probe else RUNTIME_MODULES[component]
    args = [sys.executable, "-u", "-m", module, "--recipe", str(recipe_path)]
    if probe:
        args += ["--component", component]
    return args


def start_component(
    recipe: Recipe,
    placement: TaskPlacement,
    job_dir: Path,
    recipe_path: Path,
    base_env: Mapping[str, str],
    probe: bool,
    cwd: Path,
    stdout: object = None,
    requeue_count: int = 0,
) -> subprocess.Popen[bytes]:
    """Start one component task as a child in its own process group."""
    env = component_environment(recipe, placement, job_dir, recipe_path, base_env, requeue_count)
    command = component_command(placement.component, recipe_path, probe)
    return spawn_component(command, env, cwd, stdout)


def spawn_component(
    command: list[str], env: Mapping[str, str], cwd: Path, stdout: object = None
) -> subprocess.Popen[bytes]:
    """Start ``command`` as a component task: its own session, the parent-death signal, the time-out
    signal ignored, and this process's pid in ``DSPARK_PARENT_PID`` for its orphan watch."""
    parent_pid = os.getpid()
    return subprocess.Popen(
        command,
        env={**env, ENV_PARENT_PID: str(parent_pid)},
        cwd=str(cwd),
        stdout=stdout,  # type: ignore[arg-type]
        stderr=subprocess.STDOUT if stdout is not None else None,
        start_new_session=True,
        preexec_fn=functools.partial(_prepare_child, parent_pid),
    )


def _prepare_child(parent_pid: int) -> None:
    # Its own session keeps terminal signals away from the component, so it must learn of its
    # supervisor's death another way: a SIGKILLed supervisor (or worker) sends it SIGTERM, and the
    # component stops as it does on any SIGTERM (the capture stops its master; the trainer
    # checkpoints at the next step boundary); its orphan watch (exit_when_orphaned) ends it after
    # job.stop_grace_s if that stop does not finish.
    die_with_parent(signal.SIGTERM, parent_pid)
    _ignore_requeue_signal()


def _ignore_requeue_signal() -> None:
    # Slurm delivers the time-out signal (USR2) to every process of the step, the component too,
    # whose default action would kill it. The worker owns that signal (checkpoint + requeue); the
    # component starts with it ignored (SIG_IGN survives exec) and stops on the SIGTERM that follows.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def stop_process(process: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> int | None:
    """SIGTERM the child's process group, wait ``grace_s``, then SIGKILL it. Returns its exit code."""
    stop_processes([process], grace_s)
    return process.returncode


def stop_processes(processes: list[subprocess.Popen[bytes]], grace_s: float = STOP_GRACE_S) -> None:
    """Stop several children at once: SIGTERM every process group first, then wait for all of them
    under ONE ``grace_s`` deadline, then SIGKILL what is left. (One at a time, four trainer ranks that
    each finish their step took four grace periods.)"""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in running):
        time.sleep(0.1)
    for process in running:
        if process.poll() is None:
            signal_group(process, signal.SIGKILL)
            process.wait()


def signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    """Send ``signum`` to the child's process group (it runs in its own session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


CHILD_STOP_GRACE_S = 30.0
"""How long a stopped child has to leave before its process group is killed."""


class ChildStopped(Exception):
    """The parent was asked to stop (a signal of :data:`FORWARDED_SIGNALS`) while it waited for its child;
    the child was stopped with it. ``signum`` names the signal, ``returncode`` how the child ended."""

    def __init__(self, signum: int, returncode: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}; the child {exit_text(returncode)}")
        self.signum = signum
        self.returncode = returncode


def run_attached(
    command: list[str],
    *,
    cwd: str | os.PathLike[str],
    env: dict[str, str] | None = None,
    capture: bool = False,
    timeout_s: float | None = None,
    grace_s: float = CHILD_STOP_GRACE_S,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` as a child that lives no longer than this process: its own session (so a terminal's
    Ctrl-C reaches only this process, which passes it on once), the parent-death signal (a ``kill -9`` of
    this process sends the child SIGTERM), and every stop signal this process gets passed on to the child's
    whole process group as SIGTERM; a child still there ``grace_s`` later is killed. Raises
    :class:`ChildStopped` after such a stop, ``subprocess.TimeoutExpired`` after ``timeout_s`` (the child's
    group killed). With ``capture`` the output is returned as text, else it goes to this terminal."""
    parent_pid = os.getpid()
    received: list[int] = []
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.PIPE if capture else None,
        text=True,
        start_new_session=True,
        preexec_fn=functools.partial(die_with_parent, signal.SIGTERM, parent_pid),
    )

    def stop_child(signum: int, _frame: object) -> None:
        received.append(signum)
        _signal_group(process.pid, signal.SIGTERM)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in FORWARDED_SIGNALS:
            previous[signum] = signal.signal(signum, stop_child)
    try:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        kill_at: float | None = None
        while True:
            try:
                out, err = process.communicate(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if received and kill_at is None:  # stopped: the child has its grace, then its group is killed
                    kill_at = now + grace_s
                timed_out = deadline is not None and now >= deadline
                if timed_out or (kill_at is not None and now >= kill_at):
                    _signal_group(process.pid, signal.SIGKILL)
                    out, err = process.communicate()
                    if timed_out and not received:
                        raise subprocess.TimeoutExpired(command, timeout_s or 0.0, out, err) from None
                    break
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if process.poll() is None:  # an exception of our own: the child does not outlive it
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
    if received:
        raise ChildStopped(received[0], process.returncode)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)
