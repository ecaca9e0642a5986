"""The trainer's cursor, the small control object rank 0 publishes (the producer's heartbeat is
:mod:`runtime.transport.liveness`'s)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field


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
