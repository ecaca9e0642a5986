"""Progress of the capture loop: rates over a sliding window, ETA, and one readable line."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

RATE_WINDOW_S = 60.0
"""Rates are measured over the last minute (a restart or a pause does not skew them for long)."""


def format_duration(seconds: float | None) -> str:
    """``3725`` -> ``1h02m05s``; None -> ``?``."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_bytes(num_bytes: int | None) -> str:
    """Bytes in binary units, one decimal."""
    if num_bytes is None:
        return "?"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} TiB"


@dataclass
class CaptureProgress:
    """Counts and rates of committed samples; :meth:`line` renders them with the window state."""

    total_samples: int
    """One past the last g to capture (for the ETA): the run's end, or the end of epoch 0 when the
    trainer caches features (later epochs are captured only when asked)."""
    note: str = ""
    """Appended to every progress line (e.g. that later epochs come from the trainer's cache)."""
    share_count: int = 1
    """Capture nodes sharing the work: this one captures every ``share_count``-th g (for the ETA)."""
    started: float = field(default_factory=time.monotonic)
    samples: int = 0
    tokens: int = 0
    bytes_written: int = 0
    frontier: int = 0
    """One past the highest g committed so far."""
    _events: deque[tuple[float, int, int]] = field(default_factory=deque)

    def record(self, g_values: list[int], tokens: int, num_bytes: int, now: float | None = None) -> None:
        """Samples ``g_values`` (``tokens`` tokens, ``num_bytes`` bytes in all) were committed."""
        now = time.monotonic() if now is None else now
        self.samples += len(g_values)
        self.tokens += tokens
        self.bytes_written += num_bytes
        if g_values:
            self.frontier = max(self.frontier, max(g_values) + 1)
        self._events.append((now, len(g_values), tokens))
        while self._events and now - self._events[0][0] > RATE_WINDOW_S:
            self._events.popleft()

    def rates(self, now: float | None = None) -> tuple[float, float]:
        """Samples/s and tokens/s over the last minute (since the start while younger)."""
        now = time.monotonic() if now is None else now
        window_start = max(self.started, now - RATE_WINDOW_S)
        recent = [e for e in self._events if e[0] >= window_start]
        span = max(now - window_start, 1e-6)
        return sum(e[1] for e in recent) / span, sum(e[2] for e in recent) / span

    def eta_s(self, now: float | None = None) -> float | None:
        """Seconds until every g of the run is captured, at the average rate since the start (the
        producer is paced by the trainer, so the long-run average is the meaningful rate; the last
        minute's rate swings between bursts and pauses). None before the first sample."""
        now = time.monotonic() if now is None else now
        remaining = max(self.total_samples - self.frontier, 0) // self.share_count
        if remaining == 0:
            return 0.0
        elapsed = now - self.started
        return remaining * elapsed / self.samples if self.samples and elapsed > 0 else None

    def stats(self, now: float | None = None) -> dict[str, Any]:
        """Numbers for the heartbeat."""
        samples_per_s, tokens_per_s = self.rates(now)
        return {
            "captured_samples": self.samples,
            "captured_tokens": self.tokens,
            "captured_bytes": self.bytes_written,
            "samples_per_s": round(samples_per_s, 3),
            "tokens_per_s": round(tokens_per_s, 1),
            "frontier": self.frontier,
            "total_samples": self.total_samples,
            "eta_s": self.eta_s(now),
        }

    def line(self, window: dict[str, Any], state: str) -> str:
        """One progress line: rates, window fill, what the producer does or waits for, ETA."""
        samples_per_s, tokens_per_s = self.rates()
        cursor, end = window.get("cursor"), window.get("window_end")
        return (
            f"capture: {self.samples} samples / {self.tokens} tokens committed "
            f"({samples_per_s:.2f} samples/s, {tokens_per_s:.0f} tokens/s); "
            f"window [{cursor}, {end}) {window.get('resident_samples', 0)} resident "
            f"({format_bytes(window.get('resident_bytes'))}), {window.get('in_flight', 0)} in flight; "
            f"{state}; captured up to g={self.frontier} of {self.total_samples}, ETA {format_duration(self.eta_s())}"
            f"{self.note}"
        )
