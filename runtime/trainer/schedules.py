"""Learning-rate schedules with a small, checkpointable state.

The factor multiplies ``optimizer.lr`` for the update of optimizer step ``s`` (0-based). With
``t = s + 1`` (the update's 1-based number) and ``w`` warmup steps:

- ``constant``: 1
- ``constant_with_warmup``: ``t / w`` while ``t <= w`` (the first update is not wasted at lr 0),
  then 1
- ``linear``: warmup, then from 1 linearly down to ``min_lr_ratio``, reached at ``t = total_steps``;
  progress is ``(t - w) / (total_steps - w)``
- ``cosine``: warmup, then half a cosine from 1 down to ``min_lr_ratio`` with the same progress
- ``wsd`` (warmup-stable-decay): warmup, 1, then over the last ``decay_steps`` updates linearly
  down to ``min_lr_ratio`` (``decay_steps`` defaults to 10% of the run, at least 1)

Every update after warmup therefore gets its own, lower rate, and the last update runs at the floor.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from runtime.recipe.schema import ScheduleConfig


@dataclass(frozen=True)
class LRSchedule:
    """A schedule shape bound to a run length."""

    type: str
    base_lr: float
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float
    decay_steps: int

    def factor(self, step: int) -> float:
        """LR multiplier for optimizer step ``step`` (0-based)."""
        if self.type == "constant":
            return 1.0
        t = step + 1
        if t <= self.warmup_steps:
            return t / self.warmup_steps
        if self.type == "constant_with_warmup":
            return 1.0
        floor = self.min_lr_ratio
        if self.type == "wsd":
            decay_start = self.total_steps - self.decay_steps
            if t <= decay_start:
                return 1.0
            progress = min(1.0, (t - decay_start) / self.decay_steps)
            return 1.0 - (1.0 - floor) * progress
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (t - self.warmup_steps) / span)
        if self.type == "linear":
            return 1.0 - (1.0 - floor) * progress
        if self.type == "cosine":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"unknown schedule type {self.type!r}")

    def lr(self, step: int) -> float:
        """Learning rate for optimizer step ``step``."""
        return self.base_lr * self.factor(step)

    def state(self) -> dict[str, object]:
        """JSON-able description stored in ``trainer_state.json``."""
        return asdict(self)


def build_schedule(config: ScheduleConfig, *, base_lr: float, run_total_steps: int) -> LRSchedule:
    """Bind the recipe's schedule to the run: ``total_steps`` defaults to the run's optimizer steps."""
    total = config.total_steps or run_total_steps
    decay = config.decay_steps or max(1, round(0.1 * total))
    warmup = 0 if config.type == "constant" else config.warmup_steps
    return LRSchedule(
        type=config.type,
        base_lr=base_lr,
        warmup_steps=warmup,
        total_steps=total,
        min_lr_ratio=config.min_lr_ratio,
        decay_steps=min(decay, total),
    )
