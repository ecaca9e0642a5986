"""The consumer side of the data plane: fetch(g) with waiting, commit_step(s), the cursor.

A trainer rank reads a sample only after its ``meta`` exists (the commit marker), straight into
tensors it owns (or into reusable pinned staging buffers before a copy to the GPU), checks every
field's size and CRC-32, and after an optimizer step commits it publishes the cursor and deletes
the keys it consumed. While it waits it logs what it waits for and how old the producer's
heartbeat is, and after ``transport.idle_timeout_s`` on one sample it fails with that message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runtime.recipe.capture_layout import capture_shares
from runtime.recipe.schema import Recipe
from runtime.shared.contracts import (
    META_FIELD,
    TENSOR_FIELDS,
    CapturedSample,
    cursor_key,
    heartbeat_key,
    sample_key,
    step_sample_indices,
    want_key,
)
from runtime.transport.deadline import DeadlineCaller, StoreUnresponsiveError
from runtime.transport.errors import CorruptSampleError, IdleTimeoutError, TransportError
from runtime.transport.records import Cursor, Heartbeat
from runtime.transport.sample_format import FieldLayout, decode_meta, field_layouts, sample_keys, verify_field
from runtime.transport.store import StoreClient

log = logging.getLogger("dspark.transport.consumer")

CURSOR_CHECK_INTERVAL_S = 1.0
STATUS_TIMEOUT_S = 2.0
"""Longest wait for the heartbeat or cursor read that only feeds a progress or error message."""
MIN_LOOK_S = 0.25
"""A store call given less time than this (the deadline is near) that does not return says nothing
about the store."""
STALE_AFTER_BEATS = 3
"""A heartbeat older than this many ``transport.heartbeat_interval_s`` means the producer stopped
beating (a beat can be late by a slow put, so one missed interval is not enough)."""


@dataclass
class _BeatWatch:
    """What one rank saw of one producer's heartbeat, on its own monotonic clock (no clock skew)."""

    beat: Heartbeat | None = None
    """The last beat read."""
    identity: tuple[str, int, int] | None = None
    """(host, pid, sequence) of that beat."""
    first_seen: float = 0.0
    """When that beat was first read."""
    last_read: float | None = None
    """When the heartbeat was last read."""
    arrival_seen: bool = False
    """Whether this rank saw that beat replace another within a few intervals: its age is then timed on
    this rank's clock; otherwise the beat's own timestamp is trusted."""


class Consumer:
    """Consumer API for one trainer rank (implements :class:`runtime.shared.contracts.SampleConsumer`)."""

    def __init__(
        self,
        client: StoreClient,
        recipe: Recipe,
        rank: int,
        world_size: int,
        *,
        store_id: str | None = None,
    ) -> None:
        if world_size != recipe.trainer_world_size:
            raise ValueError(
                f"world_size {world_size} differs from the recipe's trainer ranks {recipe.trainer_world_size} "
                "(job.trainer.nodes x tasks_per_node): the g-to-rank mapping would not match the global batch"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
        self.client = client
        self.recipe = recipe
        self.rank = rank
        self.world_size = world_size
        self.store_id = store_id or recipe.store_id
        tr = recipe.transport
        self.idle_timeout_s = tr.idle_timeout_s
        self.poll_interval_s = tr.poll_interval_s
        self.wait_log_interval_s = tr.wait_log_interval_s
        self.verify_checksums = tr.verify_checksums
        self.max_corrupt_retries = max(1, tr.max_retries)
        self.global_batch_size = recipe.trainer.global_batch_size
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
        # Heartbeat reads on their own thread: one stuck there (the heartbeat in a stopped producer's
        # segment) must not hold up the sample reads, nor make them blame the master.
        self._beat_calls = DeadlineCaller(f"rank {rank} heartbeat reads")
        self.heartbeat_interval_s = tr.heartbeat_interval_s
        self.capture_shares = capture_shares(recipe)
        """Producers of the capture component; the one of share ``g % capture_shares`` captures g."""
        self._watches: dict[int, _BeatWatch] = {}
        """What this rank saw of each share's heartbeat, per share."""

    # -- the g this rank reads --------------------------------------------------------------

    def samples_of_step(self, step: int) -> list[int]:
        """The g this rank consumes in optimizer step ``step``, in micro-step order."""
        t = self.recipe.trainer
        return step_sample_indices(step, self.rank, self.world_size, t.micro_batch_size, t.gradient_accumulation_steps)

    # -- SampleConsumer ---------------------------------------------------------------------

    def fetch(self, g: int, device: torch.device | str | None = None) -> CapturedSample:
        """Wait for sample g's ``meta``, then read its fields; fails after ``idle_timeout_s``.

        With a CUDA ``device`` the bytes land in reusable pinned buffers and are copied to fresh
        device tensors; otherwise the returned CPU tensors are freshly allocated and owned by the caller.
        """
        meta_key = sample_key(self.store_id, g, META_FIELD)
        start = time.monotonic()
        deadline = start + self.idle_timeout_s

        def budget() -> float:
            # every store call of this wait is bounded by what is left of idle_timeout_s
            return max(0.0, deadline - time.monotonic())

        state = "not looked up yet"
        try:
            self._calls.call(self._delete_consumed_if_published, budget(), "delete the samples of the last step")
        except StoreUnresponsiveError as exc:
            state = str(exc)
        last_log = start
        last_cursor_check = 0.0
        last_beat_read = -float("inf")
        corrupt = 0
        while time.monotonic() < deadline:
            given_s = budget()
            try:
                present = self._calls.call(lambda: self.client.exist_once([meta_key]), given_s, f"exist {meta_key}")
            except StoreUnresponsiveError as exc:
                present = []
                # A last look started a moment before the deadline "times out" on a healthy store:
                # it must not replace what the earlier looks found with "the master stopped".
                if given_s >= MIN_LOOK_S or state == "not looked up yet":
                    state = str(exc)
            if present is None:
                state = "the store does not answer (master down or restarting)"
            elif not present:
                pass  # state says which call did not return
            elif not present[0]:
                state = "its meta (the commit marker) is not in the store yet"
            else:
                try:
                    sample = self._calls.call(lambda: self._read(g, meta_key, device), budget(), f"read sample g={g}")
                except CorruptSampleError as exc:
                    corrupt += 1
                    if corrupt > self.max_corrupt_retries:
                        raise
                    log.warning(
                        "rank %d: %s; reading g=%d again (%d/%d)", self.rank, exc, g, corrupt, self.max_corrupt_retries
                    )
                    state = f"its last read was corrupt ({exc})"
                except TransportError as exc:
                    state = f"reading it failed: {exc}"
                else:
                    if sample is not None:
                        self.wait_s_total += time.monotonic() - start
                        self._consumed.add(g)
                        return sample
                    state = "it vanished while being read (the producer lost it; it will be captured again)"
            now = time.monotonic()
            if self.rank == 0 and now - last_cursor_check >= CURSOR_CHECK_INTERVAL_S:
                last_cursor_check = now
                with contextlib.suppress(StoreUnresponsiveError):
                    self._calls.call(self._republish_missing_cursor, min(STATUS_TIMEOUT_S, budget()), "cursor check")
            if now >= deadline:
                break
            if now - last_beat_read >= self.heartbeat_interval_s:
                # Follow the heartbeat while waiting, so that a producer that stops beating is timed on
                # this rank's own clock (see _beat_silence_s).
                last_beat_read = now
                self._read_heartbeat_bounded(g % self.capture_shares, min(STATUS_TIMEOUT_S, budget()))
            if now - last_log >= self.wait_log_interval_s:
                log.info(
                    "rank %d waiting %.0f s of %.0f s (transport.idle_timeout_s) for sample g=%d (%s): %s",
                    self.rank,
                    now - start,
                    self.idle_timeout_s,
                    g,
                    state,
                    self._producer_status(g),
                )
                last_log = now
            time.sleep(min(self.poll_interval_s, budget()))
        waited = time.monotonic() - start
        self.wait_s_total += waited
        raise IdleTimeoutError(self._idle_message(g, meta_key, waited, state))

    def commit_step(self, step: int) -> None:
        """After optimizer step ``step`` committed: rank 0 publishes the cursor ``(step + 1) * G``
        (never backwards), and every rank deletes the keys it consumed below it.

        Only rank 0 writes the cursor (it lives in rank 0's control segment). The other ranks delete
        only once they see the new cursor in the store (now, or at their next fetch), so the producer
        never mistakes a consumed sample for a lost one and captures it again. While the store does
        not answer, rank 0 retries for up to ``idle_timeout_s``: without the new cursor the
        producer's window cannot move on.
        """
        cursor = (step + 1) * self.global_batch_size
        if self.rank == 0:

            def publish() -> None:
                current = self.read_cursor()
                if current is None or current.value < cursor:
                    self._write_cursor(cursor, step + 1)

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
                current = self.read_cursor()
            except TransportError:
                return  # next time
            if current is None or current.value < limit:
                return
        done = sorted(g for g in self._consumed if g < limit)
        asked = sorted(g for g in self._asked if g < limit)
        if asked:
            with contextlib.suppress(TransportError):  # the producer removes stale asks below the cursor too
                self.client.remove([want_key(self.store_id, g) for g in asked])
            self._asked.difference_update(asked)
        if done:
            try:
                self.client.remove([k for g in done for k in sample_keys(self.store_id, g)])
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
                if waited >= self.idle_timeout_s:
                    raise TransportError(
                        f"rank {self.rank}: {what} failed for {waited:.0f} s (transport.idle_timeout_s): {exc}"
                    ) from exc
                log.warning("rank %d: %s failed (%s); retrying", self.rank, what, exc)
                time.sleep(self.poll_interval_s)

    def publish_cursor(self, cursor: int) -> None:
        """Publish the cursor as is (a restarted trainer republishes its checkpoint's cursor).

        Rank 0 writes it; on the other ranks this is a no-op, so every rank may call it.
        """
        if cursor < 0:
            raise ValueError(f"cursor {cursor} is negative")
        if self.rank != 0:
            return
        self._until_store_answers(
            f"publishing cursor {cursor}", lambda: self._write_cursor(cursor, cursor // self.global_batch_size)
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
        try:
            raw = self.client.get_bytes(heartbeat_key(self.store_id, share))
        except TransportError:
            return None
        if raw is None:
            return None
        try:
            beat = Heartbeat.decode(raw)
        except (ValueError, TypeError):
            return None
        self._observe_beat(beat, share)
        return beat

    def _read_heartbeat_bounded(self, share: int, timeout_s: float) -> None:
        with contextlib.suppress(StoreUnresponsiveError):
            self._beat_calls.call(lambda: self.read_heartbeat(share), timeout_s, "read the producer heartbeat")

    def _observe_beat(self, beat: Heartbeat, share: int = 0) -> None:
        now = time.monotonic()
        watch = self._watches.setdefault(share, _BeatWatch())
        identity = (beat.host, beat.pid, beat.sequence)
        if identity != watch.identity:
            # A new beat. If this rank read the previous one a moment ago, the new one is at most that
            # old, and its age can be timed on this rank's clock from now on.
            recent = watch.last_read is not None and now - watch.last_read <= self._stale_after_s
            watch.arrival_seen = watch.identity is not None and recent
            watch.identity = identity
            watch.first_seen = now
        watch.last_read = now
        watch.beat = beat

    @property
    def _stale_after_s(self) -> float:
        return STALE_AFTER_BEATS * self.heartbeat_interval_s

    def _beat_silence_s(self, beat: Heartbeat, share: int = 0) -> float:
        """Seconds since the producer's last beat, as well as this rank can tell.

        The time this rank has watched the same beat is a lower bound that no clock skew spoils; a
        beat this rank did not see arrive may be older than that, by its own (wall-clock) timestamp.
        """
        watch = self._watches.get(share)
        if watch is None or watch.identity != (beat.host, beat.pid, beat.sequence):
            return max(0.0, beat.age_s())
        watched = time.monotonic() - watch.first_seen
        if watch.arrival_seen:
            return watched
        return max(watched, beat.age_s())

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
                self._write_cursor(self._published, self._published // self.global_batch_size)
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
        if self.verify_checksums:
            for layout, tensor, later in zip(layouts, host, on_device, strict=True):
                if not later:
                    verify_field(g, layout, tensor)
        if use_staging:
            tensors = [t.to(target, non_blocking=True) for t in host]
            torch.cuda.current_stream(target).synchronize()
            if self.verify_checksums:
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

    def _producer_status(self, g: int | None = None) -> str:
        """The producer's side of a wait (the producer of ``g``'s capture share): who it is, when it
        last beat, and the likely cause."""
        share = g % self.capture_shares if g is not None else 0
        try:
            beat = self._beat_calls.call(
                lambda: self.read_heartbeat(share), STATUS_TIMEOUT_S, "read the producer heartbeat"
            )
        except StoreUnresponsiveError as exc:
            last = self._last_beat(share)
            seen = (
                f"; last read from {self._who(last, share)} {self._beat_silence_s(last, share):.0f} s ago, "
                f"sequence {last.sequence}"
                if last is not None
                else ""
            )
            return f"producer heartbeat unreadable: {exc}{seen}"
        last = self._last_beat(share)
        if beat is None and last is not None:
            # The heartbeat lives in trainer rank 0's segment and outlives the producer; it goes
            # missing when the store lost it (master restart) or when the producer did not know rank
            # 0's segment yet, beat into its own, and that segment left the store with the producer.
            return (
                f"the producer's heartbeat vanished from the store; last seen from producer pid {last.pid} on "
                f"{last.host}{self._share_text(share)}, {self._beat_silence_s(last, share):.0f} s old, sequence "
                f"{last.sequence}, {last.committed_total} samples committed: the mooncake_master most likely "
                "restarted (the store is empty until the producer beats again), or the producer beat into its own "
                "segment and most likely hung or died with it; look at the capture log and the master's log"
            )
        if beat is None:
            return (
                f"no producer heartbeat in the store{self._share_text(share)}: the producer has not started (or not "
                "reached the store yet), or the store was restarted and the producer is gone; look at the capture log"
            )
        return f"{self._likely_cause(beat, g, share)}; {beat.summary()}"

    def _last_beat(self, share: int) -> Heartbeat | None:
        watch = self._watches.get(share)
        return watch.beat if watch is not None else None

    def _share_text(self, share: int) -> str:
        return f" (capture share {share} of {self.capture_shares})" if self.capture_shares > 1 else ""

    def _who(self, beat: Heartbeat, share: int) -> str:
        if self.capture_shares > 1:
            return (
                f"the producer of capture share {share} of {self.capture_shares} (pid {beat.pid} on host {beat.host})"
            )
        return f"the producer (pid {beat.pid} on host {beat.host})"

    def _likely_cause(self, beat: Heartbeat, g: int | None, share: int = 0) -> str:
        """Why sample ``g`` is not there, from the producer's heartbeat and how fresh it is."""
        who = self._who(beat, share)
        silence_s = self._beat_silence_s(beat, share)
        error = f"; its last error: {beat.last_error}" if beat.errors and beat.last_error else ""
        if beat.closed:
            return (
                f"{who} shut down {silence_s:.0f} s ago (its last heartbeat says it closed){error}: the capture "
                "component stopped or failed; look at the capture log"
            )
        if silence_s > self._stale_after_s:
            return (
                f"{who} has not beaten for {silence_s:.0f} s (sequence {beat.sequence}; it beats every "
                f"{self.heartbeat_interval_s:g} s, transport.heartbeat_interval_s): it is hung, stopped (SIGSTOP) or "
                f"dead; look at the capture log{error}"
            )
        sample = f"g={g}" if g is not None else "the sample"
        if beat.cursor is None:
            reason = "it has no cursor yet (it waits for trainer rank 0 to publish one)"
        elif beat.paused:
            reason = f"it is paused ({beat.waiting_for or 'at its watermark'})"
        elif g is not None and g < beat.cursor:
            reason = f"{sample} is below its cursor {beat.cursor} (it considers {sample} consumed)"
        elif g is not None and beat.window_end is not None and g >= beat.window_end:
            reason = f"{sample} is beyond its window [{beat.cursor}, {beat.window_end})"
        elif beat.waiting_for:
            reason = f"it waits for {beat.waiting_for}"
        else:
            reason = f"it is capturing ({beat.rate_samples_per_s:.2f} samples/s, {beat.in_flight} in flight)"
        return f"{who} is alive (last heartbeat {silence_s:.1f} s ago) but has not committed {sample}: {reason}{error}"

    def _idle_message(self, g: int, meta_key: str, waited: float, state: str) -> str:
        try:
            cursor = self._calls.call(self.read_cursor, STATUS_TIMEOUT_S, "read the cursor")
            cursor_text = f"cursor in the store: {cursor.value}" if cursor else "no cursor in the store"
        except TransportError:
            cursor_text = "cursor unreadable"
        return (
            f"rank {self.rank} waited {waited:.0f} s (transport.idle_timeout_s = {self.idle_timeout_s:g}) for sample "
            f"g={g} (key {meta_key}): {state}; {self._producer_status(g)}; {cursor_text}. Check the capture "
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
        """Delete what is still due (when the cursor allows it) and release the client."""
        try:
            self._delete_consumed_if_published()
        finally:
            self.client.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
