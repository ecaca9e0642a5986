"""Pipelined sample commits: the commit of one sample runs while the engine computes the next.

Without it the capture loop is ``forward, copy to host, checksum, put, forward, ...``; on an H200
the part after the forward took 40-50% of the time (pageable device-to-host copies and CRC-32 on
one CPU core). :class:`CommitPipeline` takes a finished sample and returns at once:

1. a stager thread queues, on a side CUDA stream (waiting for an event recorded on the producing
   stream at submit, so it reads finished rows and does not queue behind the next forward), the
   copies of the device fields into one of a FIXED number of page-locked staging slots and their
   ``sum16`` checksums on the GPU (:mod:`runtime.transport.checksum`: the host never passes over
   the bytes to checksum them). Its own thread, so these launches do not hold up the launches of
   the next forward;
2. a commit thread waits for that copy, then commits through the sink (the producer: Mooncake
   puts, ``meta`` last) and frees the slot.

Memory is bounded: a sample waits in :meth:`CommitPipeline.submit` for a free slot, so at most
``slots`` samples are staged or being committed. Commits happen in submission order (one worker).
CPU tensors (CPU runs) take the same path without the copy; their checksums stay CRC-32s computed
by the producer, so the CPU path is exactly what it was, only overlapped with the next forward.

A failed commit leaves its ``g`` uncommitted (the producer releases it, the window offers it again)
and is raised from the next :meth:`submit` / :meth:`raise_if_failed`, so the capture stops loudly.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from runtime.transport.checksum import sum16_chunks

log = logging.getLogger("dspark.capture.commit")

STAGING_ALIGN_BYTES = 64
WAIT_POLL_S = 0.5
"""Longest a blocked submit goes without checking for a failed commit."""


class CommitError(RuntimeError):
    """A pipelined commit failed; the message names the sample."""


def staging_layout(tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[dict[str, int], int]:
    """Byte offset of each field in one staging buffer (64-byte aligned) and the total bytes.

    Python ints: a 64K K3 ``hs`` field alone is 4.7e9 bytes.
    """
    offsets, cursor = {}, 0
    for name, (shape, dtype) in tensors.items():
        cursor = -(-cursor // STAGING_ALIGN_BYTES) * STAGING_ALIGN_BYTES
        offsets[name] = cursor
        count = 1
        for dim in shape:
            count *= int(dim)
        cursor += count * torch.empty((), dtype=dtype).element_size()
    return offsets, cursor


@dataclass(frozen=True)
class CommitResult:
    """One finished commit: the bytes written, or the error."""

    g: int
    bytes_written: int
    error: BaseException | None = None
    skipped: bool = False
    """Not committed because :meth:`CommitPipeline.request_stop` came first (not an error)."""


@dataclass
class _Job:
    g: int
    tensors: dict[str, torch.Tensor]
    meta: Mapping[str, Any]
    slot: int
    copied: Any  # torch.cuda.Event, or None when nothing was on a device
    sums: torch.Tensor | None  # pinned int64 [sum of chunks, 2], filled by the side stream
    sum_chunks: dict[str, int]  # field -> chunks, in ``sums`` order


class CommitPipeline:
    """Stages samples to host on a side stream and commits them on a worker thread."""

    def __init__(
        self, sink: Any, slots: int, slot_bytes: int = 0, name: str = "capture", source_reused: bool = False
    ) -> None:
        """``sink.commit(g, tensors, meta[, checksums=...])`` is called on the worker thread;
        ``slots`` staging buffers of at least ``slot_bytes`` each (they grow to the largest sample).
        ``source_reused``: the producer may overwrite the submitted device tensors in place with its
        next work (a server's preallocated output buffers), so its stream waits for the copies
        (milliseconds at 55 GB/s); the commits still overlap that next work."""
        if slots < 1:
            raise ValueError(f"a commit pipeline needs at least one staging slot, got {slots}")
        self.sink = sink
        self.slots = slots
        self.slot_bytes = int(slot_bytes)
        self.name = name
        self.source_reused = source_reused
        self.device_checksums = bool(getattr(sink, "accepts_checksums", False))
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._free: queue.Queue[int] = queue.Queue()
        for slot in range(slots):
            self._free.put(slot)
        self._to_stage: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: set[int] = set()
        self._results: list[CommitResult] = []
        self._error: CommitResult | None = None
        self._streams: dict[torch.device, Any] = {}
        self._stopping = threading.Event()
        self.submit_wait_s = 0.0
        """Time :meth:`submit` spent waiting for a free slot (the commit is the bottleneck)."""
        self.commit_s = 0.0
        """Time the worker spent committing (overlapped with the engine's work)."""
        self._worker = threading.Thread(target=self._run, name=f"dspark-{name}-commit", daemon=True)
        self._worker.start()
        self._stager = threading.Thread(target=self._stage_loop, name=f"dspark-{name}-stage", daemon=True)
        self._stager.start()

    # -- producer side ----------------------------------------------------------------------

    def submit(self, g: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Queue sample ``g`` for commit; blocks only while every staging slot is in use."""
        self.raise_if_failed()
        start = time.monotonic()
        slot = self._take_slot()
        self.submit_wait_s += time.monotonic() - start
        try:
            self.raise_if_failed()  # the slot may have come free from the commit that failed
            if not self.source_reused:
                # Every sample goes through the stager, so commits keep the order of submits.
                devices = [t.device for t in tensors.values() if t.device.type != "cpu"]
                ready = None
                if devices:
                    ready = torch.cuda.Event()
                    ready.record(torch.cuda.current_stream(devices[0]))
                with self._lock:
                    self._pending.add(g)
                self._to_stage.put((g, dict(tensors), meta, slot, ready))
                return
            job = self._stage(g, tensors, meta, slot, None)
        except BaseException:
            self._free.put(slot)
            raise
        with self._lock:
            self._pending.add(g)
        self._jobs.put(job)

    def _stage_loop(self) -> None:
        while True:
            item = self._to_stage.get()
            if item is None:
                self._jobs.put(None)
                return
            g, tensors, meta, slot, ready = item
            try:
                job = self._stage(g, tensors, meta, slot, ready)
            except BaseException as exc:  # reported like a failed commit
                log.error("%s: staging of sample g=%d failed: %s", self.name, g, exc)
                self._finish(_Job(g, {}, meta, slot, None, None, {}), CommitResult(g, 0, exc), time.monotonic())
                continue
            self._jobs.put(job)

    def _take_slot(self) -> int:
        while True:
            try:
                return self._free.get(timeout=WAIT_POLL_S)
            except queue.Empty:
                self.raise_if_failed()
                if not self._worker.is_alive():
                    raise CommitError(
                        f"{self.name}: the commit worker is gone; no staging slot will come free"
                    ) from None

    def _stage(
        self, g: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], slot: int, ready: Any
    ) -> _Job:
        """Queue the copies (and checksums) of the device fields; ``ready``: the event after which
        the fields are complete (None: the current stream's work so far)."""
        host = {name: t.contiguous() for name, t in tensors.items() if t.device.type == "cpu"}
        on_device = {name: t for name, t in tensors.items() if t.device.type != "cpu"}
        if not on_device:
            return _Job(g, dict(tensors) | host, meta, slot, None, None, {})
        layout, total = staging_layout({n: (tuple(t.shape), t.dtype) for n, t in on_device.items()})
        buffer = self._buffer(slot, total)
        device = next(iter(on_device.values())).device
        stream = self._stream(device)
        if ready is None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        sums: list[torch.Tensor] = []
        sum_chunks: dict[str, int] = {}
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            for name, tensor in on_device.items():
                # The caching allocator must not hand this memory out before the side stream is done.
                tensor.record_stream(stream)
                source = tensor.contiguous()
                num_bytes = source.numel() * source.element_size()
                target = buffer.narrow(0, layout[name], num_bytes).view(source.dtype).view(source.shape)
                target.copy_(source, non_blocking=True)
                host[name] = target
                if self.device_checksums:
                    chunk_sums = sum16_chunks(source)
                    sums.append(chunk_sums)
                    sum_chunks[name] = int(chunk_sums.shape[0])
            host_sums = None
            if sums:
                packed = torch.cat(sums)
                host_sums = torch.empty(packed.shape, dtype=torch.int64, pin_memory=True)
                host_sums.copy_(packed, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        if self.source_reused:
            torch.cuda.current_stream(device).wait_event(copied)
        return _Job(g, {name: host[name] for name in tensors}, meta, slot, copied, host_sums, sum_chunks)

    def _buffer(self, slot: int, num_bytes: int) -> torch.Tensor:
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < num_bytes:
            self._buffers[slot] = None  # release the old buffer before pinning a larger one
            size = max(num_bytes, self.slot_bytes)
            log.info("%s: pinning staging slot %d of %d: %.1f MiB", self.name, slot, self.slots, size / 2**20)
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self._buffers[slot] = buffer
        return buffer

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            self._streams[device] = stream
        return stream

    # -- worker -----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            start = time.monotonic()
            if self._stopping.is_set():
                result = CommitResult(job.g, 0, skipped=True)
                self._finish(job, result, start)
                continue
            try:
                if job.copied is not None:
                    job.copied.synchronize()
                kwargs: dict[str, Any] = {}
                if job.sums is not None:
                    values = job.sums.reshape(-1).tolist()
                    checksums, at = {}, 0
                    for name, chunks in job.sum_chunks.items():
                        checksums[name] = tuple(int(v) for v in values[at : at + 2 * chunks])
                        at += 2 * chunks
                    kwargs["checksums"] = checksums
                written = self.sink.commit(job.g, job.tensors, job.meta, **kwargs)
                result = CommitResult(job.g, int(written or 0))
            except BaseException as exc:  # reported to the capture thread, which stops the capture
                log.error("%s: commit of sample g=%d failed: %s", self.name, job.g, exc)
                result = CommitResult(job.g, 0, exc)
            self._finish(job, result, start)

    def _finish(self, job: _Job, result: CommitResult, start: float) -> None:
        if job.copied is not None:
            job.copied.synchronize()  # the slot is reused only after its copy is complete
        self.commit_s += time.monotonic() - start
        job.tensors = {}
        self._free.put(job.slot)
        with self._lock:
            self._pending.discard(job.g)
            self._results.append(result)
            if result.error is not None and self._error is None:
                self._error = result
            self._idle.notify_all()

    def request_stop(self) -> None:
        """Let the commit in progress finish; skip the queued ones (their g stay uncommitted)."""
        self._stopping.set()

    # -- results ----------------------------------------------------------------------------

    def pending(self) -> set[int]:
        """The g submitted whose commit has not finished."""
        with self._lock:
            return set(self._pending)

    def completed(self) -> list[CommitResult]:
        """The commits finished since the last call (successful or not), in order."""
        with self._lock:
            out, self._results = self._results, []
        return out

    def raise_if_failed(self) -> None:
        """Raise CommitError when any commit failed (every later call raises it again)."""
        with self._lock:
            failed = self._error
        if failed is not None:
            raise CommitError(f"{self.name}: committing sample g={failed.g} failed: {failed.error}") from failed.error

    def drain(self, timeout_s: float | None = None) -> list[CommitResult]:
        """Wait until every submitted commit finished; returns them (and earlier unreported ones)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CommitError(f"{self.name}: {len(self._pending)} commits still running after {timeout_s} s")
                if not self._worker.is_alive():
                    raise CommitError(f"{self.name}: the commit worker is gone with {len(self._pending)} pending")
                self._idle.wait(WAIT_POLL_S if left is None else min(left, WAIT_POLL_S))
        return self.completed()

    def close(self) -> None:
        """Finish the queued commits, stop the threads, unpin the staging slots."""
        self._to_stage.put(None)  # the stager passes it on to the commit thread after its last job
        self._stager.join()
        self._worker.join()
        self._buffers = [None] * self.slots
