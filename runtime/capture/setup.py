"""The capture component's door: the resolved recipe read once, each part handed its own settings.

:func:`capture_setup` is the one place the capture process reads the recipe (the SGLang server's
sink reads it in its own process through :func:`sink_setup`). It builds the transport's settings
once (:meth:`~runtime.transport.settings.TransportSettings.from_recipe`: segment shares, eviction
ratio, ports), the capture share of this task, the data and prompt order, the engine's settings,
the smoke gate's switch and the master's ownership; :func:`runtime.capture.producer.run_capture`
and everything below it take these frozen parts, never the recipe. :func:`sglang_server_settings`
is the SGLang server's (the capture's engine, and the evaluation's SGLang route);
:func:`expert_streaming_plan` is the server's expert streaming, read in the server's processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.capture.embedded_settings import EmbeddedPlan, EmbeddedSettings, StreamedExperts
from runtime.capture.sglang_settings import ExpertStreamingPlan, ExpertStreamingSetupError, SGLangServerSettings
from runtime.recipe.capture_layout import nodes_per_engine
from runtime.recipe.fit.expert_streaming import target_streaming_split
from runtime.recipe.loader import ResolvedRecipe, load_resolved
from runtime.recipe.streaming_budget import split_layers
from runtime.transport.dataplane import capture_share_of_this_task
from runtime.transport.settings import TransportSettings


@dataclass(frozen=True)
class DataSetup:
    """The training data file and the prompt order over it (``data`` and the trainer's run shape)."""

    train_path: Path
    """``data.train_path``, resolved."""
    train_path_text: str
    """``data.train_path`` as the recipe writes it (for messages)."""
    expected_sha256: str | None
    num_rows: int | None
    """``data.num_rows``: the rows the file must have; None: not checked."""
    recipe_file: Path
    """The resolved recipe file (named in refusals)."""
    max_length_tokens: int
    vocab_size: int
    prompt_seed: int
    epochs: int
    max_samples: int | None
    """``trainer.max_steps`` x G; None: every epoch."""


@dataclass(frozen=True)
class EngineSetup:
    """Which capture engine runs, and its settings."""

    kind: str
    """``capture.engine``: embedded or sglang."""
    batch_size: int
    """``capture.batch_size``: samples per capture call unless the engine says more."""
    inject_nan_at_g: int | None
    """The smoke self-test's poisoned sample (embedded engine only)."""
    embedded: EmbeddedPlan | None
    """The embedded engine's settings (devices picked when it starts); None for sglang."""
    sglang: SGLangServerSettings | None
    """The SGLang engine's server settings; None for embedded."""


@dataclass(frozen=True)
class CaptureSetup:
    """Everything the capture component takes from the recipe, built once by :func:`capture_setup`."""

    job_dir: Path
    transport: TransportSettings
    share: tuple[int, int]
    """(index, count) of this task's capture share."""
    gate_enabled: bool
    """A smoke run, and the first share: this task records the capture stages of the gate."""
    owns_master: bool
    """This task starts the Mooncake master (``capture.owns_master`` on the first share)."""
    global_batch_size: int
    """G: samples of one trainer step (the master watch names the step)."""
    data: DataSetup
    engine: EngineSetup
    progress_interval_s: float
    rows_captured_once: bool
    """The trainer caches features: the capture's work ends with epoch 0."""


def data_setup(resolved: ResolvedRecipe) -> DataSetup:
    """The data file and prompt order of the resolved recipe."""
    recipe = resolved.recipe
    t = recipe.trainer
    return DataSetup(
        train_path=resolved.resolve_path(recipe.data.train_path),
        train_path_text=str(recipe.data.train_path),
        expected_sha256=recipe.data.expected_sha256,
        num_rows=recipe.data.num_rows,
        recipe_file=resolved.path,
        max_length_tokens=recipe.data.max_length,
        vocab_size=recipe.capture.vocab_size,
        prompt_seed=t.effective_prompt_seed,
        epochs=t.epochs,
        max_samples=t.max_steps * t.global_batch_size if t.max_steps is not None else None,
    )


def embedded_plan(resolved: ResolvedRecipe) -> EmbeddedPlan:
    """The embedded engine's settings of the resolved recipe's ``capture`` section."""
    recipe = resolved.recipe
    c = recipe.capture
    streaming = c.expert_streaming
    base = EmbeddedSettings(
        target_path=resolved.resolve_path(c.target_path),
        aux_layer_ids=tuple(c.aux_layer_ids),
        hidden_size=c.hidden_size,
        pad_id=c.special_tokens.pad_id,
        compute_dtype=c.compute_dtype,
        devices=(),
        batch_size=c.batch_size,
        target_revision=c.target_revision,
        expert_parallel=c.expert_parallel,
        moe_exchange=c.moe_exchange,
        # bf16 hs + lhs of the recipe's longest sample, plus the small fields
        staging_slot_bytes=recipe.data.max_length * (len(c.aux_layer_ids) + 1) * c.hidden_size * 2 + 2 * 64,
        expert_streaming=StreamedExperts(
            gpu_budget_bytes=streaming.gpu_budget_bytes,
            resident_fraction=streaming.resident_fraction,
            prefetch_layers=streaming.prefetch_layers,
            pinned=streaming.pinned,
        )
        if streaming.enabled
        else None,
    )
    return EmbeddedPlan(
        base=base,
        device=c.device,
        engines_per_node=c.engines_per_node,
        commit_staging_slots=c.commit_staging_slots,
    )


def embedded_settings(resolved: ResolvedRecipe) -> EmbeddedSettings:
    """The embedded engine's settings with its devices picked (tests and tools)."""
    return embedded_plan(resolved).settings()


SGLANG_SERVER_LOG = Path("capture") / "sglang_server.log"
"""The capture server's log, in the job folder."""


def sglang_server_settings(resolved: ResolvedRecipe) -> SGLangServerSettings:
    """The SGLang server of the resolved recipe's ``capture.sglang`` (paths resolved)."""
    recipe = resolved.recipe
    c = recipe.capture
    s = c.sglang
    return SGLangServerSettings(
        sglang=s,
        target_path=resolved.resolve_path(c.target_path),
        python=str(resolved.resolve_path(s.python)) if s.python else None,
        library_dirs=tuple(resolved.resolve_path(d) for d in s.library_dirs),
        recipe_file=resolved.path,
        server_log_path=resolved.job_dir / SGLANG_SERVER_LOG,
        nodes_per_engine=nodes_per_engine(recipe),
        aux_layer_ids=tuple(c.aux_layer_ids),
        hidden_size=c.hidden_size,
        store_id=recipe.store_id,
    )


def capture_setup(resolved: ResolvedRecipe) -> CaptureSetup:
    """The capture component's settings from the resolved recipe (and the task's rank, for its share)."""
    recipe = resolved.recipe
    c = recipe.capture
    transport = TransportSettings.from_recipe(recipe)
    share = capture_share_of_this_task(transport)
    return CaptureSetup(
        job_dir=resolved.job_dir,
        transport=transport,
        share=share,
        gate_enabled=resolved.smoke and share[0] == 0,  # one gate file per job
        owns_master=c.owns_master and share[0] == 0,  # the first capture node hosts the master
        global_batch_size=recipe.trainer.global_batch_size,
        data=data_setup(resolved),
        engine=EngineSetup(
            kind=c.engine,
            batch_size=c.batch_size,
            inject_nan_at_g=c.inject_nan_at_g,
            embedded=embedded_plan(resolved) if c.engine == "embedded" else None,
            sglang=sglang_server_settings(resolved) if c.engine == "sglang" else None,
        ),
        progress_interval_s=c.progress_interval_s,
        rows_captured_once=recipe.trainer.feature_cache.enabled,
    )


@dataclass(frozen=True)
class SinkSetup:
    """What the SGLang server's capture sink takes from the resolved recipe."""

    job_dir: Path
    transport: TransportSettings
    store_id: str
    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    target_revision: str | None
    commit_staging_slots: int
    """Samples the commit rank stages at once (one replica: the server)."""


def sink_setup(recipe_path: str | Path) -> SinkSetup:
    """The sink's settings from the resolved recipe the server was started with
    (``--dspark-capture-recipe``): read once in the server's process."""
    resolved = load_resolved(recipe_path)
    recipe = resolved.recipe
    return SinkSetup(
        job_dir=resolved.job_dir,
        transport=TransportSettings.from_recipe(recipe),
        store_id=recipe.store_id,
        aux_layer_ids=tuple(recipe.capture.aux_layer_ids),
        hidden_size=recipe.capture.hidden_size,
        target_revision=recipe.capture.target_revision,
        commit_staging_slots=recipe.capture.effective_commit_staging_slots(1),
    )


def expert_streaming_plan(recipe_path: str | Path) -> ExpertStreamingPlan | None:
    """The SGLang server's expert streaming from the resolved recipe it was started with
    (``--dspark-capture-recipe``), read once in the server's process: the per-GPU split of the MoE
    layers and whether its layer bytes are known; None when streaming is off. With
    ``resident_fraction`` the sizes may be unknown (tests)."""
    resolved = load_resolved(recipe_path)
    recipe = resolved.recipe
    streaming = recipe.capture.expert_streaming
    if not streaming.enabled:
        return None
    split = target_streaming_split(recipe)
    known = split is not None
    if split is None:
        if streaming.resident_fraction is None:
            raise ExpertStreamingSetupError(
                f"{resolved.path}: capture.expert_streaming.gpu_budget_bytes needs the expert sizes to split the "
                "layers; fix: set capture.routed_expert_weight_bytes (and capture.num_moe_layers), or use "
                "capture.expert_streaming.resident_fraction"
            )
        layers = recipe.capture.num_moe_layers or recipe.capture.num_target_layers
        split = split_layers(
            layers, 1, prefetch_layers=streaming.prefetch_layers, resident_fraction=streaming.resident_fraction
        )
    return ExpertStreamingPlan(
        recipe_file=resolved.path,
        split=split,
        layer_bytes_known=known,
        gpu_budget_bytes=streaming.gpu_budget_bytes,
        pinned=streaming.pinned,
    )
