"""The throughput model: capture, commit, transfer and train seconds per sample at
``data.max_length``, the bottleneck and the trainer's expected idle fraction, and the run time (with
the trainer's node-local feature cache: epoch 0 captured, later epochs read from its disk)."""

from __future__ import annotations

from runtime.recipe.capture_layout import capture_shares
from runtime.recipe.fit.expert_streaming import streamed_pcie_seconds
from runtime.recipe.fit.prefill import PrefillSplit, prefill_split
from runtime.recipe.fit.report import Finding, FitReport
from runtime.recipe.fit.store_budget import commit_staging_slots, largest_sample
from runtime.recipe.fit.trainer_memory import draft_parameter_counts, layer_shapes
from runtime.recipe.schema import Recipe
from runtime.recipe.sizes import SampleSize
from runtime.recipe.units import format_bytes

TRAINER_IDLE_WARN_FRACTION = 0.5
"""Above this expected idle fraction the plan warns (and names the fix when capture is the bottleneck)."""


def draft_train_flops_per_sample(recipe: Recipe) -> float:
    """Training FLOPs of one sample at ``data.max_length`` (forward x3 for trained parts; the
    frozen lm_head costs a forward for the teacher and forward + input-gradient for the draft)."""
    d = recipe.trainer.draft
    t = recipe.data.max_length
    slots = recipe.trainer.loss.num_anchors * d.block_size
    h, v = d.hidden_size, recipe.capture.vocab_size
    counts = draft_parameter_counts(d, recipe.num_aux_layers, v)
    shapes = layer_shapes(d)
    fc = 2.0 * t * recipe.num_aux_layers * h * h
    context_kv = 2.0 * t * sum(shape.context_params for shape in shapes)
    slot_layers = 2.0 * slots * counts["decoder_layers"]
    mean_context = t / 2 + d.block_size
    attention = sum(
        2.0 * slots * shape.heads * (shape.score_dim + shape.value_dim) * mean_context
        if shape.attends_context
        else 1.0 * slots * shape.recurrent_flops_per_slot
        for shape in shapes
    )
    markov = 2.0 * slots * d.markov_rank * v
    lm_head = 2.0 * slots * h * v
    trained = fc + context_kv + slot_layers + attention + markov
    return 3 * trained + 2 * lm_head + lm_head  # draft logits fwd + input grad, teacher logits fwd


def throughput_model(recipe: Recipe) -> FitReport:
    """The plan's throughput section: seconds per sample of each stage, the bottleneck, the run time."""
    report = FitReport("throughput model")
    sample = largest_sample(recipe)
    stages = _stage_seconds(recipe, report, sample)
    bottleneck = max(stages, key=lambda k: stages[k])
    slowest = stages[bottleneck]
    idle = 1.0 - stages["train"] / slowest
    report.rows.append(("bottleneck", f"{bottleneck} ({slowest:.3f} s/sample, {1 / slowest:.3f} samples/s)"))
    cached = recipe.trainer.feature_cache.enabled and "capture" in stages and bool(recipe.data.num_rows)
    how = f"1 - train s/sample / {bottleneck} s/sample: the trainer waits on the bottleneck"
    if recipe.data.num_rows:
        idle = _run_time(recipe, report, stages, sample, cached, idle)
        samples = run_steps(recipe) * recipe.trainer.global_batch_size
        how = (
            f"1 - training time / run time: {samples} samples x {stages['train']:.3f} s of "
            f"{report.numbers['run_seconds'] / 3600:.2f} h"
        )
    # The one trainer-idle figure of the plan: the share of the run's wall time the trainer does not compute.
    report.rows.append(("trainer idle", f"{idle:.0%} of the run ({how})"))
    report.numbers.update({f"{k}_s_per_sample": v for k, v in stages.items()})
    report.numbers.update(trainer_idle_fraction=idle)
    report.findings.append(_bottleneck_finding(recipe, bottleneck, idle, cached))
    return report


def _stage_seconds(recipe: Recipe, report: FitReport, sample: SampleSize) -> dict[str, float]:
    """Seconds per sample of capture (with its commit; only when the recipe states the target's
    active parameters), transfer and train, each with its row."""
    hw = recipe.plan
    stages: dict[str, float] = {}
    capture_units = max(1, recipe.job.capture.gpus_per_node * recipe.job.capture.nodes)
    if recipe.capture.target_active_params:
        split = prefill_split(recipe, capture_units)
        # Each engine copies its own streamed experts; the engines capture different samples at once.
        pcie_s = streamed_pcie_seconds(recipe) / capture_shares(recipe)
        stages["capture"] = max(split.seconds, pcie_s)
        report.rows.append(
            (
                "capture s/sample",
                f"{stages['capture']:.3f} s  (one {recipe.data.max_length}-token prefill on {capture_units} x "
                f"{hw.accelerator}: " + ("the PCIe copies, longer than the compute)" if pcie_s > split.seconds
                                         else "experts + dense + attention below)"),
            )
        )  # fmt: skip
        report.rows += _prefill_rows(recipe, split, pcie_s)
        report.numbers.update(
            prefill_expert_s=split.expert_seconds,
            prefill_dense_s=split.dense_seconds,
            prefill_attention_s=split.attention_seconds,
            prefill_compute_s=split.seconds,
            prefill_pcie_s=pcie_s,
        )
        _commit_overlap(recipe, report, stages, sample)
    link_bytes_s = hw.link_gbps * 1e9 / 8 * hw.link_efficiency
    stages["transfer"] = sample.total_bytes / link_bytes_s
    report.rows.append(
        (
            "transfer s/sample",
            f"{stages['transfer']:.3f} s  ({format_bytes(sample.total_bytes)} over "
            f"{hw.link_gbps:g} Gbit/s at {hw.link_efficiency:.0%})",
        )
    )
    trainer_units = (
        max(1, recipe.job.trainer.gpus_per_node * recipe.job.trainer.nodes)
        if recipe.job.trainer.gpus_per_node
        else recipe.trainer_world_size
    )
    train_flops = draft_train_flops_per_sample(recipe)
    peak_flops = hw.accelerator_peak_tflops * 1e12
    stages["train"] = train_flops / (trainer_units * peak_flops * hw.train_mfu)
    report.rows.append(
        (
            "train s/sample",
            f"{stages['train']:.3f} s  ({train_flops / 1e12:,.1f} TFLOP per sample on "
            f"{trainer_units} x {hw.accelerator} at {hw.train_mfu:.0%} MFU)",
        )
    )
    return stages


def _prefill_rows(recipe: Recipe, split: PrefillSplit, pcie_s: float) -> list[tuple[str, str]]:
    """One row per part of a prefill, per accelerator (runtime/recipe/fit/prefill.py)."""
    hw, t = recipe.plan, recipe.data.max_length
    rows = [
        ("  prefill: experts", f"{split.expert_seconds:.3f} s  ({split.expert_flops / 1e12:,.0f} TFLOP of routed "
         f"experts per GPU at {hw.expert_compute_tflops:g} TFLOP/s, plan.expert_compute_tflops)"),
        ("  prefill: dense", f"{split.dense_seconds:.3f} s  ({split.dense_flops / 1e12:,.0f} TFLOP of the other "
         f"active params per GPU at {hw.capture_efficiency:.0%} (plan.capture_efficiency) of "
         f"{hw.accelerator_peak_tflops:g} TFLOP/s, one GPU's dense bf16 matmul rate: plan.accelerator_peak_tflops, "
         "by default an H200's)"),
    ]  # fmt: skip
    if split.mix is None:
        rows.append(("  prefill: attention", "not counted (capture.target_attention is not set)"))
    else:
        linear = (
            f"; {split.mix.linear_layers} KDA linear layers: {split.linear_attention_flops / 1e12:,.1f} TFLOP at "
            f"{hw.linear_attention_tflops:g} TFLOP/s (plan.linear_attention_tflops, assumed)"
            if split.mix.linear_layers
            else ""
        )
        rows.append(
            (
                "  prefill: attention",
                f"{split.attention_seconds:.3f} s  ({split.mix.full_layers} full (MLA) layers, causal at {t} tokens: "
                f"{split.full_attention_flops / 1e12:,.0f} TFLOP per GPU at {hw.attention_tflops:g} TFLOP/s "
                f"(plan.attention_tflops){linear})",
            )
        )
    share = split.attention_seconds / split.seconds if split.seconds else 0.0
    rows.append(("  prefill: compute", f"{split.seconds:.3f} s  (attention {share:.0%} of it)"))
    if pcie_s:
        rows.append(
            (
                "  prefill: PCIe",
                f"{pcie_s:.3f} s  (streamed experts' copies per GPU at {hw.pcie_h2d_bytes_per_s / 1e9:.0f} GB/s"
                + (f", over {capture_shares(recipe)} engines capturing at once" if capture_shares(recipe) > 1 else "")
                + ", prefetched: they overlap the compute, the prefill takes the longer of the two)",
            )
        )
    return rows


def _commit_overlap(recipe: Recipe, report: FitReport, stages: dict[str, float], sample: SampleSize) -> None:
    """The capture side's commit (the Mooncake put of each sample): hidden behind the next forward
    by the commit pipeline, or added to the capture time without it."""
    commit_s = sample.total_bytes / (recipe.plan.store_put_gbps * 1e9)
    slots = commit_staging_slots(recipe)
    if slots:
        stages["capture"] = max(stages["capture"], commit_s)
        how = (
            f"overlapped with the next forward ({slots} staging slot(s), capture.commit_staging_slots; "
            f"{format_bytes(slots * sample.feature_bytes)} pinned host memory)"
        )
    else:
        stages["capture"] += commit_s
        how = "added to the capture: capture.commit_staging_slots is 0 (no pipeline)"
    report.rows.append(
        (
            "commit s/sample",
            f"{commit_s:.3f} s  (Mooncake put at {recipe.plan.store_put_gbps:g} GB/s, checksums on the GPU), {how}",
        )
    )


def run_steps(recipe: Recipe) -> int:
    """Optimizer steps of the run: every epoch's samples over the global batch, at most
    ``trainer.max_steps``."""
    steps = (recipe.data.num_rows or 0) * recipe.trainer.epochs // recipe.trainer.global_batch_size
    return min(steps, recipe.trainer.max_steps) if recipe.trainer.max_steps else steps


def _run_time(
    recipe: Recipe, report: FitReport, stages: dict[str, float], sample: SampleSize, cached: bool, idle: float
) -> float:
    """The run's steps and time at the bottleneck, with the feature cache when it is on (else what
    it would give a multi-epoch run); returns the trainer's idle fraction over the run."""
    samples = (recipe.data.num_rows or 0) * recipe.trainer.epochs
    steps = run_steps(recipe)
    seconds = steps * recipe.trainer.global_batch_size * max(stages.values())
    report.rows.append(("optimizer steps", f"{steps} ({samples} samples over {recipe.trainer.epochs} epoch(s))"))
    report.numbers.update(steps=steps, run_seconds=seconds)
    if cached:
        return _feature_cache(recipe, report, stages, steps, sample)
    report.rows.append(
        ("run time at the bottleneck", f"{seconds / 3600:.2f} h (every sample at max_length: an upper bound)")
    )
    if "capture" in stages and recipe.trainer.epochs > 1:
        _capture_once_projection(recipe, report, stages, steps)
    return idle


def cached_run_seconds(recipe: Recipe, stages: dict[str, float], steps: int) -> tuple[float, float, float]:
    """Run time, trainer idle fraction and cache-read seconds per sample with the feature cache:
    epoch 0 (each row once) at the slowest stage, later epochs at the slower of the trainer and
    the trainer node's disk."""
    rows_count = recipe.data.num_rows or 0
    samples = steps * recipe.trainer.global_batch_size
    first = min(samples, rows_count)
    read_s = largest_sample(recipe).total_bytes / (recipe.plan.cache_read_gbps * 1e9)
    seconds = first * max(stages.values()) + (samples - first) * max(stages["train"], read_s)
    idle = 1.0 - samples * stages["train"] / seconds if seconds else 0.0
    return seconds, idle, read_s


def _capture_once_projection(recipe: Recipe, report: FitReport, stages: dict[str, float], steps: int) -> None:
    """What the node-local feature cache would give this recipe (it is off): the first epoch at
    the capture rate, later epochs at the trainer's or the cache's."""
    seconds, idle, _ = cached_run_seconds(recipe, stages, steps)
    report.rows.append(
        (
            "with trainer.feature_cache",
            f"{seconds / 3600:.2f} h: each row captured once, later epochs read from the "
            "trainer node's disk (off in this recipe: --set trainer.feature_cache.enabled=true "
            "--set trainer.feature_cache.dir=/local/nvme/dspark_cache)",
        )
    )
    report.numbers.update(capture_once_run_seconds=seconds, capture_once_trainer_idle_fraction=idle)


def _feature_cache(
    recipe: Recipe, report: FitReport, stages: dict[str, float], steps: int, sample: SampleSize
) -> float:
    """The run with ``trainer.feature_cache``: its disk, its read rate and the run time; returns the
    trainer's idle fraction over the whole run."""
    rows_count = recipe.data.num_rows or 0
    cache_bytes = rows_count * sample.total_bytes
    disk = recipe.plan.trainer_local_disk_bytes
    seconds, idle, read_s = cached_run_seconds(recipe, stages, steps)
    samples = steps * recipe.trainer.global_batch_size
    first = min(samples, rows_count)
    report.rows += [
        (
            "feature cache size",
            f"{format_bytes(cache_bytes)} ({rows_count} rows x {format_bytes(sample.total_bytes)}) on the trainer "
            f"node's disk ({format_bytes(disk)} assumed free, plan.trainer_local_disk_bytes)",
        ),
        (
            "cache read s/sample",
            f"{read_s:.3f} s  ({format_bytes(sample.total_bytes)} at {recipe.plan.cache_read_gbps:g} GB/s, "
            "plan.cache_read_gbps; measured or assumed: the site figures below)",
        ),
        (
            "run time with the cache",
            f"{seconds / 3600:.2f} h: epoch 0's {first} samples at {max(stages.values()):.3f} s (captured once), "
            f"then {samples - first} at {max(stages['train'], read_s):.3f} s (the slower of train and cache read)",
        ),
    ]
    report.numbers.update(
        feature_cache_bytes=cache_bytes,
        run_seconds=seconds,
        cache_read_s_per_sample=read_s,
    )
    if cache_bytes > disk:
        report.findings.append(
            Finding(
                "blocker",
                f"trainer.feature_cache needs {format_bytes(cache_bytes)} on the trainer node's disk, "
                f"plan.trainer_local_disk_bytes is {format_bytes(disk)}",
                (
                    "point trainer.feature_cache.dir at a larger disk and set plan.trainer_local_disk_bytes to its free size",
                    "or set trainer.feature_cache.enabled: false (every epoch is captured again)",
                ),
            )
        )
    return idle


def _bottleneck_finding(recipe: Recipe, bottleneck: str, idle: float, cached: bool) -> Finding:
    level = "warn" if idle > TRAINER_IDLE_WARN_FRACTION else "ok"
    return Finding(
        level,
        f"bottleneck is {bottleneck}; the trainer is expected to idle {idle:.0%} of the time"
        + (" over the run (epoch 0 captured, later epochs from the feature cache)" if cached else ""),
        (
            f"add capture nodes: --set job.capture.nodes={recipe.job.capture.nodes + 1} (each runs its own "
            "engine and producer and captures every other g; the plan then shows the shorter run)",
        )
        if level == "warn" and bottleneck == "capture"
        else (),
    )
