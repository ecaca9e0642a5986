"""Fetch one optimizer step's samples in a background thread while the previous ones train.

Prefetching stops at the step boundary on purpose: the producer's window starts at the published
cursor, so the next step's samples may not exist until this step commits (with watermarks of one
global batch, as in the smoke gate, a fetch across the boundary would wait for ever). The thread is
finished before ``commit_step`` runs, so the consumer is never used by two threads at once.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.shared.contracts import CapturedSample
from runtime.trainer.layout import BlockLayout

POLL_S = 0.2
"""How often the consumer looks at the stop request while it waits for a sample."""
STOP_WAIT_S = 1.0
"""How long a sample may still take once a stop is requested: one that is on its way finishes the
step (nothing to redo after a resume); one that is not there by then is not waited for."""


@dataclass
class PreparedSample:
    """One sample as the prefetch thread hands it to the compute thread, with what that thread prepared
    beside the previous sample's compute. It travels as one object through the prefetcher's one queue,
    so nothing is left behind on either thread when a step ends early."""

    sample: CapturedSample
    layout: BlockLayout | None = None
    """The sample's block layout, built on the host and queued to the device on the copy stream (CUDA
    only; elsewhere the compute thread builds it)."""
    copied: Any = None
    """The CUDA event that marks the end of the sample's and the layout's copies (CUDA only)."""
    ids_range: tuple[int, int] | None = None
    """(min, max) token id, read on the host after the copy (CUDA only): the sample check uses it
    instead of reading the device tensor, which would wait for all the compute queued before it."""


class StepPrefetcher:
    """Fetches ``gs`` in order, at most ``depth`` samples ahead of the consumer: with depth 1 the
    next sample is fetched while the current one trains, so two samples are resident at most (a
    64K K3 sample is 5.25 GiB)."""

    def __init__(self, fetch: Callable[[int], PreparedSample], gs: list[int], depth: int = 1) -> None:
        self._queue: queue.Queue[tuple[int, Any]] = queue.Queue()
        self._slots = threading.Semaphore(depth)
        self._gs = list(gs)
        self._fetch = fetch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sample-prefetch", daemon=True)
        self.wait_s = 0.0
        """Seconds the consumer spent waiting for samples (the data-wait time)."""
        self._thread.start()

    def _run(self) -> None:
        for g in self._gs:
            while not self._slots.acquire(timeout=0.5):  # a free slot: the consumer took the last one
                if self._stop.is_set():
                    return
            if self._stop.is_set():
                return
            try:
                item: Any = self._fetch(g)
            except BaseException as exc:  # handed to the consumer, which re-raises it
                item = exc
            self._queue.put((g, item))
            if isinstance(item, BaseException):
                return

    def next(self, stopping: Callable[[], bool] = lambda: False) -> PreparedSample | None:
        """The next sample in order (re-raises the fetch's exception), or None once ``stopping()`` has
        held for :data:`STOP_WAIT_S` while the sample was still not there, or when its fetch failed
        during a stop: a stop must not wait for samples that may never come (on Slurm a cancel or a
        preemption signals the capture and the Mooncake master at the same moment as the trainer)."""
        started = time.monotonic()
        stop_seen_at: float | None = None
        while True:
            try:
                g, item = self._queue.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not stopping():
                    continue
                now = time.monotonic()
                stop_seen_at = stop_seen_at or now
                if now - stop_seen_at >= STOP_WAIT_S:
                    self.wait_s += now - started
                    return None
        self.wait_s += time.monotonic() - started
        self._slots.release()
        if isinstance(item, BaseException):
            if stopping():
                return None
            raise item
        return item

    def close(self, timeout_s: float | None = None) -> bool:
        """Stop and join the thread (called before the step commits); with ``timeout_s``, give up
        joining after that long (a fetch that waits on a store that is gone). Returns whether the
        thread has ended."""
        self._stop.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
