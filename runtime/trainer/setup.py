"""The trainer component's door: the resolved recipe read once, each part handed its own settings.

:func:`trainer_setup` is the one place a trainer rank reads the recipe and the launcher's
environment contract (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``DSPARK_BIND_ADDRESS``, ``DSPARK_JOB_DIR``). It derives the run settings (:func:`derive_settings`),
builds the draft's spec (:meth:`~runtime.trainer.draft_spec.DraftSpec.from_recipe`) and the
transport's settings (:meth:`~runtime.transport.settings.TransportSettings.from_recipe`) once, and
the sample source's, the feature cache's, the smoke gate's and the frozen vocabulary's settings;
:class:`runtime.trainer.loop.Trainer` and everything below it take these frozen parts (or their own
leaf section of the recipe), never the recipe.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.recipe.fit.store_budget import largest_sample
from runtime.recipe.fit.throughput import draft_train_flops_per_sample
from runtime.recipe.loader import ResolvedRecipe
from runtime.recipe.schema import (
    CheckpointConfig,
    LossConfig,
    MetricsConfig,
    OptimizerConfig,
    Recipe,
    ScheduleConfig,
)
from runtime.shared.contracts import ENV_BIND_ADDRESS, ENV_JOB_DIR
from runtime.shared.data_files import resolve_expected_sha256
from runtime.trainer.cached_source import CachedSourceSettings
from runtime.trainer.draft_spec import DraftSpec
from runtime.trainer.feature_cache import CacheFolder, FeatureSource, features_digest
from runtime.trainer.frozen_vocab import FrozenVocabSource
from runtime.trainer.gate import GateSettings
from runtime.trainer.settings import RunSettings, TrainerSetupError
from runtime.trainer.sources import SourceSettings
from runtime.transport.settings import TransportSettings

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class BatchShape:
    """How a global batch splits (``trainer``'s batch fields)."""

    global_batch_size: int
    """G: samples of one optimizer step."""
    micro_batch_size: int
    """Samples of one micro-step on one rank."""
    gradient_accumulation_steps: int
    """Micro-steps of one optimizer step."""


@dataclass(frozen=True)
class TrainerSetup:
    """Everything the trainer component takes from the recipe, built once by :func:`trainer_setup`."""

    run: RunSettings
    draft_spec: DraftSpec
    source: SourceSettings
    """The sample source (it holds the transport's settings)."""
    gate: GateSettings
    frozen_vocab: FrozenVocabSource
    batch: BatchShape
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    loss: LossConfig
    checkpoint: CheckpointConfig
    metrics: MetricsConfig
    job_name: str
    """``job.name`` (the metrics' run name)."""
    recipe_digest: str
    """The resolved recipe's digest (recorded in checkpoints: a restart of the same job resumes)."""
    seed: int
    """``trainer.seed``: the model's initialisation and the anchors' sampling."""
    prompt_seed: int
    """The prompt order's seed (``trainer.prompt_seed``, default ``trainer.seed``)."""
    log_every_steps: int
    max_consecutive_skips: int
    idle_timeout_s: float
    """``transport.idle_timeout_s``: how long collectives and silent peers are waited for."""
    train_flops_per_token: float = 0.0
    """The plan's training FLOPs of a sample at ``data.max_length``, per token of it: the trainer's
    model FLOP/s estimate (its MFU line) is this times the tokens it trains per second."""
    peak_flops_per_rank: float = 0.0
    """``plan.accelerator_peak_tflops`` in FLOP/s: what one rank's MFU is measured against."""


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise TrainerSetupError(
                f"environment variable {name} is not set; the launcher sets RANK, LOCAL_RANK, WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT for every trainer rank (python3 -m launcher ...)"
            )
        return default
    try:
        return int(value)
    except ValueError:
        raise TrainerSetupError(f"environment variable {name}={value!r} is not an integer") from None


def _count_rows(path: Path) -> int:
    with open(path, "rb") as handle:
        return sum(1 for _ in handle)


def derive_settings(resolved: ResolvedRecipe, env: Mapping[str, str] | None = None) -> RunSettings:
    """Check the environment against the recipe and derive the run settings."""
    env = os.environ if env is None else env
    recipe = resolved.recipe
    trainer = recipe.trainer
    source = str(resolved.path)
    world_size = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK", 0)
    local_rank = _env_int(env, "LOCAL_RANK", rank)
    if world_size != recipe.trainer_world_size:
        raise TrainerSetupError(
            f"{source}: WORLD_SIZE is {world_size}, but the recipe's trainer has {recipe.trainer_world_size} "
            f"ranks (job.trainer.nodes {recipe.job.trainer.nodes} x job.trainer.tasks_per_node "
            f"{recipe.job.trainer.tasks_per_node}); fix: start one trainer process per rank of the recipe"
        )

    wants = trainer.device
    if wants == "auto":
        wants = "cuda" if torch.cuda.is_available() else "cpu"
    if wants == "cuda":
        if not torch.cuda.is_available():
            raise TrainerSetupError(
                f"{source}: trainer.device is 'cuda' but this process sees no CUDA device; fix: run on a GPU "
                "node or set trainer.device: cpu"
            )
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    backend = trainer.attention_backend
    if backend == "auto":
        backend = "flex" if device.type == "cuda" else "sdpa"
    if backend == "flex" and device.type != "cuda":
        raise TrainerSetupError(
            f"{source}: trainer.attention_backend is 'flex' on a CPU trainer; flex_attention has no CPU backward; "
            "fix: set trainer.attention_backend: sdpa (or auto)"
        )

    if recipe.data.num_rows is not None:
        num_rows = recipe.data.num_rows
    else:
        train_path = resolved.resolve_path(recipe.data.train_path)
        if not train_path.is_file():
            raise TrainerSetupError(
                f"{source}: data.num_rows is not set and data.train_path {train_path} is not readable here; "
                "fix: set data.num_rows"
            )
        num_rows = _count_rows(train_path)
    samples = trainer.epochs * num_rows
    steps_in_data = samples // trainer.global_batch_size
    if steps_in_data < 1:
        raise TrainerSetupError(
            f"{source}: trainer.epochs {trainer.epochs} x data rows {num_rows} = {samples} samples, fewer than "
            f"one global batch (trainer.global_batch_size {trainer.global_batch_size}); fix: more epochs or rows"
        )
    total_steps = min(trainer.max_steps, steps_in_data) if trainer.max_steps else steps_in_data

    job_dir = Path(env.get(ENV_JOB_DIR) or resolved.job_dir)
    checkpoint_dir = resolved.checkpoint_dir(job_dir)
    data_digest = resolve_expected_sha256(resolved.resolve_path(recipe.data.train_path), recipe.data.expected_sha256)
    return RunSettings(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        device=device,
        param_dtype=_DTYPES[trainer.param_dtype],
        reduce_dtype=_DTYPES[trainer.reduce_dtype],
        attention_backend=backend,
        num_rows=num_rows,
        total_steps=total_steps,
        chunk_rows=trainer.loss.objective_chunk_blocks * trainer.draft.block_size,
        job_dir=job_dir,
        checkpoint_dir=checkpoint_dir,
        data_digest=data_digest,
        smoke=resolved.smoke,
        compile_regions=trainer.compile_regions == "on"
        or (trainer.compile_regions == "auto" and device.type == "cuda"),
        master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
        master_port=_env_int(env, "MASTER_PORT", recipe.job.master_port),
        bind_address=env.get(ENV_BIND_ADDRESS) or "127.0.0.1",
    )


def feature_source(recipe: Recipe) -> FeatureSource:
    """What determines the recipe's captured features (the feature cache's key, with the data digest)."""
    capture = recipe.capture
    return FeatureSource(
        engine=capture.engine,
        target_path=capture.target_path,
        target_revision=capture.target_revision,
        num_target_layers=capture.num_target_layers,
        hidden_size=capture.hidden_size,
        vocab_size=capture.vocab_size,
        aux_layer_ids=tuple(capture.aux_layer_ids),
        compute_dtype=capture.compute_dtype,
        max_length_tokens=recipe.data.max_length,
    )


def _cache_folder(resolved: ResolvedRecipe) -> CacheFolder:
    configured = resolved.recipe.trainer.feature_cache.dir
    expanded = os.path.expandvars(configured) if configured else None
    return CacheFolder(
        configured=configured,
        expanded=expanded,
        path=resolved.resolve_path(expanded) if expanded is not None and "$" not in expanded else None,
        recipe_file=resolved.path,
    )


def _cached_source_settings(resolved: ResolvedRecipe, run: RunSettings) -> CachedSourceSettings | None:
    recipe = resolved.recipe
    t = recipe.trainer
    if not t.feature_cache.enabled:
        return None
    return CachedSourceSettings(
        folder=_cache_folder(resolved),
        features_digest=features_digest(feature_source(recipe), run.data_digest),
        largest_sample_bytes=largest_sample(recipe).total_bytes,
        num_rows=run.num_rows,
        prompt_seed=t.effective_prompt_seed,
        epochs=t.epochs,
        max_samples=t.max_steps * t.global_batch_size if t.max_steps is not None else None,
        lookahead_steps=t.feature_cache.lookahead_steps,
    )


def _source_settings(resolved: ResolvedRecipe, run: RunSettings) -> SourceSettings:
    recipe = resolved.recipe
    t = recipe.trainer
    return SourceSettings(
        kind=t.sample_source,
        sample_dir=resolved.resolve_path(t.sample_dir) if t.sample_dir else None,
        recipe_file=resolved.path,
        global_batch_size=t.global_batch_size,
        idle_timeout_s=recipe.transport.idle_timeout_s,
        transport=TransportSettings.from_recipe(recipe),
        feature_cache=_cached_source_settings(resolved, run) if t.sample_source == "mooncake" else None,
    )


def setup_for_run(resolved: ResolvedRecipe, run: RunSettings) -> TrainerSetup:
    """The trainer's settings for run settings already derived (:func:`trainer_setup` derives them
    from the environment; a benchmark without a job folder brings its own)."""
    recipe = resolved.recipe
    t = recipe.trainer
    capture = recipe.capture
    return TrainerSetup(
        run=run,
        draft_spec=DraftSpec.from_recipe(recipe),
        source=_source_settings(resolved, run),
        gate=GateSettings(
            enabled=run.smoke,
            job_dir=run.job_dir,
            checks_captured_samples=t.sample_source == "mooncake",
            aux_layer_ids=tuple(capture.aux_layer_ids),
            hidden_size=capture.hidden_size,
            max_length_tokens=recipe.data.max_length,
        ),
        frozen_vocab=FrozenVocabSource(
            target_dir=resolved.resolve_path(capture.target_path),
            embed_tensor_name=t.embed_tensor_name,
            lm_head_tensor_name=t.lm_head_tensor_name,
        ),
        batch=BatchShape(
            global_batch_size=t.global_batch_size,
            micro_batch_size=t.micro_batch_size,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
        ),
        optimizer=t.optimizer,
        schedule=t.schedule,
        loss=t.loss,
        checkpoint=t.checkpoint,
        metrics=t.metrics,
        job_name=recipe.job.name,
        recipe_digest=resolved.digest,
        seed=t.seed,
        prompt_seed=t.effective_prompt_seed,
        log_every_steps=t.log_every_steps,
        max_consecutive_skips=t.max_consecutive_skips,
        idle_timeout_s=recipe.transport.idle_timeout_s,
        train_flops_per_token=draft_train_flops_per_sample(recipe) / recipe.data.max_length,
        peak_flops_per_rank=recipe.plan.accelerator_peak_tflops * 1e12,
    )


def trainer_setup(resolved: ResolvedRecipe, env: Mapping[str, str] | None = None) -> TrainerSetup:
    """The trainer component's settings from the resolved recipe and the launcher's environment
    (``env``, default this process's); :class:`TrainerSetupError` when they cannot start a trainer."""
    return setup_for_run(resolved, derive_settings(resolved, env))
