"""The two small control objects in the store: the trainer's cursor and the producer's heartbeat."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Cursor:
    """``{store_id}/cursor``: the first g not consumed by a committed optimizer step."""

    value: int
    """First unconsumed g."""
    step: int | None = None
    """Optimizer steps committed so far (``value // G`` when published by ``commit_step``)."""
    published_at: float = field(default_factory=time.time)
    """Wall-clock time of publication."""
    publisher: str = ""
    """Who published it (``rank 0 pid 1234 on host``)."""
    segment: str = ""
    """Trainer rank 0's segment (``ip:port``), where the cursor lives: the producer puts its heartbeat
    there too, so the heartbeat outlives a hung or dead producer ('' from a publisher without one)."""

    def encode(self) -> bytes:
        """JSON bytes."""
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Cursor:
        """Parse the stored form; raises ValueError on anything else."""
        data = json.loads(raw)
        if not isinstance(data, dict) or not isinstance(data.get("value"), int) or data["value"] < 0:
            raise ValueError(f"not a cursor object: {raw[:80]!r}")
        return cls(
            value=data["value"],
            step=data.get("step"),
            published_at=float(data.get("published_at", 0.0)),
            publisher=str(data.get("publisher", "")),
            segment=str(data.get("segment", "")),
        )


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
