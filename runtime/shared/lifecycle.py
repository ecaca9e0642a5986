"""Process lifetime rules shared by the launcher and the runtime (no torch, no heavy imports)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1
ORPHAN_POLL_S = 0.5
"""How often a component looks whether its supervisor is still its parent."""


def die_with_parent(signum: int = signal.SIGTERM, parent_pid: int | None = None) -> None:
    """Ask the kernel to send ``signum`` to this process when its parent thread exits (use as, or in, a
    ``preexec_fn``). A child in its own session never sees its parent's terminal or group signals:
    without this, a supervisor killed with SIGKILL leaves its children (and their ports) behind.
    The parent must start the child from a thread that lives as long as it does (the main thread).
    ``parent_pid`` (the parent's pid, taken before the fork) closes the race of a parent that died
    before the request was made: the child then sends itself ``signum`` at once."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signum)
    except OSError:
        pass
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)


def exit_when_orphaned(
    parent_pid: int | None, grace_s: float, poll_s: float = ORPHAN_POLL_S
) -> threading.Thread | None:
    """Watch, in a daemon thread, that ``parent_pid`` (the supervisor or Slurm worker) is still this
    process's parent; once it is gone, give the stop its parent-death signal started ``grace_s``
    seconds (a trainer checkpoints from the batch it holds), then SIGKILL this process. A rank whose
    stop waits for samples that will never come (the capture died with the same supervisor) no longer
    lives on. None (no watch) without a parent pid."""
    if not parent_pid:
        return None

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        print(
            f"[pid {os.getpid()}] its supervisor (pid {parent_pid}) is gone: stopping, and killed in {grace_s:.0f} s "
            "if still running",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="orphan-watch", daemon=True)
    thread.start()
    return thread


def exit_text(code: int) -> str:
    """How a child ended, in words, from its ``Popen.returncode``: ``killed by SIGKILL (-9)`` or
    ``exited with code 1``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} ({code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The stop signals a parent passes on to the child it waits for (``launcher.component.run_attached``)
and that :func:`stop_signals_deferred` holds back."""


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Hold :data:`FORWARDED_SIGNALS` back while the block runs (writing a set of result files: they are
    then all there or none of the new ones is); one that came meanwhile is delivered when it ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)
