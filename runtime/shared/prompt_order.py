"""The prompt order: which data row global sample ``g`` is.

Epoch ``e`` visits the rows in the order of a permutation drawn from its own generator,
``numpy.random.Generator(PCG64(prompt_seed + e)).permutation(N)``, and ``g = e * N + position``.
Nothing else draws from that generator, so the order depends on ``prompt_seed`` and the row count
only: it is the same in every process and run, unchanged by ``trainer.seed``, and any ``g`` can be
located directly (a restarted producer resumes mid-epoch without replaying anything).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class PromptSlot:
    """Where sample ``g`` comes from."""

    g: int
    epoch: int
    position: int
    """Position within the epoch's permutation."""
    row_index: int
    """Row of the data file."""


@lru_cache(maxsize=4)
def epoch_permutation(num_rows: int, prompt_seed: int, epoch: int) -> np.ndarray:
    """The row order of one epoch (read-only array of row indices)."""
    if num_rows < 1:
        raise ValueError(f"the data file has {num_rows} rows; the prompt order needs at least one")
    if prompt_seed + epoch < 0:
        raise ValueError(f"prompt_seed + epoch = {prompt_seed + epoch} is negative; PCG64 needs a seed >= 0")
    order = np.random.Generator(np.random.PCG64(prompt_seed + epoch)).permutation(num_rows)
    order.setflags(write=False)
    return order


class PromptOrder:
    """The sample sequence ``g -> (epoch, position, row)`` of one run."""

    def __init__(self, num_rows: int, prompt_seed: int, epochs: int, max_samples: int | None = None) -> None:
        """``epochs`` passes over ``num_rows`` rows; ``max_samples`` caps the run (e.g. ``max_steps x G``)."""
        if epochs < 1:
            raise ValueError(f"epochs is {epochs}; a run needs at least one")
        self.num_rows = num_rows
        self.prompt_seed = prompt_seed
        self.epochs = epochs
        full = num_rows * epochs
        self.total_samples = full if max_samples is None else min(full, max_samples)
        """One past the last ``g`` of the run."""

    def locate(self, g: int) -> PromptSlot:
        """Epoch, position and data row of sample ``g``."""
        if not 0 <= g < self.total_samples:
            raise IndexError(f"sample g={g} is outside this run's 0..{self.total_samples - 1}")
        epoch, position = divmod(g, self.num_rows)
        row = int(epoch_permutation(self.num_rows, self.prompt_seed, epoch)[position])
        return PromptSlot(g=g, epoch=epoch, position=position, row_index=row)

    def iter_from(self, g: int = 0) -> Iterator[PromptSlot]:
        """Every slot from ``g`` to the end of the run, in order (resume point of a producer)."""
        for index in range(max(g, 0), self.total_samples):
            yield self.locate(index)
