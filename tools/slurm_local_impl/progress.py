"""Progress lines and a polling wait that says what it waits for."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

_STARTED = time.monotonic()


def say(message: str) -> None:
    """Print one progress line to stderr, prefixed with seconds since the command started."""
    print(f"[slurm_local {time.monotonic() - _STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


def wait_until(
    ready: Callable[[], bool],
    what: str,
    timeout_s: float,
    poll_s: float = 0.2,
    report_every_s: float = 5.0,
    on_timeout: Callable[[], str] | None = None,
) -> None:
    """Poll ``ready`` until it returns True. Every ``report_every_s`` say what is still awaited; after
    ``timeout_s`` exit with a message naming ``what`` and, from ``on_timeout``, where to look."""
    started = time.monotonic()
    next_report = started + report_every_s
    while True:
        if ready():
            return
        now = time.monotonic()
        if now - started > timeout_s:
            hint = on_timeout() if on_timeout else ""
            raise SystemExit(f"slurm_local: timed out after {timeout_s:.0f} s waiting for {what}. {hint}".rstrip())
        if now >= next_report:
            say(f"still waiting for {what} ({now - started:.0f} s of {timeout_s:.0f} s)")
            next_report = now + report_every_s
        time.sleep(poll_s)
