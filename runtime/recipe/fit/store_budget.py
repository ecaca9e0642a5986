"""What the Mooncake store must hold: the largest sample, one global step of them, and the samples
still landing after the producer pauses at the high watermark."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.recipe.schema import Recipe
from runtime.recipe.sizes import SampleSize


def largest_sample(recipe: Recipe) -> SampleSize:
    """Size of a sample at ``data.max_length`` tokens: the largest one the run can produce."""
    return SampleSize(recipe.data.max_length, recipe.num_aux_layers, recipe.capture.hidden_size)


def max_samples_in_flight(recipe: Recipe) -> int:
    """Samples the capture component may have claimed but not committed at once: one batch per
    embedded engine, or SGLang's concurrent requests."""
    c = recipe.capture
    if c.engine == "sglang":
        return c.sglang.max_running_requests
    engines = c.engines_per_node or max(1, recipe.job.capture.gpus_per_node)
    return c.batch_size * engines * recipe.job.capture.nodes


def commit_staging_slots(recipe: Recipe) -> int:
    """Pinned staging slots of the capture side's commit pipeline (0: no pipeline). SGLang: one
    sink per server; embedded: one pipeline per replica, one batch each."""
    cap = recipe.capture
    units = max(1, recipe.job.capture.gpus_per_node * recipe.job.capture.nodes)
    return cap.effective_commit_staging_slots(1 if cap.engine == "sglang" else units)


@dataclass(frozen=True)
class StoreBudget:
    """The store's bytes at ``data.max_length`` against the recipe's watermarks."""

    sample: SampleSize
    """The largest sample."""
    step_bytes: int
    """One global step (``trainer.global_batch_size``) of the largest samples."""
    in_flight_samples: int
    """Samples that may still land after the producer pauses (:func:`max_samples_in_flight`)."""
    high_watermark_bytes: int

    @property
    def in_flight_bytes(self) -> int:
        """Bytes of the samples in flight at a pause."""
        return self.in_flight_samples * self.sample.total_bytes

    @property
    def paused_peak_bytes(self) -> int:
        """What the store can hold at a pause: the high watermark plus the samples in flight."""
        return self.high_watermark_bytes + self.in_flight_bytes

    @property
    def step_margin_bytes(self) -> int:
        """Room between one step of the largest samples and the high watermark (negative: short)."""
        return self.high_watermark_bytes - self.step_bytes


def store_budget(recipe: Recipe) -> StoreBudget:
    """The store budget of ``recipe``."""
    sample = largest_sample(recipe)
    return StoreBudget(
        sample=sample,
        step_bytes=recipe.trainer.global_batch_size * sample.total_bytes,
        in_flight_samples=max_samples_in_flight(recipe),
        high_watermark_bytes=recipe.transport.high_watermark_bytes,
    )
