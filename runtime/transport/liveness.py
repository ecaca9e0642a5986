"""The producer's liveness protocol: the heartbeat record, the writer the producer owns, the reader a
waiting trainer rank asks.

Every ``transport.heartbeat_interval_s`` the producer upserts one small JSON object (key
``heartbeat_key(store_id, share)``): who it is, its window, rates and errors, what it waits for. The
reader needs it most when the producer hangs or dies, which is exactly when the producer's own segment
stops answering (SIGSTOP: its transfers hang) and then leaves the store (``transport.client_ttl_s``),
heartbeat included. So the writer puts it into trainer rank 0's segment (named by the cursor rank 0
publishes), falls back to the producer's own segment while that one is unknown or does not take it,
and checks where each beat landed. The reader times each beat on its own monotonic clock (no skew
between nodes) and says which producer is silent and why.

Nothing else in ``runtime/`` reads or writes the heartbeat object (``tests/test_architecture.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from runtime.shared.contracts import heartbeat_key
from runtime.transport.deadline import STATUS_TIMEOUT_S, DeadlineCaller, StoreUnresponsiveError
from runtime.transport.errors import TRANSFER_FAIL, TransportError
from runtime.transport.records import Cursor
from runtime.transport.store import StoreClient

log = logging.getLogger("dspark.transport.producer")
"""The writer's lines are the producer's (it beats for it): same logger name in the capture log."""

RANK0_SEGMENT_RETRY_S = 30.0
"""After a put of the heartbeat into trainer rank 0's segment failed, beats go to the producer's own
segment for this long (or 3 heartbeat intervals, if longer) before rank 0's is tried again."""
STALE_AFTER_BEATS = 3
"""A heartbeat older than this many ``transport.heartbeat_interval_s`` means the producer stopped
beating (a beat can be late by a slow put, so one missed interval is not enough)."""
CLOSING_BEAT_WAIT_S = 5.0
"""Longest :meth:`HeartbeatWriter.close` waits for the heartbeat thread, and for a beat in progress."""


@dataclass(frozen=True)
class Heartbeat:
    """``{store_id}/heartbeat``: the producer's liveness and window, upserted every interval.

    It lives in trainer rank 0's segment (named by the cursor), not the producer's: a hung or dead
    producer's segment becomes unreadable and then leaves the store, and the heartbeat must stay to
    say who stopped beating and when. Until the producer knows rank 0's segment it beats into its own.
    """

    time: float
    """Wall-clock time of this beat."""
    sequence: int
    """Beats since the producer started (a reader sees it move)."""
    pid: int
    host: str
    cursor: int | None
    """The cursor the producer works from (None while it waits for one)."""
    window_end: int | None
    """One past the last g the window may hold."""
    resident_samples: int
    resident_bytes: int
    in_flight: int
    paused: bool
    committed_total: int
    """Samples committed since the producer started."""
    last_commit_time: float | None
    rate_samples_per_s: float
    errors: int
    last_error: str = ""
    waiting_for: str = ""
    """What the producer itself waits for, if anything (the cursor, free space)."""
    stats: dict[str, Any] = field(default_factory=dict)
    """Extra statistics from the capture engine."""
    segment: str = ""
    """Mooncake segment the producer owns (``ip:port``): where other writers put sample fields."""
    closed: bool = False
    """The producer's last beat, written as it closed (a clean shutdown): no further beat follows."""

    def encode(self) -> bytes:
        """JSON bytes."""
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Heartbeat:
        """Parse the stored form (unknown keys from newer producers are ignored)."""
        data = json.loads(raw)
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    def age_s(self, now: float | None = None) -> float:
        """Seconds since this beat (wall clock; both nodes are assumed NTP-synchronised)."""
        return (time.time() if now is None else now) - self.time

    def summary(self, now: float | None = None) -> str:
        """One line for a waiting trainer's log."""
        parts = [f"producer heartbeat {self.age_s(now):.1f} s old (pid {self.pid} on {self.host})"]
        if self.cursor is None:
            parts.append("producer has no cursor yet")
        else:
            parts.append(f"window [{self.cursor}, {self.window_end})")
        parts.append(f"resident {self.resident_samples} samples / {self.resident_bytes} bytes")
        parts.append("CLOSED" if self.closed else "PAUSED" if self.paused else "capturing")
        if self.last_commit_time is not None:
            parts.append(f"last commit {(time.time() if now is None else now) - self.last_commit_time:.1f} s ago")
        if self.waiting_for:
            parts.append(f"producer waits for {self.waiting_for}")
        if self.errors:
            parts.append(f"{self.errors} errors, last: {self.last_error}")
        return "; ".join(parts)


def stored_heartbeat(client: StoreClient, store_id: str, share: int = 0) -> Heartbeat | None:
    """Capture share ``share``'s heartbeat as it is in the store; None when there is none.

    Raises :class:`TransportError` when the store does not answer, ValueError / TypeError when the
    object does not parse.
    """
    raw = client.get_bytes(heartbeat_key(store_id, share))
    return Heartbeat.decode(raw) if raw else None


def readable_heartbeat(client: StoreClient, store_id: str, share: int = 0) -> Heartbeat | None:
    """Like :func:`stored_heartbeat`, but None also when the store does not answer or the object
    does not parse (the callers only want to know whether a usable beat is there)."""
    try:
        return stored_heartbeat(client, store_id, share)
    except (TransportError, ValueError, TypeError):
        return None


def owner_segment(client: StoreClient, store_id: str, share: int) -> str:
    """The segment the producer of capture share ``share`` owns, from its heartbeat ('' when unknown).

    A producer without a segment (an SGLang sink) puts its sample fields there, and follows a
    restarted owner to its new segment.
    """
    beat = readable_heartbeat(client, store_id, share)
    return beat.segment if beat is not None else ""


# ---------------------------------------------------------------------------------------------
# the writer (the producer owns one)
# ---------------------------------------------------------------------------------------------

ProducerReport = Callable[[], dict[str, Any]]
"""The heartbeat fields only the producer knows (``cursor`` .. ``waiting_for`` and ``stats``), read
under the producer's lock; the writer adds who, when, the sequence, the segment and ``closed``."""


class HeartbeatWriter:
    """Beats for one producer: a thread every interval, plus beats on demand; places each beat."""

    def __init__(
        self,
        client: StoreClient,
        store_id: str,
        share: int,
        interval_s: float,
        report: ProducerReport,
        *,
        read_cursor: Callable[[], object],
        on_failure: Callable[[str], None],
    ) -> None:
        """``read_cursor``: the producer's cursor read, which calls :meth:`follow_cursor` (a beat reads
        it when rank 0's segment is not known yet). ``on_failure``: records a failed beat of the
        thread among the producer's errors."""
        self.client = client
        self.key = heartbeat_key(store_id, share)
        self.interval_s = interval_s
        self._report = report
        self._read_cursor = read_cursor
        self._on_failure = on_failure
        self._sequence = 0
        self._sequence_lock = threading.Lock()
        self._rank0_segment = ""
        """Trainer rank 0's segment, from the cursor it publishes: where the heartbeat goes."""
        self._beat_segment: str | None = None
        """The segment the last beat was put into ('' this client's usual place, None no beat yet)."""
        self._rank0_rest_until = 0.0
        """Monotonic time before which beats skip rank 0's segment (after it failed to take one)."""
        self._trainer_leaving = False
        """The run is over (see :meth:`trainer_is_leaving`): beats stay in this producer's segment."""
        self._put_lock = threading.Lock()  # beats come from the heartbeat thread, the capture loop and close()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the producer tells it -----------------------------------------------------------

    @property
    def rank0_segment(self) -> str:
        """Trainer rank 0's segment the beats aim at ('' while unknown or after the run)."""
        return self._rank0_segment

    @property
    def thread(self) -> threading.Thread | None:
        """The heartbeat thread (None without :meth:`start`)."""
        return self._thread

    def follow_cursor(self, cursor: Cursor | None) -> None:
        """The producer read the cursor: ``cursor``, or None when it is absent from the store.

        A cursor naming a new segment is a (re)started trainer's rank 0: the next beat moves there.
        No cursor while rank 0's segment is known means rank 0 has left (the trainer finished or is
        restarting) or the master restarted: beats stop aiming at a segment that is gone (each would
        land elsewhere and warn), until a cursor names rank 0's segment again.
        """
        if cursor is None:
            if self._rank0_segment:
                log.info(
                    "no cursor in the store (trainer rank 0 has left, or the master restarted): the heartbeat "
                    "goes to this producer's own segment until a cursor names rank 0's segment again"
                )
                self._rank0_segment = ""
                self._rank0_rest_until = 0.0
            return
        if cursor.segment and cursor.segment != self._rank0_segment and not self._trainer_leaving:
            self._rank0_segment = cursor.segment
            self._rank0_rest_until = 0.0

    def trainer_is_leaving(self) -> None:
        """The trainer is about to end, taking rank 0's segment along: beats stay in this producer's
        own segment, so the end of a healthy run is not reported as a lost segment."""
        self._trainer_leaving = True
        self._rank0_segment = ""
        self._rank0_rest_until = 0.0

    # -- beats ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Beat now, then every ``interval_s`` on a daemon thread until :meth:`close`."""
        self._thread = threading.Thread(target=self._loop, name="dspark-heartbeat", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """Build a beat from the producer's report and put it (see :meth:`_place`)."""
        if not self._rank0_segment and not self._trainer_leaving:
            self._read_cursor()  # learns rank 0's segment (the capture loop may not have read it yet)
        self._put(self._next_beat().encode())

    def preview(self) -> Heartbeat:
        """The beat that would be put now (its sequence is not used up)."""
        with self._sequence_lock:
            return self._build(self._sequence + 1)

    def close(self) -> None:
        """Stop the thread and write a last beat marked ``closed`` (so a waiting trainer says the
        producer shut down rather than hung); best effort, the store may be gone already."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=CLOSING_BEAT_WAIT_S)
        # A producer that never beat (an SGLang sink) has nothing to close; a heartbeat thread still
        # in a put (a stopped rank 0 holds transfers until they time out) must not hold up close().
        stuck = self._thread is not None and self._thread.is_alive()
        if self._sequence == 0 or stuck:
            return
        try:
            self._put(dataclasses.replace(self._next_beat(), closed=True).encode(), final=True)
        except Exception as exc:
            log.debug("the closing heartbeat failed: %s", exc)

    def _loop(self) -> None:
        while not self._stop.wait(0 if self._sequence == 0 else self.interval_s):
            try:
                self.beat()
            except Exception as exc:  # a failed beat must not kill the producer; the next one retries
                self._on_failure(f"heartbeat: {exc}")
                log.warning("heartbeat failed: %s", exc)

    def _next_beat(self) -> Heartbeat:
        with self._sequence_lock:
            self._sequence += 1
            return self._build(self._sequence)

    def _build(self, sequence: int) -> Heartbeat:
        return Heartbeat(
            time=time.time(),
            sequence=sequence,
            pid=os.getpid(),
            host=socket.gethostname(),
            segment=self.client.preferred_segment if self.client.settings.segment_bytes else "",
            **self._report(),
        )

    # -- placement ------------------------------------------------------------------------------

    def _put(self, data: bytes, *, final: bool = False) -> None:
        """Put the beat into trainer rank 0's segment, else (unknown, or that put failed) into this
        producer's usual place.

        Rank 0's segment also holds the cursor, lives on the node that reads both, and only a
        trainer restart takes it away. Only this one object goes there; samples stay where they were.
        """
        # Never wait long behind another beat: one stuck in a put into a segment that is going away
        # (trainer rank 0's, as the run ends) holds the lock until the transfer times out, and the
        # capture's main thread, which beats on every state change, must stay free to see its stop.
        if not self._put_lock.acquire(timeout=CLOSING_BEAT_WAIT_S):
            log.debug("a heartbeat is skipped: another beat is still being put (the next one carries its state)")
            return
        try:
            self._place(data, final)
        finally:
            self._put_lock.release()

    def _place(self, data: bytes, final: bool) -> None:
        if self._trainer_leaving:
            self._put_after_the_run(data)
            return
        target = self._rank0_segment
        now = time.monotonic()
        target_error: TransportError | None = None
        if target and now >= self._rank0_rest_until:
            try:
                # One attempt: on failure the fallback below beats now instead of after the backoff.
                self._put_into(data, target, max_retries=0)
            except TransportError as exc:
                target_error = exc
            else:
                self._check_placement(data, target)
                return
        elif not target and self._beat_segment != "":
            log.debug(
                "trainer rank 0's segment is not known yet (no cursor names it): the heartbeat goes to this "
                "producer's own segment, and vanishes with it if the producer hangs or dies"
            )
        if self._put_into_own_segment(data, quick=final or target_error is not None, rank0_known=bool(target)):
            self._rest_rank0_after(target, target_error, now)

    def _put_after_the_run(self, data: bytes) -> None:
        """The run is over and its reader is leaving: one attempt into this producer's own place.
        When that is gone too (the sample segment was the trainer node's, and it left with it) the
        beat is dropped without retries or warnings: nobody waits for it any more."""
        try:
            self._put_into(data, "", max_retries=0)
        except TransportError as exc:
            log.debug("a heartbeat after the end of the run was not put: %s", exc)

    def _put_into_own_segment(self, data: bytes, *, quick: bool, rank0_known: bool) -> bool:
        """Whether the beat was put into this producer's usual place (``quick``: one attempt)."""
        # A producer that mounts no segment (transport.segment_placement: trainer) has nowhere to put a
        # beat until trainer rank 0 mounts the sample segment: at the start of every such run. That is
        # expected, not worth retries or a warning; the next beat tries again.
        nowhere_yet = not rank0_known and not self.client.settings.segment_bytes
        try:
            self._put_into(data, "", max_retries=0 if quick or nowhere_yet else None)
        except TransportError as exc:
            if not nowhere_yet:
                raise
            log.debug("no segment holds the heartbeat yet (trainer rank 0 has not mounted the sample segment): %s", exc)
            return False
        return True

    def _rest_rank0_after(self, target: str, error: TransportError | None, now: float) -> None:
        """After rank 0's segment did not take a beat that went to this producer's own instead."""
        if error is None:
            return
        if TRANSFER_FAIL in getattr(error, "codes", ()):
            # Rank 0's client is dead or stopped (a transfer into its segment failed, perhaps after
            # hanging): rest it instead of stalling every beat. Other failures (the master down or
            # restarting) are the store's, and the next beat tries rank 0's segment again.
            rest_s = max(RANK0_SEGMENT_RETRY_S, 3 * self.interval_s)
            self._rank0_rest_until = now + rest_s
            log.warning(
                "cannot put the heartbeat into trainer rank 0's segment %s (%s); it goes to this producer's "
                "own segment for %.0f s, then rank 0's is tried again (a restarted trainer publishes its new one)",
                target,
                error,
                rest_s,
            )
            return
        log.info(
            "the heartbeat went to this producer's own segment this once: trainer rank 0's segment %s did not "
            "take it (%s)",
            target,
            error,
        )

    def _check_placement(self, data: bytes, target: str) -> None:
        """Move the heartbeat into ``target`` if Mooncake put it elsewhere.

        Mooncake passes over a preferred segment that is not mounted at that moment (rank 0 gone, or
        not yet remounted after a master restart) without an error, and later upserts of the same
        size stay wherever that was. One metadata call per beat finds out.
        """
        try:
            actual = self.client.segment_of(self.key)
        except Exception as exc:  # diagnostics only: never fail a beat on it
            log.debug("cannot tell where the heartbeat is: %s", exc)
            return
        if not actual or actual == target:
            return
        self._beat_segment = actual  # the next put removes it first
        try:
            self._put_into(data, target, max_retries=0)
            actual = self.client.segment_of(self.key)
        except TransportError as exc:
            log.debug("moving the heartbeat into %s failed: %s", target, exc)
        if actual != target:
            # Rank 0's segment took nothing. The usual reason is that rank 0 has left -- the end of a
            # healthy run, the trainer going before the capture loop saw its last step -- and then the
            # cursor, which lives in that segment, is gone too: the cursor read says so at INFO and
            # beats stop aiming there. Only a rank 0 whose cursor is still there is worth a warning.
            self._read_cursor()
            if self._trainer_leaving or self._rank0_segment != target:
                return
            # rank 0's segment takes nothing now: rest it for a few beats (no remove-and-put every beat)
            rest_s = 3 * self.interval_s
            self._rank0_rest_until = time.monotonic() + rest_s
            log.warning(
                "the heartbeat landed in segment %s, not in trainer rank 0's %s (not mounted now?); it goes to "
                "this producer's own segment for %.0f s",
                actual or "?",
                target,
                rest_s,
            )

    def _put_into(self, data: bytes, segment: str, max_retries: int | None) -> None:
        if self._beat_segment is not None and self._beat_segment != segment:
            # An upsert of an object of the same size overwrites it where it is: move it explicitly
            # (a reader may find no heartbeat for this moment).
            try:
                self.client.remove([self.key])
            except TransportError as exc:
                log.debug("removing the heartbeat before moving it failed: %s", exc)
            self._beat_segment = None
        self.client.put_bytes(self.key, data, segment=segment, max_retries=max_retries)
        if self._beat_segment != segment:
            where = f"trainer rank 0's segment {segment}" if segment else "this producer's own segment"
            log.info("the heartbeat goes to %s", where)
        self._beat_segment = segment


# ---------------------------------------------------------------------------------------------
# the reader (a trainer rank asks it who is silent and why)
# ---------------------------------------------------------------------------------------------


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


class HeartbeatReader:
    """Reads the producers' heartbeats for one trainer rank and words what they say about a wait."""

    def __init__(
        self, client: StoreClient, store_id: str, *, interval_s: float, capture_shares: int, name: str
    ) -> None:
        """``interval_s``: the producers' ``transport.heartbeat_interval_s``; ``capture_shares``: how
        many producers capture (the one of share ``g % capture_shares`` captures g); ``name``: who
        reads (``rank 3``), for the read thread's name."""
        self.client = client
        self.store_id = store_id
        self.interval_s = interval_s
        self.capture_shares = capture_shares
        # Heartbeat reads on their own thread: one stuck there (the heartbeat in a stopped producer's
        # segment) must not hold up the sample reads, nor make them blame the master.
        self._calls = DeadlineCaller(f"{name} heartbeat reads")
        self._watches: dict[int, _BeatWatch] = {}
        """What this rank saw of each share's heartbeat, per share."""

    @property
    def stale_after_s(self) -> float:
        """A beat this much older than its successor should be means the producer stopped beating."""
        return STALE_AFTER_BEATS * self.interval_s

    def share_of(self, g: int) -> int:
        """The capture share whose producer captures ``g``."""
        return g % self.capture_shares

    def read(self, share: int = 0) -> Heartbeat | None:
        """Capture share ``share``'s heartbeat, or None (also remembered, with when this rank first
        saw it)."""
        beat = readable_heartbeat(self.client, self.store_id, share)
        if beat is not None:
            self.observe(beat, share)
        return beat

    def follow(self, share: int, timeout_s: float) -> None:
        """Read the heartbeat while waiting, within ``timeout_s``, so that a producer that stops
        beating is timed on this rank's own clock (see :meth:`silence_s`)."""
        with contextlib.suppress(StoreUnresponsiveError):
            self._calls.call(lambda: self.read(share), timeout_s, "read the producer heartbeat")

    def observe(self, beat: Heartbeat, share: int = 0) -> None:
        """Remember ``beat`` as read now."""
        now = time.monotonic()
        watch = self._watches.setdefault(share, _BeatWatch())
        identity = (beat.host, beat.pid, beat.sequence)
        if identity != watch.identity:
            # A new beat. If this rank read the previous one a moment ago, the new one is at most that
            # old, and its age can be timed on this rank's clock from now on.
            recent = watch.last_read is not None and now - watch.last_read <= self.stale_after_s
            watch.arrival_seen = watch.identity is not None and recent
            watch.identity = identity
            watch.first_seen = now
        watch.last_read = now
        watch.beat = beat

    def silence_s(self, beat: Heartbeat, share: int = 0) -> float:
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

    def describe(self, g: int | None = None) -> str:
        """The producer's side of a wait (the producer of ``g``'s capture share): who it is, when it
        last beat, and the likely cause."""
        share = self.share_of(g) if g is not None else 0
        try:
            beat = self._calls.call(lambda: self.read(share), STATUS_TIMEOUT_S, "read the producer heartbeat")
        except StoreUnresponsiveError as exc:
            return f"producer heartbeat unreadable: {exc}{self._last_seen(share)}"
        if beat is None:
            return self._describe_missing(share)
        return f"{self.likely_cause(beat, g, share)}; {beat.summary()}"

    def likely_cause(self, beat: Heartbeat, g: int | None, share: int = 0) -> str:
        """Why sample ``g`` is not there, from the producer's heartbeat and how fresh it is."""
        who = self._who(beat, share)
        silence_s = self.silence_s(beat, share)
        error = f"; its last error: {beat.last_error}" if beat.errors and beat.last_error else ""
        if beat.closed:
            return (
                f"{who} shut down {silence_s:.0f} s ago (its last heartbeat says it closed){error}: the capture "
                "component stopped or failed; look at the capture log"
            )
        if silence_s > self.stale_after_s:
            return (
                f"{who} has not beaten for {silence_s:.0f} s (sequence {beat.sequence}; it beats every "
                f"{self.interval_s:g} s, transport.heartbeat_interval_s): it is hung, stopped (SIGSTOP) or "
                f"dead; look at the capture log{error}"
            )
        sample = f"g={g}" if g is not None else "the sample"
        return (
            f"{who} is alive (last heartbeat {silence_s:.1f} s ago) but has not committed {sample}: "
            f"{_why_not_committed(beat, g, sample)}{error}"
        )

    def _describe_missing(self, share: int) -> str:
        last = self._last_beat(share)
        if last is None:
            return (
                f"no producer heartbeat in the store{self._share_text(share)}: the producer has not started (or not "
                "reached the store yet), or the store was restarted and the producer is gone; look at the capture log"
            )
        # The heartbeat lives in trainer rank 0's segment and outlives the producer; it goes missing
        # when the store lost it (master restart) or when the producer did not know rank 0's segment
        # yet, beat into its own, and that segment left the store with the producer.
        return (
            f"the producer's heartbeat vanished from the store; last seen from producer pid {last.pid} on "
            f"{last.host}{self._share_text(share)}, {self.silence_s(last, share):.0f} s old, sequence "
            f"{last.sequence}, {last.committed_total} samples committed: the mooncake_master most likely "
            "restarted (the store is empty until the producer beats again), or the producer beat into its own "
            "segment and most likely hung or died with it; look at the capture log and the master's log"
        )

    def _last_seen(self, share: int) -> str:
        last = self._last_beat(share)
        if last is None:
            return ""
        return (
            f"; last read from {self._who(last, share)} {self.silence_s(last, share):.0f} s ago, "
            f"sequence {last.sequence}"
        )

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


def _why_not_committed(beat: Heartbeat, g: int | None, sample: str) -> str:
    """What a live producer's heartbeat says about why ``sample`` (``g``) is not committed."""
    if beat.cursor is None:
        return "it has no cursor yet (it waits for trainer rank 0 to publish one)"
    if beat.paused:
        return f"it is paused ({beat.waiting_for or 'at its watermark'})"
    if g is not None and g < beat.cursor:
        return f"{sample} is below its cursor {beat.cursor} (it considers {sample} consumed)"
    if g is not None and beat.window_end is not None and g >= beat.window_end:
        return f"{sample} is beyond its window [{beat.cursor}, {beat.window_end})"
    if beat.waiting_for:
        return f"it waits for {beat.waiting_for}"
    return f"it is capturing ({beat.rate_samples_per_s:.2f} samples/s, {beat.in_flight} in flight)"
