"""The producer window as pure state: which g to capture next, and when to pause.

The producer keeps every g in ``[cursor, cursor + high_watermark_samples)`` present, capturing the
missing ones in order. It pauses when resident samples reach the high watermark or resident bytes
reach the byte high watermark, and resumes only when both are below their low watermarks
(hysteresis). Nothing here talks to Mooncake: the producer feeds it what a scan of the store found,
so the rules are unit-testable on their own.

One rule keeps the trainer from starving: the *head* of the window (the next global step,
``[cursor, cursor + G)``) is captured even while the hysteresis holds the producer paused, as long as
the hard high watermarks are not reached; and when they are reached while the head has a hole
(possible after the trainer restarts from an older checkpoint and the cursor moves back), samples
from the far end of the window are dropped to make room. Without it, a paused producer could hold
samples the trainer needs later while the one it needs now is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WindowLimits:
    """The four watermarks."""

    high_samples: int
    low_samples: int
    high_bytes: int
    low_bytes: int
    head_samples: int
    """Samples of one global step (G): the part of the window the trainer needs next."""


@dataclass
class WindowState:
    """What the producer knows about the store, and its pause state."""

    limits: WindowLimits
    cursor: int | None = None
    """First g the trainer has not consumed; None until one is known."""
    resident: dict[int, int] = field(default_factory=dict)
    """Complete samples in the store (g -> bytes), including consumed ones not yet deleted."""
    in_flight: set[int] = field(default_factory=set)
    """Claimed by a capture, not committed yet."""
    paused: bool = False
    transitions: int = 0
    """How many times ``paused`` flipped (for logs and tests)."""
    asked_from: int | None = None
    """With the trainer's feature cache: the first g of epoch 1. From there on a g is captured
    only while a trainer rank asks for it (its row is not in the rank's cache)."""
    asked: set[int] = field(default_factory=set)
    """The g at or past ``asked_from`` a trainer rank asked for (``want`` keys in the store)."""
    share_index: int = 0
    share_count: int = 1
    """With several capture nodes (``job.capture.nodes``) each producer captures the g with
    ``g % share_count == share_index``; resident samples and the watermarks stay global."""

    def mine(self, g: int) -> bool:
        """Whether ``g`` is this producer's to capture (and to clean up)."""
        return g % self.share_count == self.share_index

    @property
    def window_end(self) -> int | None:
        """One past the last g the window may hold."""
        return None if self.cursor is None else self.cursor + self.limits.high_samples

    @property
    def resident_samples(self) -> int:
        """Samples counted against the sample watermarks: resident plus in flight."""
        return len(self.resident) + len(self.in_flight)

    @property
    def resident_bytes(self) -> int:
        """Bytes of the resident samples (in-flight ones are not known until committed)."""
        return sum(self.resident.values())

    def observe(self, cursor: int | None, present: dict[int, int]) -> None:
        """Replace the picture with a fresh scan: the cursor and the complete samples found."""
        if cursor is not None:
            self.cursor = cursor
        self.resident = dict(present)
        self.in_flight -= set(present)
        self._update_pause()

    def committed(self, g: int, num_bytes: int) -> None:
        """Sample ``g`` was committed by this producer."""
        self.in_flight.discard(g)
        self.resident[g] = num_bytes
        self._update_pause()

    def release(self, g: int) -> None:
        """A claimed ``g`` will not be committed (its capture failed); it becomes missing again."""
        self.in_flight.discard(g)
        self._update_pause()

    def removed(self, gs: list[int]) -> None:
        """These samples were deleted from the store."""
        for g in gs:
            self.resident.pop(g, None)
        self._update_pause()

    def garbage(self) -> list[int]:
        """This producer's resident samples below the cursor: consumed by a committed step but not deleted."""
        if self.cursor is None:
            return []
        return sorted(g for g in self.resident if g < self.cursor and self.mine(g))

    def missing(self) -> list[int]:
        """This producer's g of the window that are neither resident nor in flight, in order."""
        if self.cursor is None:
            return []
        end = self.cursor + self.limits.high_samples
        return [
            g
            for g in range(self.cursor, end)
            if g not in self.resident and g not in self.in_flight and self.needed(g) and self.mine(g)
        ]

    def needed(self, g: int) -> bool:
        """Whether ``g`` is to be captured at all: always, unless the trainer caches features and
        ``g`` belongs to a later epoch nobody asked for."""
        return self.asked_from is None or g < self.asked_from or g in self.asked

    def at_hard_limit(self) -> bool:
        """Resident samples or bytes have reached a high watermark."""
        lim = self.limits
        return self.resident_samples >= lim.high_samples or self.resident_bytes >= lim.high_bytes

    def head_missing(self) -> bool:
        """Some g of the next global step is neither resident nor in flight."""
        if self.cursor is None:
            return False
        head_end = self.cursor + self.limits.head_samples
        return any(g < head_end for g in self.missing())

    def tail_victims(self) -> list[int]:
        """Resident samples to drop so that a hole in the head can be filled (usually none).

        Only when the head has a hole and a hard watermark is reached: the largest resident g
        outside the head go first, until both resident samples and bytes are below the high
        watermarks with room for one more sample.
        """
        if self.cursor is None or not self.head_missing() or not self.at_hard_limit():
            return []
        head_end = self.cursor + self.limits.head_samples
        candidates = sorted((g for g in self.resident if g >= head_end and self.mine(g)), reverse=True)
        samples, num_bytes, lim = self.resident_samples, self.resident_bytes, self.limits
        victims: list[int] = []
        for g in candidates:
            if samples < lim.high_samples and num_bytes < lim.high_bytes:
                break
            victims.append(g)
            samples -= 1
            num_bytes -= self.resident[g]
        return victims

    def claim(self, max_count: int = 1) -> list[int]:
        """Up to ``max_count`` missing g, in order, marked in flight.

        Empty while paused, except for head g (the next global step) while no hard watermark
        is reached.
        """
        claimed: list[int] = []
        self._update_pause()
        if self.cursor is None:
            return claimed
        head_end = self.cursor + self.limits.head_samples
        for g in self.missing():
            if len(claimed) >= max_count:
                break
            if self.paused and not (g < head_end and not self.at_hard_limit()):
                break
            self.in_flight.add(g)
            claimed.append(g)
            self._update_pause()
        return claimed

    def _update_pause(self) -> None:
        samples, num_bytes, lim = self.resident_samples, self.resident_bytes, self.limits
        if not self.paused and (samples >= lim.high_samples or num_bytes >= lim.high_bytes):
            self.paused = True
            self.transitions += 1
        elif self.paused and samples < lim.low_samples and num_bytes < lim.low_bytes:
            self.paused = False
            self.transitions += 1

    def pause_reason(self) -> str:
        """Why the producer is paused (empty when it is not)."""
        if not self.paused:
            return ""
        lim = self.limits
        return (
            f"{self.resident_samples} samples (high {lim.high_samples}, resumes below {lim.low_samples}) and "
            f"{self.resident_bytes} bytes (high {lim.high_bytes}, resumes below {lim.low_bytes}) resident"
        )
