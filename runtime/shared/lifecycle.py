"""Process lifetime rules shared by the launcher and the runtime (no torch, no heavy imports)."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``signum`` to this process when its parent thread exits (use as, or in, a
    ``preexec_fn``). A child in its own session never sees its parent's terminal or group signals:
    without this, a supervisor killed with SIGKILL leaves its children (and their ports) behind.
    The parent must start the child from a thread that lives as long as it does (the main thread)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signum)
    except OSError:
        pass


def exit_text(code: int) -> str:
    """How a child ended, in words, from its ``Popen.returncode``: ``killed by SIGKILL (-9)`` or
    ``exited with code 1``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} ({code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
