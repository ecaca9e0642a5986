"""The producer side of the data plane: which g to capture next, commit, pause/resume.

The producer process owns the store's memory: its Mooncake client mounts the global segment, so its
own puts are local copies (Mooncake's same-process memcpy path) and trainer ranks on the other node
read over the network. Its state is rebuilt from the store by *reconciliation*, never from a log:
every :meth:`Producer.refresh` reads the cursor, scans the keys of the window, drops what is below
the cursor (consumed but not deleted) or half-written (a crash between a field and its ``meta``),
and the window then names the missing g in order. That is also all a restart needs:

- trainer restarts: it republishes its checkpoint's cursor; the scan finds the deleted samples
  missing and they are captured again, in order;
- producer restarts: its segment (and every sample in it) is gone once the master expires it; it
  takes the cursor from the store, or from the trainer's republication, or from the last cursor it
  saw (``producer_state.json`` in the job folder), and refills;
- master restarts: the store is empty; the producer keeps working from the cursor it last saw, the
  trainer's rank 0 republishes the cursor when it finds it missing.

Its heartbeat (who it is, its window, what it waits for) is written by the
:class:`~runtime.transport.liveness.HeartbeatWriter` it owns.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from runtime.files import atomic_write_text
from runtime.shared.contracts import (
    CONTRACT_DTYPES,
    JOB_FOLDER_SETTING,
    META_FIELD,
    TENSOR_FIELDS,
    cursor_key,
    dtype_name,
    sample_key,
    want_key,
)
from runtime.transport.errors import TransportError
from runtime.transport.liveness import HeartbeatWriter, owner_segment
from runtime.transport.records import Cursor
from runtime.transport.sample_format import (
    build_meta,
    decode_meta,
    describe_field,
    encode_meta,
    sample_keys,
    submit_crc32_chunks,
)
from runtime.transport.settings import ProducerSettings
from runtime.transport.store import StoreClient
from runtime.transport.window import WindowState

log = logging.getLogger("dspark.transport.producer")


class Producer:
    """Producer API (implements :class:`runtime.shared.contracts.SampleProducer`)."""

    def __init__(
        self,
        client: StoreClient,
        settings: ProducerSettings,
        *,
        state_path: Path | None = None,
        start_cursor: int | None = None,
        auto_heartbeat: bool = True,
        share: tuple[int, int] = (0, 1),
    ) -> None:
        """``share``: (index, count) of this producer among the capture nodes' producers; it captures
        and cleans up the g with ``g % count == index`` and beats under its own heartbeat key."""
        self.client = client
        self.settings = settings
        self.store_id = settings.store_id
        self.state_path = state_path
        self.start_cursor = start_cursor
        self.window = WindowState(settings.window, share_index=share[0], share_count=share[1])
        if not 0 <= share[0] < share[1]:
            raise ValueError(f"capture share {share[0]} outside 0..{share[1] - 1}")
        self._bytes: dict[int, int] = {}
        self._lock = threading.RLock()
        self._staging: dict[str, torch.Tensor] = {}
        self._committed_during_scan: dict[int, int] | None = None
        """Commits that finished while :meth:`refresh` scanned (a commit thread runs beside it)."""
        self._committed_total = 0
        self._commit_times: list[float] = []
        self._last_commit_time: float | None = None
        self._errors = 0
        self._last_error = ""
        self._waiting_for = ""
        self._extra_stats: dict[str, Any] = {}
        self._last_progress_log = time.monotonic()
        self._logged_paused = False
        """The pause state the log last showed."""
        self._pauses_at_last_log = 0
        """``window.transitions`` when the last progress line was written."""
        self._stop = threading.Event()
        self.heartbeat_writer = HeartbeatWriter(
            client,
            self.store_id,
            share[0],
            settings.heartbeat_interval_s,
            self._report,
            read_cursor=self._read_cursor,
            on_failure=self._note_error,
        )
        if auto_heartbeat:
            self.heartbeat_writer.start()

    # -- SampleProducer ---------------------------------------------------------------------

    def next_to_capture(self) -> int | None:
        """The next g the window needs (claimed: a second call returns the one after), or None
        while paused or while no cursor is known."""
        batch = self.next_batch(1)
        return batch[0] if batch else None

    def next_batch(self, max_count: int) -> list[int]:
        """Up to ``max_count`` g to capture, in order, claimed for this producer (empty while paused,
        while no cursor is known, or while the store does not answer)."""
        try:
            self.refresh()
        except TransportError as exc:
            self._note_error(f"refresh: {exc}", waiting_for="the store to answer")
            log.warning("cannot reconcile with the store (master restarting?): %s", exc)
            return []
        with self._lock:
            return self.window.claim(max_count)

    def wait_next(self, max_count: int = 1, timeout_s: float | None = None) -> list[int]:
        """Block until some g can be captured (logging why it waits); empty after ``timeout_s``."""
        start = time.monotonic()
        last_log = start
        while not self._stop.is_set():
            batch = self.next_batch(max_count)
            if batch:
                return batch
            now = time.monotonic()
            if timeout_s is not None and now - start >= timeout_s:
                return []
            if now - last_log >= self.settings.wait_log_interval_s:
                log.info("producer idle for %.0f s: %s", now - start, self.describe_wait())
                last_log = now
            time.sleep(self.settings.poll_interval_s)
        return []

    accepts_checksums = True
    """:meth:`commit` takes ``sum16`` checksums computed by the caller (see CommitPipeline)."""

    def commit(
        self,
        g: int,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any],
        checksums: Mapping[str, tuple[int, ...]] | None = None,
    ) -> int:
        """Write every tensor field of sample g, then ``meta`` last (idempotent upsert).

        ``checksums``: the ``sum16`` values of some fields, computed where the tensors were made
        (on the capture GPU, before the device-to-host copy); the other fields get CRC-32s here.
        Returns the bytes written (0 when ``g`` is already below the cursor: nobody needs it).
        """
        checksums = checksums or {}
        try:
            missing = [name for name in TENSOR_FIELDS if name not in tensors]
            if missing:
                raise ValueError(f"sample g={g}: fields {missing} are missing; a sample has {list(TENSOR_FIELDS)}")
            cursor = self._read_cursor()
            if cursor is not None and g < cursor.value:
                log.info("sample g=%d is below the cursor %d (the trainer moved on); not written", g, cursor.value)
                with self._lock:
                    self.window.release(g)
                return 0
            if not self.client.settings.segment_bytes:
                self._follow_owner_segment()
            host = [self._to_host(g, name, tensors[name]) for name in TENSOR_FIELDS]
            # The checksums run on their own threads while the fields are put; meta waits for both.
            crc_futures = [
                [] if name in checksums else submit_crc32_chunks(t) for name, t in zip(TENSOR_FIELDS, host, strict=True)
            ]
            keys = [sample_key(self.store_id, g, name) for name in TENSOR_FIELDS]
            meta_key = sample_key(self.store_id, g, META_FIELD)
            if self.client.exist([meta_key])[0]:
                # Re-capture of a committed sample: withdraw the commit marker first, so no reader
                # pairs the old meta (sizes, CRCs) with fields being rewritten.
                self.client.remove([meta_key])
            self.client.put_tensors(keys, host, what=f"sample g={g}")
            layouts = [
                describe_field(name, t, sum16=tuple(checksums[name]))
                if name in checksums
                else describe_field(name, t, crc32=tuple(f.result() for f in futures))
                for name, t, futures in zip(TENSOR_FIELDS, host, crc_futures, strict=True)
            ]
            full_meta = build_meta(g, layouts, meta)
            meta_bytes = encode_meta(full_meta)
            # meta last: a reader that sees it can read every field.
            self.client.put_bytes(meta_key, meta_bytes)
        except BaseException as exc:
            with self._lock:
                self.window.release(g)
                self._note_error(f"commit g={g}: {exc}")
            raise
        total = int(full_meta["sample_bytes"]) + len(meta_bytes)
        now = time.time()
        with self._lock:
            self._bytes[g] = total
            self.window.committed(g, total)
            if self._committed_during_scan is not None:
                self._committed_during_scan[g] = total
            self._committed_total += 1
            self._last_commit_time = now
            self._commit_times = [t for t in self._commit_times if now - t < 60.0] + [now]
        return total

    def _follow_owner_segment(self) -> None:
        """A producer without a segment (an SGLang sink) writes into the owning producer's segment,
        named in its heartbeat; it follows a restarted owner to its new segment."""
        segment = owner_segment(self.client, self.store_id, self.window.share_index)
        if segment:
            self.client.prefer_segment(segment)

    def _note_error(self, text: str, *, waiting_for: str | None = None) -> None:
        """Count a failure; the heartbeat reports the count and the last one."""
        with self._lock:
            self._errors += 1
            self._last_error = text[:300]
            if waiting_for is not None:
                self._waiting_for = waiting_for

    def capture_later_epochs_only_when_asked(self, rows_per_epoch: int) -> None:
        """``trainer.feature_cache``: capture epoch 0 (g below ``rows_per_epoch``) in full, and a
        later g only while a trainer rank's ``want`` key asks for it."""
        with self._lock:
            self.window.asked_from = rows_per_epoch
        log.info(
            "the trainer caches features: capturing epoch 0 (g < %d) and later samples only when a trainer "
            "rank asks for them",
            rows_per_epoch,
        )

    def trainer_is_leaving(self) -> None:
        """The trainer consumed every sample of the run and is about to end, taking trainer rank 0's
        segment (and the cursor in it) along: from now on the heartbeat stays in this producer's own
        segment, so the end of a healthy run is not reported as a lost segment."""
        self.heartbeat_writer.trainer_is_leaving()

    def release(self, g: int) -> None:
        """Give back a claimed g whose capture failed (it will be offered again)."""
        with self._lock:
            self.window.release(g)

    def heartbeat(self, stats: Mapping[str, Any] | None = None) -> None:
        """Upsert the heartbeat now; ``stats`` (engine rates, ...) are kept for later beats too.

        It goes to trainer rank 0's segment when the cursor named one (see
        :class:`~runtime.transport.liveness.HeartbeatWriter`).
        """
        if stats:
            with self._lock:
                self._extra_stats.update(stats)
        self.heartbeat_writer.beat()

    # -- reconciliation ---------------------------------------------------------------------

    def refresh(self) -> None:
        """Rebuild the window from the store: cursor, complete samples, garbage, half-written."""
        cursor = self._current_cursor()
        if cursor is None:
            with self._lock:
                self._waiting_for = "the trainer to publish the cursor"
            return
        with self._lock:
            # A pipelined commit (another thread) may finish while the store is scanned: its sample
            # is then complete but missing from the scan, or looks half-written. Neither may be
            # dropped from the picture or removed from the store.
            in_flight_before = set(self.window.in_flight)
            self._committed_during_scan = {}
        for _ in range(3):
            present, partial, asked, stale_asks = self._scan(cursor)
            again = self._current_cursor()
            if again == cursor:
                break
            cursor = again  # a rank committed a step while we scanned; its deletions are not holes
            if cursor is None:
                with self._lock:
                    self._committed_during_scan = None
                return
        with self._lock:
            late = self._committed_during_scan or {}
            self._committed_during_scan = None
            present.update(late)
            self.window.asked = asked
            self.window.observe(cursor, present)
            partial = [
                g for g in partial if g not in self.window.in_flight and g not in in_flight_before and g not in late
            ]
            garbage = self.window.garbage()
        partial = [g for g in partial if self.window.mine(g)]  # another producer's may be mid-commit
        if partial:
            log.info("removing %d half-written samples (fields without meta): %s", len(partial), partial[:8])
            self.client.remove([k for g in partial for k in sample_keys(self.store_id, g)])
        if stale_asks:
            self.client.remove([want_key(self.store_id, g) for g in stale_asks])
        if garbage:
            self.client.remove([k for g in garbage for k in sample_keys(self.store_id, g)])
            with self._lock:
                self.window.removed(garbage)
        with self._lock:
            victims = self.window.tail_victims()
        if victims:
            log.warning(
                "the next step's samples are missing while the store is at its watermark; dropping %d samples "
                "from the far end of the window to make room: %s",
                len(victims),
                victims[:8],
            )
            self.client.remove([k for g in victims for k in sample_keys(self.store_id, g)])
            with self._lock:
                self.window.removed(victims)
        with self._lock:
            # A full window is the healthy steady state of a producer faster than the trainer (it
            # pauses, the trainer consumes, it resumes: every few steps). The flips go to DEBUG and
            # the periodic progress line counts them; only the state the log last showed is compared,
            # so a pause taken between two passes is not reported as a lone "resumed".
            if self.window.paused != self._logged_paused:
                self._logged_paused = self.window.paused
                if self.window.paused:
                    log.debug("producer paused: %s", self.window.pause_reason())
                else:
                    log.debug(
                        "producer resumed: %d samples / %d bytes resident",
                        self.window.resident_samples,
                        self.window.resident_bytes,
                    )
            self._waiting_for = self.window.pause_reason()
        self._maybe_log_progress()

    def _current_cursor(self) -> int | None:
        stored = self._read_cursor()
        with self._lock:
            known = self.window.cursor
        if stored is not None:
            if stored.value != known:
                self._save_state(stored.value)
            return stored.value
        if known is not None:
            return known  # the store lost it (master restart): keep working from the last one seen
        saved = self._load_state()
        if saved is not None:
            log.info("no cursor in the store; starting from the last cursor this job saw (%d)", saved)
            return saved
        if self.start_cursor is not None:
            return self.start_cursor
        return None

    def _read_cursor(self) -> Cursor | None:
        try:
            raw = self.client.get_bytes(cursor_key(self.store_id))
        except TransportError as exc:
            log.warning("cannot read the cursor: %s", exc)
            return None
        if raw is None:
            # The cursor lives in rank 0's segment: without it, beats stop aiming there.
            self.heartbeat_writer.follow_cursor(None)
            return None
        try:
            cursor = Cursor.decode(raw)
        except ValueError as exc:
            log.warning("ignoring an unreadable cursor object: %s", exc)
            return None
        self.heartbeat_writer.follow_cursor(cursor)  # a (re)started trainer's rank 0: beats move there
        return cursor

    def _scan(self, cursor: int) -> tuple[dict[int, int], list[int], set[int], list[int]]:
        """Complete samples (g -> bytes) and half-written ones in and around the window; with the
        trainer's feature cache also the g asked for in the window and stale asks below the cursor."""
        high = self.window.limits.high_samples
        with self._lock:
            known = set(self.window.resident) | set(self.window.in_flight)
            asked_from = self.window.asked_from
        candidates = sorted(set(range(max(0, cursor - high), cursor + 2 * high)) | known)
        keys = [k for g in candidates for k in sample_keys(self.store_id, g)]
        askable = [g for g in candidates if asked_from is not None and g >= asked_from]
        exists = self.client.exist(keys + [want_key(self.store_id, g) for g in askable])
        per = len(TENSOR_FIELDS) + 1
        present: dict[int, int] = {}
        partial: list[int] = []
        for index, g in enumerate(candidates):
            flags = exists[index * per : (index + 1) * per]
            if all(flags):
                present[g] = self._bytes.get(g) or self._bytes_from_meta(g)
            elif any(flags):
                partial.append(g)
        asks = [g for g, flag in zip(askable, exists[len(keys) :], strict=True) if flag]
        asked = {g for g in asks if g >= cursor}
        stale = [g for g in asks if g < cursor]
        return present, partial, asked, stale

    def _bytes_from_meta(self, g: int) -> int:
        key = sample_key(self.store_id, g, META_FIELD)
        raw = self.client.get_bytes(key)
        if raw is None:
            return 0
        try:
            meta = decode_meta(g, key, raw)
        except TransportError:
            return 0
        num_bytes = int(meta.get("sample_bytes", 0)) + len(raw)
        self._bytes[g] = num_bytes
        return num_bytes

    def _load_state(self) -> int | None:
        if self.state_path is None or not self.state_path.exists():
            return None
        try:
            data = json.loads(self.state_path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if data.get("store_id") != self.store_id:
            return None
        value = data.get("cursor")
        return value if isinstance(value, int) and value >= 0 else None

    def _save_state(self, cursor: int) -> None:
        if self.state_path is None:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(
            self.state_path,
            json.dumps({"store_id": self.store_id, "cursor": cursor, "saved_at": time.time()}) + "\n",
            JOB_FOLDER_SETTING,
        )

    # -- host staging -----------------------------------------------------------------------

    def _to_host(self, g: int, name: str, tensor: torch.Tensor) -> torch.Tensor:
        expected = CONTRACT_DTYPES[name]
        if dtype_name(tensor.dtype) != expected:
            raise ValueError(
                f"sample g={g}: field {name} has dtype {tensor.dtype}, the capture contract says {expected} "
                "(runtime/shared/contracts.py); convert it before commit"
            )
        if tensor.device.type == "cpu":
            return tensor.contiguous()
        # Device tensors land in a reusable pinned buffer per field (one D2H copy, no allocation).
        num_bytes = tensor.numel() * tensor.element_size()
        buf = self._staging.get(name)
        if buf is None or buf.numel() < num_bytes:
            buf = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self._staging[name] = buf
        host = buf[:num_bytes].view(tensor.dtype).view(tensor.shape)
        host.copy_(tensor)
        return host

    # -- what the heartbeat reports ---------------------------------------------------------

    def _report(self) -> dict[str, Any]:
        """This producer's window and progress, as heartbeat fields (see
        :data:`~runtime.transport.liveness.ProducerReport`)."""
        with self._lock:
            now = time.time()
            recent = [t for t in self._commit_times if now - t < 60.0]
            span = (now - recent[0]) if len(recent) > 1 else 0.0
            return {
                "cursor": self.window.cursor,
                "window_end": self.window.window_end,
                "resident_samples": len(self.window.resident),
                "resident_bytes": self.window.resident_bytes,
                "in_flight": len(self.window.in_flight),
                "paused": self.window.paused,
                "committed_total": self._committed_total,
                "last_commit_time": self._last_commit_time,
                "rate_samples_per_s": (len(recent) - 1) / span if span > 0 else 0.0,
                "errors": self._errors,
                "last_error": self._last_error,
                "waiting_for": self._waiting_for,
                "stats": dict(self._extra_stats),
            }

    def stats(self) -> dict[str, Any]:
        """Window and rate numbers (what the heartbeat publishes)."""
        beat = self.heartbeat_writer.preview()
        return {k: v for k, v in beat.__dict__.items() if k not in ("pid", "host", "stats")}

    def describe_wait(self) -> str:
        """Why the producer has nothing to capture right now."""
        with self._lock:
            if self.window.cursor is None:
                return "waiting for the trainer to publish the cursor (no cursor in the store, none saved by this job)"
            if self.window.paused:
                return f"paused: {self.window.pause_reason()}"
            end = self.window.window_end or 0
            if self.window.asked_from is not None and end > self.window.asked_from:
                return (
                    f"window [{self.window.cursor}, {end}) holds what it needs; from g={self.window.asked_from} on "
                    "the trainer reads its feature cache, and nothing it lacks was asked for"
                )
            return f"window [{self.window.cursor}, {end}) is full or in flight"

    def _maybe_log_progress(self) -> None:
        now = time.monotonic()
        if now - self._last_progress_log < self.settings.wait_log_interval_s:
            return
        self._last_progress_log = now
        s = self.stats()
        with self._lock:
            pauses = (self.window.transitions - self._pauses_at_last_log + 1) // 2
            self._pauses_at_last_log = self.window.transitions
        waited = f" (the window filled {pauses} times since the last line: the trainer sets the pace)" if pauses else ""
        log.info(
            "producer: %d samples committed (%.2f/s over the last minute), window [%s, %s), resident %d samples / "
            "%d bytes, %s%s",
            s["committed_total"],
            s["rate_samples_per_s"],
            s["cursor"],
            s["window_end"],
            s["resident_samples"],
            s["resident_bytes"],
            "PAUSED" if s["paused"] else "capturing",
            waited,
        )

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the heartbeat, write a last beat marked closed (so a waiting trainer says the producer
        shut down rather than hung), and release the client (the segment, and every sample, leaves
        the store)."""
        self._stop.set()
        self.heartbeat_writer.close()
        self.client.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
