"""Where trainer ranks get samples, and the shape check every sample passes before training on it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.shared.contracts import CapturedSample, SampleConsumer, field_problems, sample_num_tokens

if TYPE_CHECKING:
    from runtime.trainer.cached_source import CachedSourceSettings
    from runtime.transport.settings import TransportSettings


class SampleShapeError(ValueError):
    """A fetched sample does not match the capture contract the recipe describes."""


@dataclass(frozen=True)
class SourceSettings:
    """Where a trainer rank gets its samples (``trainer.sample_source`` and what it needs)."""

    kind: str
    """``trainer.sample_source``: mooncake or files."""
    sample_dir: Path | None
    """``trainer.sample_dir``, resolved (files); None: not set."""
    recipe_file: Path
    """The resolved recipe (named in refusals)."""
    global_batch_size: int
    idle_timeout_s: float
    """``transport.idle_timeout_s``."""
    transport: TransportSettings
    """The Mooncake data plane's settings (mooncake)."""
    feature_cache: CachedSourceSettings | None
    """The node-local feature cache in front of the data plane; None: ``trainer.feature_cache`` is off."""


def open_sample_source(settings: SourceSettings, rank: int, world_size: int) -> SampleConsumer:
    """The run's sample source: the Mooncake data plane (behind the node-local feature cache when
    ``trainer.feature_cache.enabled``), or a folder of sample files."""
    if settings.kind == "files":
        if settings.sample_dir is None:
            raise ValueError(
                f"{settings.recipe_file}: trainer.sample_source is 'files' but trainer.sample_dir is not set; "
                "fix: set trainer.sample_dir to the folder of {g:012d}.safetensors samples"
            )
        from runtime.trainer.file_source import FileSampleSource

        return FileSampleSource(
            settings.sample_dir,
            global_batch_size=settings.global_batch_size,
            idle_timeout_s=settings.idle_timeout_s,
        )
    from runtime.transport.dataplane import open_consumer

    consumer = open_consumer(settings.transport, rank, world_size)
    if settings.feature_cache is None:
        return consumer
    from runtime.trainer.cached_source import open_cached_source

    try:
        return open_cached_source(settings.feature_cache, consumer)
    except BaseException:
        consumer.close()
        raise


def check_sample(
    sample: CapturedSample,
    *,
    num_aux_layers: int,
    hidden_size: int,
    vocab_size: int,
    ids_range: tuple[int, int] | None = None,
) -> None:
    """Raise :class:`SampleShapeError` naming the sample and the field when its shapes break the
    contract (dtypes are the smoke gate's business: synthetic samples may carry other float types).
    ``ids_range``: the (min, max) token id when already read on the host (ids on a GPU are then not
    read again: that read would wait for all the compute queued before it)."""
    tokens = sample_num_tokens(sample)
    problems = field_problems(sample, num_aux_layers, hidden_size, check_dtypes=False)
    if problems:
        raise SampleShapeError(
            f"{problems[0]} (T={tokens}, capture.aux_layer_ids has {num_aux_layers} layers, capture.hidden_size "
            f"{hidden_size}); the capture and trainer recipes disagree"
        )
    if tokens < 2:
        raise SampleShapeError(f"sample g={sample.g}: has {tokens} tokens; a sample needs at least 2")
    if not sample.ids.numel():
        return
    low, high = ids_range if ids_range is not None else (int(sample.ids.min()), int(sample.ids.max()))
    if low < 0 or high >= vocab_size:
        raise SampleShapeError(
            f"sample g={sample.g}: token ids range {low}..{high} leaves the vocabulary 0..{vocab_size - 1} "
            "(capture.vocab_size)"
        )
