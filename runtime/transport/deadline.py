"""Store calls with a deadline.

A Mooncake call blocks inside C++ while the master does not answer: a stopped (SIGSTOP), swapped
or partitioned master makes each RPC wait for the client's own time-out (about 30 s in 0.3.13),
and a waiting trainer rank stacked several of them: it failed 150 s after ``idle_timeout_s``.
:class:`DeadlineCaller` runs one call at a time on a daemon thread and gives up waiting for it at
the caller's deadline. A call that is still stuck is not started again: the next call waits for it
first, so a dead master never piles up threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from runtime.transport.errors import TransportError

T = TypeVar("T")

STATUS_TIMEOUT_S = 2.0
"""Longest wait for the heartbeat or cursor read that only feeds a progress or error message."""


GIVE_UP_POLL_S = 0.1
"""How often a wait on a store call looks at its caller's stop request."""


class StoreUnresponsiveError(TransportError):
    """A store call did not return within its deadline (master stopped, overloaded or unreachable)."""


class DeadlineCaller:
    """Runs store calls on one daemon thread and stops waiting for them at a deadline."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pending: threading.Thread | None = None
        self._pending_what = ""
        self._pending_since = 0.0

    def call(self, fn: Callable[[], T], timeout_s: float, what: str, give_up: Callable[[], bool] | None = None) -> T:
        """``fn()``, or :class:`StoreUnresponsiveError` when it has not returned after ``timeout_s``, or
        as soon as ``give_up()`` is true (a stop request: nothing is worth waiting for then)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        if self._pending is not None:
            self._join(self._pending, deadline, give_up)
            if self._pending.is_alive():
                raise StoreUnresponsiveError(self._stuck_message())
            self._pending = None
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the waiting caller
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"{self.name}: {what}", daemon=True)
        thread.start()
        self._join(thread, deadline, give_up)
        if thread.is_alive():
            self._pending, self._pending_what, self._pending_since = thread, what, time.monotonic() - timeout_s
            raise StoreUnresponsiveError(self._stuck_message())
        if "error" in box:
            raise box["error"]
        return box["value"]  # type: ignore[no-any-return]

    @staticmethod
    def _join(thread: threading.Thread, deadline: float, give_up: Callable[[], bool] | None) -> None:
        """Wait for ``thread`` until ``deadline``, looking at ``give_up`` every :data:`GIVE_UP_POLL_S`."""
        while thread.is_alive() and (left_s := deadline - time.monotonic()) > 0:
            if give_up is not None and give_up():
                return
            thread.join(left_s if give_up is None else min(left_s, GIVE_UP_POLL_S))

    def _stuck_message(self) -> str:
        return (
            f"the store has not answered '{self._pending_what}' for {time.monotonic() - self._pending_since:.0f} s "
            "(mooncake_master stopped, overloaded or unreachable)"
        )
