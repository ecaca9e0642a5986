"""The consumer side of the data plane: fetch(g) with waiting, commit_step(s), the cursor.

A trainer rank reads a sample only after its ``meta`` exists (the commit marker), straight into
tensors it owns (or into reusable pinned staging buffers before a copy to the GPU), checks every
field's size and CRC-32, and after an optimizer step commits it publishes the cursor and deletes
the keys it consumed. While it waits it logs what it waits for and what the producer's heartbeat
says (its :class:`~runtime.transport.liveness.HeartbeatReader`), and after
``transport.idle_timeout_s`` on one sample it fails with that message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from runtime.shared.contracts import (
    META_FIELD,
    TENSOR_FIELDS,
    CapturedSample,
    cursor_key,
    sample_key,
    step_sample_indices,
    want_key,
)
from runtime.transport.deadline import STATUS_TIMEOUT_S, DeadlineCaller, StoreUnresponsiveError
from runtime.transport.errors import CorruptSampleError, IdleTimeoutError, TransportError
from runtime.transport.liveness import HeartbeatReader
from runtime.transport.records import Cursor
from runtime.transport.sample_format import FieldLayout, decode_meta, field_layouts, sample_keys, verify_field
from runtime.transport.settings import ConsumerSettings
from runtime.transport.store import StoreClient

if TYPE_CHECKING:
    from runtime.transport.liveness import Heartbeat

log = logging.getLogger("dspark.transport.consumer")

CURSOR_CHECK_INTERVAL_S = 1.0
MIN_LOOK_S = 0.25
"""A store call given less time than this (the deadline is near) that does not return says nothing
about the store."""
NOT_LOOKED_UP = "not looked up yet"
COMMIT_CALL_TIMEOUT_S = 10.0
"""Longest wait for one store call of a step's commit (the cursor, the deletes); a healthy store
answers in milliseconds. A master that stopped (on Slurm a cancel signals it with the trainer) must
not hold the trainer's main thread in a native call, where it cannot act on its own stop request."""
STOP_CLOSE_TIMEOUT_S = 1.0
"""Longest wait for the store client's teardown during a stop: the checkpoint is written, and Slurm
kills what still runs KillWait seconds after its SIGTERM."""


@dataclass
class _SampleWait:
    """One :meth:`Consumer.fetch` of sample g: its deadline, what the last look found, and when the
    side work of the wait (cursor check, heartbeat read, wait line) last ran, on the monotonic clock."""

    g: int
    meta_key: str
    start: float
    deadline: float
    state: str = NOT_LOOKED_UP
    """Why the sample is not read yet, as the wait line and the timeout say it."""
    corrupt_reads: int = 0
    last_log: float = 0.0
    last_cursor_check: float = 0.0
    last_beat_read: float = field(default=-float("inf"))

    @classmethod
    def begin(cls, g: int, meta_key: str, idle_timeout_s: float) -> _SampleWait:
        """A wait starting now that ends after ``idle_timeout_s``."""
        start = time.monotonic()
        return cls(g, meta_key, start, start + idle_timeout_s, last_log=start)

    def left_s(self) -> float:
        """What is left of ``idle_timeout_s``: every store call of this wait is bounded by it."""
        return max(0.0, self.deadline - time.monotonic())


class Consumer:
    """Consumer API for one trainer rank (implements :class:`runtime.shared.contracts.SampleConsumer`)."""

    def __init__(
        self,
        client: StoreClient,
        settings: ConsumerSettings,
        rank: int,
        world_size: int,
    ) -> None:
        """Trainer rank ``rank`` of ``world_size`` (which must be the recipe's trainer ranks) reading
        through ``client``."""
        if world_size != settings.world_size:
            raise ValueError(
                f"world_size {world_size} differs from the recipe's trainer ranks {settings.world_size} "
                "(job.trainer.nodes x tasks_per_node): the g-to-rank mapping would not match the global batch"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
        self.client = client
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self.store_id = settings.store_id
        self.global_batch_size = settings.global_batch_size
        """G, as every sample source exposes it (the feature cache's source reads it)."""
        self._consumed: set[int] = set()
        self._asked: set[int] = set()
        """g this rank asked the producer for (``want`` keys it put and has not removed yet)."""
        self._published: int | None = None
        self._delete_below: int | None = None
        self._staging: dict[str, torch.Tensor] = {}
        self.wait_s_total = 0.0
        self.fetch_s_total = 0.0
        self.bytes_total = 0
        self.samples_total = 0
        self._calls = DeadlineCaller(f"rank {rank} store calls")
        self.liveness = HeartbeatReader(
            client,
            self.store_id,
            interval_s=settings.heartbeat_interval_s,
            capture_shares=settings.capture_shares,
            name=f"rank {rank}",
        )
        """What the producers' heartbeats say while this rank waits."""
        self.stopping: Callable[[], bool] = lambda: False
        """Set by the trainer: true once it has a stop request. A commit then stops retrying a store
        that does not answer (the resumed run republishes its cursor) and :meth:`close` deletes nothing."""

    # -- the g this rank reads --------------------------------------------------------------

    def samples_of_step(self, step: int) -> list[int]:
        """The g this rank consumes in optimizer step ``step``, in micro-step order."""
        s = self.settings
        return step_sample_indices(step, self.rank, self.world_size, s.micro_batch_size, s.gradient_accumulation_steps)

    # -- SampleConsumer ---------------------------------------------------------------------

    def fetch(self, g: int, device: torch.device | str | None = None) -> CapturedSample:
        """Wait for sample g's ``meta``, then read its fields; fails after ``idle_timeout_s``.

        With a CUDA ``device`` the bytes land in reusable pinned buffers and are copied to fresh
        device tensors; otherwise the returned CPU tensors are freshly allocated and owned by the caller.
        """
        wait = _SampleWait.begin(g, sample_key(self.store_id, g, META_FIELD), self.settings.idle_timeout_s)
        self._delete_last_step(wait)
        while time.monotonic() < wait.deadline:
            sample = self._read_committed(wait, device) if self._meta_present(wait) else None
            if sample is not None:
                self.wait_s_total += time.monotonic() - wait.start
                self._consumed.add(g)
                return sample
            if not self._between_looks(wait):
                break
        waited = time.monotonic() - wait.start
        self.wait_s_total += waited
        raise IdleTimeoutError(self._idle_message(g, wait.meta_key, waited, wait.state))

    def _delete_last_step(self, wait: _SampleWait) -> None:
        """First thing of a fetch: delete what the last committed step consumed, once its cursor is
        in the store (see :meth:`commit_step`)."""
        try:
            self._calls.call(self._delete_consumed_if_published, wait.left_s(), "delete the samples of the last step")
        except StoreUnresponsiveError as exc:
            wait.state = str(exc)

    def _meta_present(self, wait: _SampleWait) -> bool:
        """Whether the sample's commit marker is in the store (``wait.state`` says why not)."""
        given_s = wait.left_s()
        try:
            present = self._calls.call(
                lambda: self.client.exist_once([wait.meta_key]), given_s, f"exist {wait.meta_key}"
            )
        except StoreUnresponsiveError as exc:
            # A last look started a moment before the deadline "times out" on a healthy store:
            # it must not replace what the earlier looks found with "the master stopped".
            if given_s >= MIN_LOOK_S or wait.state == NOT_LOOKED_UP:
                wait.state = str(exc)
            return False
        if present is None:
            wait.state = "the store does not answer (master down or restarting)"
            return False
        if present and not present[0]:
            wait.state = "its meta (the commit marker) is not in the store yet"
        return bool(present and present[0])

    def _read_committed(self, wait: _SampleWait, device: torch.device | str | None) -> CapturedSample | None:
        """Read a committed sample; a corrupt read is retried up to ``transport.max_retries`` looks."""
        g = wait.g
        try:
            sample = self._calls.call(lambda: self._read(g, wait.meta_key, device), wait.left_s(), f"read sample g={g}")
        except CorruptSampleError as exc:
            wait.corrupt_reads += 1
            if wait.corrupt_reads > self.settings.corrupt_read_retries:
                raise
            log.warning(
                "rank %d: %s; reading g=%d again (%d/%d)",
                self.rank,
                exc,
                g,
                wait.corrupt_reads,
                self.settings.corrupt_read_retries,
            )
            wait.state = f"its last read was corrupt ({exc})"
            return None
        except TransportError as exc:
            wait.state = f"reading it failed: {exc}"
            return None
        if sample is None:
            wait.state = "it vanished while being read (the producer lost it; it will be captured again)"
        return sample

    def _between_looks(self, wait: _SampleWait) -> bool:
        """The side work of a wait, each at its own interval, then a pause; False once the deadline
        has passed (after the cursor check, so rank 0 keeps the cursor published to the end)."""
        now = time.monotonic()
        if self.rank == 0 and now - wait.last_cursor_check >= CURSOR_CHECK_INTERVAL_S:
            wait.last_cursor_check = now
            with contextlib.suppress(StoreUnresponsiveError):
                self._calls.call(self._republish_missing_cursor, min(STATUS_TIMEOUT_S, wait.left_s()), "cursor check")
        if now >= wait.deadline:
            return False
        if now - wait.last_beat_read >= self.liveness.interval_s:
            # Follow the heartbeat while waiting, so that a producer that stops beating is timed on
            # this rank's own clock.
            wait.last_beat_read = now
            self.liveness.follow(self.liveness.share_of(wait.g), min(STATUS_TIMEOUT_S, wait.left_s()))
        if now - wait.last_log >= self.settings.wait_log_interval_s:
            log.info(
                "rank %d waiting %.0f s of %.0f s (transport.idle_timeout_s) for sample g=%d (%s): %s",
                self.rank,
                now - wait.start,
                self.settings.idle_timeout_s,
                wait.g,
                wait.state,
                self.liveness.describe(wait.g),
            )
            wait.last_log = now
        time.sleep(min(self.settings.poll_interval_s, wait.left_s()))
        return True

    def commit_step(self, step: int) -> None:
        """After optimizer step ``step`` committed: rank 0 publishes the cursor ``(step + 1) * G``
        (never backwards), and every rank deletes the keys it consumed below it.

        Only rank 0 writes the cursor (it lives in rank 0's control segment). The other ranks delete
        only once they see the new cursor in the store (now, or at their next fetch), so the producer
        never mistakes a consumed sample for a lost one and captures it again. While the store does
        not answer, rank 0 retries for up to ``idle_timeout_s``: without the new cursor the
        producer's window cannot move on.
        """
        cursor = (step + 1) * self.settings.global_batch_size
        if self.rank == 0:

            def publish() -> None:
                current = self._calls.call(self.read_cursor, COMMIT_CALL_TIMEOUT_S, "read the cursor", self.stopping)
                if current is None or current.value < cursor:
                    self._calls.call(
                        lambda: self._write_cursor(cursor, step + 1),
                        COMMIT_CALL_TIMEOUT_S,
                        f"write cursor {cursor}",
                        self.stopping,
                    )

            self._until_store_answers(f"publishing cursor {cursor} after step {step}", publish)
        self._delete_below = max(self._delete_below or 0, cursor)
        self._delete_consumed_if_published()

    def _delete_consumed_if_published(self) -> None:
        """Delete this rank's consumed samples below the committed cursor once it is in the store."""
        if self._delete_below is None:
            return
        limit = self._delete_below
        if self.rank != 0:
            try:
                current = self._calls.call(self.read_cursor, COMMIT_CALL_TIMEOUT_S, "read the cursor", self.stopping)
            except TransportError:
                return  # next time
            if current is None or current.value < limit:
                return
        done = sorted(g for g in self._consumed if g < limit)
        asked = sorted(g for g in self._asked if g < limit)
        if asked:
            with contextlib.suppress(TransportError):  # the producer removes stale asks below the cursor too
                keys = [want_key(self.store_id, g) for g in asked]
                self._calls.call(
                    lambda: self.client.remove(keys), COMMIT_CALL_TIMEOUT_S, "remove the asks", self.stopping
                )
            self._asked.difference_update(asked)
        if done:
            try:
                keys = [k for g in done for k in sample_keys(self.store_id, g)]
                self._calls.call(
                    lambda: self.client.remove(keys), COMMIT_CALL_TIMEOUT_S, "remove consumed samples", self.stopping
                )
            except TransportError as exc:
                # Not fatal: the producer removes what it finds below the cursor.
                log.warning(
                    "rank %d: deleting %d consumed samples failed (%s); the producer will", self.rank, len(done), exc
                )
            self._consumed.difference_update(done)
        self._delete_below = None

    def _until_store_answers(self, what: str, action: Callable[[], None]) -> None:
        start = time.monotonic()
        while True:
            try:
                action()
                return
            except TransportError as exc:
                waited = time.monotonic() - start
                if self.stopping():
                    log.info(
                        "rank %d: %s failed (%s) during a stop; the resumed run republishes it", self.rank, what, exc
                    )
                    return
                if waited >= self.settings.idle_timeout_s:
                    raise TransportError(
                        f"rank {self.rank}: {what} failed for {waited:.0f} s (transport.idle_timeout_s): {exc}"
                    ) from exc
                log.warning("rank %d: %s failed (%s); retrying", self.rank, what, exc)
                time.sleep(self.settings.poll_interval_s)

    def publish_cursor(self, cursor: int) -> None:
        """Publish the cursor as is (a restarted trainer republishes its checkpoint's cursor).

        Rank 0 writes it; on the other ranks this is a no-op, so every rank may call it.
        """
        if cursor < 0:
            raise ValueError(f"cursor {cursor} is negative")
        if self.rank != 0:
            return
        self._until_store_answers(
            f"publishing cursor {cursor}",
            lambda: self._calls.call(
                lambda: self._write_cursor(cursor, cursor // self.settings.global_batch_size),
                COMMIT_CALL_TIMEOUT_S,
                f"write cursor {cursor}",
                self.stopping,
            ),
        )

    def ask_for(self, gs: list[int]) -> None:
        """Ask the producer to capture these g (with ``trainer.feature_cache`` it captures later
        epochs only when asked): one small ``want`` key each, idempotent, removed after the step
        that consumes them commits. A store that does not answer is retried by the next call."""
        new = [g for g in gs if g not in self._asked]
        if not new:
            return
        for g in new:
            self.client.put_bytes(want_key(self.store_id, g), b"1")
            self._asked.add(g)
        log.info(
            "rank %d asked the producer for %d sample(s) not in the feature cache: %s", self.rank, len(new), new[:8]
        )

    # -- store objects ----------------------------------------------------------------------

    def read_cursor(self) -> Cursor | None:
        """The published cursor, or None."""
        raw = self.client.get_bytes(cursor_key(self.store_id))
        return Cursor.decode(raw) if raw is not None else None

    def read_heartbeat(self, share: int = 0) -> Heartbeat | None:
        """The heartbeat of capture share ``share``'s producer, or None (also remembered, with when
        this rank first saw it)."""
        return self.liveness.read(share)

    def _write_cursor(self, value: int, step: int | None) -> None:
        publisher = f"rank {self.rank} pid {os.getpid()} on {socket.gethostname()}"
        # The cursor names rank 0's segment (where it lives): the producer puts its heartbeat there.
        cursor = Cursor(value, step, time.time(), publisher, segment=self.client.preferred_segment)
        self.client.put_bytes(cursor_key(self.store_id), cursor.encode())
        self._published = value

    def _republish_missing_cursor(self) -> None:
        if self._published is None:
            return
        try:
            if self.client.get_bytes(cursor_key(self.store_id)) is None:
                log.warning(
                    "rank %d: the cursor is gone from the store (master restarted?); republishing %d",
                    self.rank,
                    self._published,
                )
                self._write_cursor(self._published, self._published // self.settings.global_batch_size)
        except TransportError as exc:
            log.debug("cursor check failed: %s", exc)

    # -- reading one sample -----------------------------------------------------------------

    def _read(self, g: int, meta_key: str, device: torch.device | str | None) -> CapturedSample | None:
        start = time.monotonic()
        raw = self.client.get_bytes(meta_key)
        if raw is None:
            return None
        meta = decode_meta(g, meta_key, raw)
        layouts = field_layouts(meta)
        target = torch.device(device) if device is not None else torch.device("cpu")
        use_staging = target.type == "cuda"
        host = [self._host_buffer(layout, use_staging) for layout in layouts]
        keys = [sample_key(self.store_id, g, layout.name) for layout in layouts]
        status = self.client.get_into_tensors(keys, host, what=f"sample g={g}")
        if any(code != 0 for code in status):
            return None
        # A ``sum16`` field is verified where its bytes end up (on the GPU for a CUDA reader: no
        # host pass over the big fields); CRC-32 fields on the host.
        on_device = [use_staging and layout.sum16 is not None for layout in layouts]
        if self.settings.verify_checksums:
            for layout, tensor, later in zip(layouts, host, on_device, strict=True):
                if not later:
                    verify_field(g, layout, tensor)
        if use_staging:
            tensors = [t.to(target, non_blocking=True) for t in host]
            torch.cuda.current_stream(target).synchronize()
            if self.settings.verify_checksums:
                for layout, tensor, later in zip(layouts, tensors, on_device, strict=True):
                    if later:
                        verify_field(g, layout, tensor)
        else:
            tensors = host
        fields = dict(zip(TENSOR_FIELDS, tensors, strict=True))
        self.fetch_s_total += time.monotonic() - start
        self.bytes_total += sum(layout.num_bytes for layout in layouts)
        self.samples_total += 1
        return CapturedSample(g=g, meta=meta, **fields)

    def _host_buffer(self, layout: FieldLayout, use_staging: bool) -> torch.Tensor:
        if not use_staging:
            return torch.empty(layout.shape, dtype=layout.torch_dtype)
        buf = self._staging.get(layout.name)
        if buf is None or buf.numel() < layout.num_bytes:
            buf = torch.empty(max(layout.num_bytes, 1), dtype=torch.uint8, pin_memory=True)
            self._staging[layout.name] = buf
        return buf[: layout.num_bytes].view(layout.torch_dtype).view(layout.shape)

    # -- messages ---------------------------------------------------------------------------

    def _idle_message(self, g: int, meta_key: str, waited: float, state: str) -> str:
        try:
            cursor = self._calls.call(self.read_cursor, STATUS_TIMEOUT_S, "read the cursor")
            cursor_text = f"cursor in the store: {cursor.value}" if cursor else "no cursor in the store"
        except TransportError:
            cursor_text = "cursor unreadable"
        return (
            f"rank {self.rank} waited {waited:.0f} s (transport.idle_timeout_s = {self.settings.idle_timeout_s:g}) for sample "
            f"g={g} (key {meta_key}): {state}; {self.liveness.describe(g)}; {cursor_text}. Check the capture "
            "component's log (is the producer alive, paused or failing?)"
        )

    def stats(self) -> dict[str, Any]:
        """Totals for the trainer's metrics (data-wait time, bytes, samples)."""
        return {
            "wait_s_total": self.wait_s_total,
            "fetch_s_total": self.fetch_s_total,
            "bytes_total": self.bytes_total,
            "samples_total": self.samples_total,
        }

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Delete what is still due (when the cursor allows it; not during a stop: the producer removes
        what it finds below the cursor) and release the client."""
        try:
            if not self.stopping():
                self._delete_consumed_if_published()
        finally:
            try:
                # Bounded: with the master gone (a Slurm cancel signals it with the trainer) the
                # client's teardown waits on it, and the rank would be killed instead of exiting.
                timeout_s = STOP_CLOSE_TIMEOUT_S if self.stopping() else COMMIT_CALL_TIMEOUT_S
                self._calls.call(self.client.close, timeout_s, "close the store client")
            except StoreUnresponsiveError as exc:
                log.warning("rank %d: leaving the store client open: %s", self.rank, exc)

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
