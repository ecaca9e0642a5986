"""How far a measured speed-up can be trusted on the machine that measured it.

The eval decodes each prompt with the target alone and then with every draft, one right after the
other (interleaved), so a change in the machine's load meets both sides of a ratio. Then:

- the speed-up is measured again on each of :data:`CHUNKS` consecutive groups of prompts; the lowest
  and highest of those ratios are its spread;
- the machine's load average is sampled at every decode; its median, less the decoding processes of the
  eval itself, is the load from other work.

A ratio whose spread is wider than :data:`SPREAD_LIMIT`, or that was taken while other work kept more
than :data:`OTHER_LOAD_LIMIT_PER_CORE` of the cores busy, is marked so (``speedup_trust``) in
``results.json`` and in every table, instead of printed as a fact. Acceptance lengths do not move
with load and stay the headline.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHUNKS = 4
"""Groups of consecutive prompts the speed-up is measured on again, for its spread."""
SPREAD_LIMIT = 1.5
"""Highest group ratio over the lowest beyond which a speed-up is ``unsteady``."""
OTHER_LOAD_LIMIT_PER_CORE = 0.5
"""Load from other work, per core given to this process, beyond which a speed-up is ``under load``."""
STEADY = "steady"
UNSTEADY = "unsteady"
UNDER_LOAD = "under load"
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def cores_given() -> int:
    """The CPU cores this process may run on: its affinity mask, capped by a cgroup v2 CPU quota
    (a container's ``--cpus``) when one is set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


class LoadSamples:
    """The one-minute load average, sampled while something is timed."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def sample(self) -> None:
        """Record the load average now (nothing where the platform has none)."""
        with contextlib.suppress(OSError):
            self.values.append(os.getloadavg()[0])

    def median(self) -> float | None:
        """The median of the samples, or None without any."""
        return statistics.median(self.values) if self.values else None


def group_ratios(plain: Sequence[Any], drafted: Sequence[Any], chunks: int = CHUNKS) -> list[float]:
    """The speed-up as each of ``chunks`` groups of consecutive prompts timed it: the run's overall
    acceptance length (tokens per verify step) times the group's verify steps per second with the draft,
    over the group's tokens per second with the target alone. ``plain`` and ``drafted`` are the same
    prompts' generations in order (``output_ids``, ``seconds``, and ``steps`` for the drafted ones).

    Holding the acceptance length at the run's own keeps what the prompts say out of the spread (one group
    of easy prompts is not a faster machine): what is left is how the machine's speed moved."""
    count = min(len(plain), len(drafted))
    steps = sum(len(g.steps) for g in drafted[:count])
    if not count or not steps:
        return []
    accept = sum(len(g.output_ids) for g in drafted[:count]) / steps
    groups = min(chunks, count)
    ratios = []
    for index in range(groups):
        first, last = index * count // groups, (index + 1) * count // groups
        plain_s = sum(g.seconds for g in plain[first:last])
        draft_s = sum(g.seconds for g in drafted[first:last])
        plain_tokens = sum(len(g.output_ids) for g in plain[first:last])
        if plain_s > 0 and draft_s > 0 and plain_tokens:
            step_rate = sum(len(g.steps) for g in drafted[first:last]) / draft_s
            ratios.append(accept * step_rate / (plain_tokens / plain_s))
    return ratios


def speedup_trust(ratios: Sequence[float], load: float | None, busy_processes: int, cores: int) -> dict[str, Any]:
    """The spread, load and verdict of a speed-up measured as ``ratios`` (:func:`group_ratios`) while
    the load average was ``load`` and the eval kept ``busy_processes`` of the ``cores`` busy itself."""
    spread = [round(min(ratios), 4), round(max(ratios), 4)] if ratios else None
    other_load = None if load is None else max(0.0, load - busy_processes)
    if other_load is not None and other_load > OTHER_LOAD_LIMIT_PER_CORE * cores:
        verdict = UNDER_LOAD
    elif spread is not None and spread[0] > 0 and spread[1] / spread[0] > SPREAD_LIMIT:
        verdict = UNSTEADY
    else:
        verdict = STEADY
    return {
        "speedup_spread": spread,
        "speedup_trust": verdict,
        "load_average": None if load is None else round(load, 2),
        "other_load": None if other_load is None else round(other_load, 2),
        "cores": cores,
    }


def trust_note(figures: dict[str, Any]) -> str:
    """One line saying why a speed-up is not to be taken as a fact ('' when it is steady)."""
    verdict = figures.get("speedup_trust")
    spread = figures.get("speedup_spread")
    if verdict == UNDER_LOAD:
        return (
            f"taken under load (load average {figures['load_average']} on {figures['cores']} core(s), "
            f"{figures['other_load']} of it other work): the acceptance lengths stand, this speed-up does not"
        )
    if verdict == UNSTEADY and spread:
        return (
            f"unsteady (groups of prompts gave {spread[0]:.2f}x to {spread[1]:.2f}x): the machine's speed "
            "moved while it was timed; measure again on a quiet machine"
        )
    return ""


def marked(speedup: float | None, figures: dict[str, Any]) -> str:
    """A speed-up as a table prints it: ``2.10x``, with its spread, and ``?`` after one not to trust."""
    if speedup is None:
        return "-"
    spread = figures.get("speedup_spread")
    text = f"{speedup:.2f}x"
    if spread:
        text += f" ({spread[0]:.2f}-{spread[1]:.2f})"
    return text + ("" if figures.get("speedup_trust", STEADY) == STEADY else "?")
