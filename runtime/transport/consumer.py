"""The consumer side of the data plane: fetch(g) with waiting, commit_step(s), the cursor.

A trainer rank reads a sample only after its ``meta`` exists (the commit marker), straight into
tensors it owns (or into reusable pinned staging buffers before a copy to the GPU), checks every
field's size and CRC-32, and after an optimizer step commits it publishes the cursor and deletes
the keys it consumed. While it waits it logs what it waits for and how old the producer's
heartbeat is, and after ``transport.idle_timeout_s`` on one sample it fails with that message.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from runtime.recipe.schema import Recipe
from runtime.shared.contracts import (
    META_FIELD,
    TENSOR_FIELDS,
    CapturedSample,
    cursor_key,
    heartbeat_key,
    sample_key,
    step_sample_indices,
)
from runtime.transport.errors import CorruptSampleError, IdleTimeoutError, TransportError
from runtime.transport.records import Cursor, Heartbeat
from runtime.transport.sample_format import FieldLayout, decode_meta, field_layouts, sample_keys, verify_field
from runtime.transport.store import StoreClient

log = logging.getLogger("dspark.transport.consumer")

CURSOR_CHECK_INTERVAL_S = 1.0


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
        self._published: int | None = None
        self._delete_below: int | None = None
        self._staging: dict[str, torch.Tensor] = {}
        self.wait_s_total = 0.0
        self.fetch_s_total = 0.0
        self.bytes_total = 0
        self.samples_total = 0

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
        self._delete_consumed_if_published()
        meta_key = sample_key(self.store_id, g, META_FIELD)
        start = time.monotonic()
        last_log = start
        last_cursor_check = 0.0
        corrupt = 0
        while True:
            present = self.client.exist_once([meta_key])
            if present is None:
                state = "the store does not answer (master down or restarting)"
            elif not present[0]:
                state = "its meta (the commit marker) is not in the store yet"
            else:
                try:
                    sample = self._read(g, meta_key, device)
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
                self._republish_missing_cursor()
            waited = now - start
            if waited >= self.idle_timeout_s:
                self.wait_s_total += waited
                raise IdleTimeoutError(self._idle_message(g, meta_key, waited, state))
            if now - last_log >= self.wait_log_interval_s:
                log.info(
                    "rank %d waiting %.0f s for sample g=%d (%s): %s",
                    self.rank,
                    waited,
                    g,
                    state,
                    self._producer_status(),
                )
                last_log = now
            time.sleep(self.poll_interval_s)

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

    # -- store objects ----------------------------------------------------------------------

    def read_cursor(self) -> Cursor | None:
        """The published cursor, or None."""
        raw = self.client.get_bytes(cursor_key(self.store_id))
        return Cursor.decode(raw) if raw is not None else None

    def read_heartbeat(self) -> Heartbeat | None:
        """The producer's last heartbeat, or None."""
        try:
            raw = self.client.get_bytes(heartbeat_key(self.store_id))
        except TransportError:
            return None
        if raw is None:
            return None
        try:
            return Heartbeat.decode(raw)
        except (ValueError, TypeError):
            return None

    def _write_cursor(self, value: int, step: int | None) -> None:
        publisher = f"rank {self.rank} pid {os.getpid()} on {socket.gethostname()}"
        self.client.put_bytes(cursor_key(self.store_id), Cursor(value, step, time.time(), publisher).encode())
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

    def _producer_status(self) -> str:
        beat = self.read_heartbeat()
        if beat is None:
            return "no producer heartbeat in the store (the producer has not started, or the store was restarted)"
        return beat.summary()

    def _idle_message(self, g: int, meta_key: str, waited: float, state: str) -> str:
        try:
            cursor = self.read_cursor()
            cursor_text = f"cursor in the store: {cursor.value}" if cursor else "no cursor in the store"
        except TransportError:
            cursor_text = "cursor unreadable"
        return (
            f"rank {self.rank} waited {waited:.0f} s (transport.idle_timeout_s = {self.idle_timeout_s:g}) for sample "
            f"g={g} (key {meta_key}): {state}; {self._producer_status()}; {cursor_text}. Check the capture "
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
