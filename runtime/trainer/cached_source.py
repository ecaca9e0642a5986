"""The trainer's sample source with ``trainer.feature_cache``: epoch 0 from the store, later epochs
from the node-local cache, and the producer asked for whatever the cache lacks.

The protocol with the producer is reconciliation, like the rest of the data plane
(runtime/transport/README.md): the producer captures every g of epoch 0, and a g of a later epoch only while a
``want`` key for it exists. Each rank, whenever the cursor moves (start, resume, every committed
step), looks ``trainer.feature_cache.lookahead_steps`` steps ahead at the g it will read, and asks
for those whose row has no cache entry; a cache entry that fails verification when read is removed
and asked for at once (that one sample waits for a capture). A requeue onto a node with an empty
cache therefore just asks for everything again; nothing is trained on that was not verified.

Every sample read from the store (epoch 0, or an asked-for one) is written to the cache, so a row
is captured once per node and cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runtime.recipe.units import format_bytes
from runtime.shared.contracts import CapturedSample
from runtime.shared.prompt_order import PromptOrder
from runtime.trainer.feature_cache import CacheFolder, FeatureCache, cache_root
from runtime.transport.consumer import Consumer

log = logging.getLogger("dspark.trainer.cached_source")


@dataclass(frozen=True)
class CachedSourceSettings:
    """The feature cache of a trainer rank (``trainer.feature_cache``) and the prompt order it follows."""

    folder: CacheFolder
    features_digest: str
    """:func:`~runtime.trainer.feature_cache.features_digest` of the run's target and data."""
    largest_sample_bytes: int
    """One entry at ``data.max_length`` tokens: what the disk must hold per row still to cache."""
    num_rows: int
    """Prompt rows N of the data file."""
    prompt_seed: int
    epochs: int
    max_samples: int | None
    """``trainer.max_steps`` x G; None: every epoch."""
    lookahead_steps: int
    """``trainer.feature_cache.lookahead_steps``."""


class CachedSource:
    """``SampleConsumer`` over the Mooncake consumer and the node-local feature cache."""

    def __init__(self, inner: Consumer, cache: FeatureCache, order: PromptOrder, lookahead_steps: int) -> None:
        self.inner = inner
        self.cache = cache
        self.order = order
        self.lookahead_steps = lookahead_steps
        self.global_batch_size = inner.global_batch_size

    def fetch(self, g: int, device: torch.device | str | None = None) -> CapturedSample:
        """Sample ``g``: from the cache when its epoch is not the first and the entry verifies,
        otherwise from the store (asking the producer for it first when it is a later epoch's)."""
        slot = self.order.locate(g)
        if slot.epoch > 0:
            sample = self.cache.load(slot.row_index, g, slot.epoch, device)
            if sample is not None:
                return sample
            self.inner.ask_for([g])
        # Straight onto the device, verified there as without the cache (a host-side fetch would
        # verify the sum16 fields on the CPU: 0.15 GB/s on the development machine, ~40 s per K3 sample).
        sample = self.inner.fetch(g, device)
        row = sample.meta.get("row_index")
        if row is not None and int(row) != slot.row_index:
            raise RuntimeError(
                f"sample g={g} in the store is of data row {row}, the prompt order says row {slot.row_index}: the "
                "capture and trainer disagree on the data file or trainer.prompt_seed"
            )
        self.cache.store(slot.row_index, sample)
        return sample

    @property
    def stopping(self) -> Callable[[], bool]:
        """The consumer's stop check (:attr:`Consumer.stopping`)."""
        return self.inner.stopping

    @stopping.setter
    def stopping(self, check: Callable[[], bool]) -> None:
        self.inner.stopping = check

    def commit_step(self, step: int) -> None:
        """Commit as the consumer does, then ask for what the next steps' cache lacks."""
        self.inner.commit_step(step)
        self._ask_ahead(step + 1)

    def publish_cursor(self, cursor: int) -> None:
        """Publish as the consumer does (rank 0), then ask for what the first steps' cache lacks."""
        self.inner.publish_cursor(cursor)
        self._ask_ahead(cursor // self.global_batch_size)

    def _ask_ahead(self, first_step: int) -> None:
        wanted: list[int] = []
        for step in range(first_step, first_step + self.lookahead_steps):
            for g in self.inner.samples_of_step(step):
                if g >= self.order.total_samples:
                    continue
                slot = self.order.locate(g)
                if slot.epoch > 0 and not self.cache.has(slot.row_index):
                    wanted.append(g)
        if wanted:
            self.inner.ask_for(wanted)

    def stats(self) -> dict[str, Any]:
        """The consumer's totals plus the cache's counters."""
        return {**self.inner.stats(), **self.cache.stats()}

    def close(self) -> None:
        """Close the consumer (the cache keeps its files: they serve the next run or a requeue)."""
        c = self.cache
        log.info(
            "rank %d feature cache: %d hits, %d misses, %d corrupt entries removed; %s read, %s written (%s)",
            self.inner.rank,
            c.hits,
            c.misses,
            c.corrupt,
            format_bytes(c.bytes_read),
            format_bytes(c.bytes_written),
            c.folder,
        )
        c.close()
        self.inner.close()


def open_cached_source(settings: CachedSourceSettings, inner: Consumer) -> CachedSource:
    """The cached source of one trainer rank: checks the cache folder's space before anything trains."""
    order = PromptOrder(settings.num_rows, settings.prompt_seed, settings.epochs, settings.max_samples)
    cache = FeatureCache(cache_root(settings.folder), settings.features_digest)
    cache.open(settings.num_rows, settings.largest_sample_bytes)
    return CachedSource(inner, cache, order, settings.lookahead_steps)
