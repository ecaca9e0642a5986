"""``--plan``: what the recipe will ask of the machines, before anything is submitted.

Per component resources; bytes per sample and per optimizer step; Mooncake segment and watermark
margins; trainer memory per rank; whether the target fits the capture node; and a throughput model
(capture, transfer, train seconds per sample) that names the bottleneck and the trainer's expected
idle fraction. Every number is computed at ``data.max_length`` (the worst case) from the recipe and
the stated hardware assumptions in its ``plan`` section; the plan says where it is an estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from runtime.recipe import Recipe, SampleSize
from runtime.recipe.checks import largest_sample
from runtime.recipe.schema import DraftConfig
from runtime.recipe.units import format_bytes

GB = 10**9


@dataclass(frozen=True)
class Finding:
    """A verdict of the plan: ``ok``, ``warn`` or ``blocker`` (submission refuses blockers)."""

    level: str
    message: str
    options: tuple[str, ...] = ()


@dataclass
class Plan:
    """The plan: titled sections of (label, value) rows, findings, and the raw numbers."""

    sections: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    numbers: dict[str, float] = field(default_factory=dict)

    @property
    def blockers(self) -> list[Finding]:
        """Findings that stop a submission."""
        return [f for f in self.findings if f.level == "blocker"]

    def render(self) -> str:
        """Plain text (readable in a terminal and in a Slurm log)."""
        lines: list[str] = []
        for title, rows in self.sections:
            lines.append(f"== {title}")
            width = max((len(label) for label, _ in rows), default=0)
            lines += [f"  {label:<{width}}  {value}" for label, value in rows]
        lines.append("== verdict")
        for finding in self.findings:
            lines.append(f"  [{finding.level.upper()}] {finding.message}")
            lines += [f"      option: {option}" for option in finding.options]
        if not self.blockers:
            lines.append("  no blockers")
        return "\n".join(lines)


def draft_parameter_counts(draft: DraftConfig, num_aux_layers: int, vocab_size: int) -> dict[str, int]:
    """Trainable and frozen parameter counts of the DSpark draft, by part."""
    h, heads, kv, hd, inter = (
        draft.hidden_size,
        draft.num_attention_heads,
        draft.num_key_value_heads,
        draft.head_dim,
        draft.intermediate_size,
    )
    bias = draft.attention_bias
    attention = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd  # q, k, v, o, q/k norms
    if bias:
        attention += heads * hd + 2 * kv * hd + h
    layer = attention + 3 * h * inter + 2 * h
    markov = 2 * vocab_size * draft.markov_rank
    confidence = (h + draft.markov_rank + 1) if draft.confidence_head else 0
    counts = {
        "decoder_layers": draft.num_layers * layer,
        "largest_layer": layer,
        "fc_context": num_aux_layers * h * h + h,
        "final_norm": h,
        "markov_head": markov,
        "confidence_head": confidence,
        "frozen_embedding_and_lm_head": 2 * vocab_size * h,
    }
    counts["trainable"] = sum(
        counts[k] for k in ("decoder_layers", "fc_context", "final_norm", "markov_head", "confidence_head")
    )
    return counts


def draft_train_flops_per_sample(recipe: Recipe) -> float:
    """Training FLOPs of one sample at ``data.max_length`` (forward x3 for trained parts; the
    frozen lm_head costs a forward for the teacher and forward + input-gradient for the draft)."""
    d = recipe.trainer.draft
    t = recipe.data.max_length
    slots = recipe.trainer.loss.num_anchors * d.block_size
    h, v = d.hidden_size, recipe.capture.vocab_size
    counts = draft_parameter_counts(d, recipe.num_aux_layers, v)
    fc = 2.0 * t * recipe.num_aux_layers * h * h
    context_kv = 2.0 * t * h * 2 * d.num_key_value_heads * d.head_dim * d.num_layers
    slot_layers = 2.0 * slots * counts["decoder_layers"]
    mean_context = t / 2 + d.block_size
    attention = 2.0 * 2 * slots * d.num_attention_heads * d.head_dim * mean_context * d.num_layers
    markov = 2.0 * slots * d.markov_rank * v
    lm_head = 2.0 * slots * h * v
    trained = fc + context_kv + slot_layers + attention + markov
    return 3 * trained + 2 * lm_head + lm_head  # draft logits fwd + input grad, teacher logits fwd


def trainer_memory_per_rank(recipe: Recipe) -> dict[str, int]:
    """Estimated bytes per trainer rank at ``data.max_length`` (FSDP2, fp32 master + AdamW)."""
    d = recipe.trainer.draft
    world = recipe.trainer_world_size
    t = recipe.data.max_length
    h, v = d.hidden_size, recipe.capture.vocab_size
    counts = draft_parameter_counts(d, recipe.num_aux_layers, v)
    p = counts["trainable"]
    compute_bytes = 2 if recipe.trainer.param_dtype == "bfloat16" else 4
    slots = recipe.trainer.loss.num_anchors * d.block_size
    chunk_slots = min(recipe.trainer.loss.objective_chunk_blocks, recipe.trainer.loss.num_anchors) * d.block_size
    sample = SampleSize(t, recipe.num_aux_layers, recipe.capture.hidden_size)
    kv = d.num_key_value_heads * d.head_dim
    return {
        "fp32 master params (sharded)": math.ceil(4 * p / world),
        "AdamW moments (sharded)": math.ceil(8 * p / world),
        "fp32 gradients (sharded)": math.ceil(4 * p / world),
        "gathered compute params (2 units)": 2 * compute_bytes * max(counts["largest_layer"], counts["fc_context"]),
        "frozen embedding + lm_head": compute_bytes * counts["frozen_embedding_and_lm_head"],
        "input sample (hs, lhs, ids, mask)": sample.total_bytes,
        "context projection activations": 3 * t * h * compute_bytes,
        "context keys/values (all layers)": d.num_layers * 3 * t * kv * compute_bytes,
        "draft slot activations": d.num_layers * slots * (10 * h + 4 * d.intermediate_size) * compute_bytes,
        "loss chunk (fp32 logits/softmax)": 5 * chunk_slots * v * 4,
    }


def make_plan(recipe: Recipe) -> Plan:
    """Compute the plan of ``recipe``."""
    plan = Plan()
    job, tr, cap, hw = recipe.job, recipe.transport, recipe.capture, recipe.plan
    g = recipe.trainer.global_batch_size
    world = recipe.trainer_world_size

    rows = []
    for name in ("capture", "trainer"):
        res = getattr(job, name)
        rows.append(
            (
                name,
                f"{res.nodes} node(s) x {res.gpus_per_node} GPU(s), {res.tasks_per_node} task(s)/node, "
                f"{res.cpus_per_task} CPU(s)/task, mem {str(res.mem_gib) + ' GiB' if res.mem_gib else 'site default'}",
            )
        )
    rows.append(("time limit", f"{job.time_limit_min} min, requeue up to {job.max_requeues} times"))
    plan.sections.append(("components", rows))

    sample = SampleSize(recipe.data.max_length, recipe.num_aux_layers, cap.hidden_size)
    step_bytes = g * sample.total_bytes
    plan.numbers.update(
        sample_feature_bytes=sample.feature_bytes, sample_bytes=sample.total_bytes, step_bytes=step_bytes
    )
    plan.sections.append(
        (
            "data per sample and per step (at data.max_length)",
            [
                ("tokens per sample T", f"{recipe.data.max_length:,}"),
                (
                    "features T x (n_aux+1) x H x 2",
                    f"{sample.feature_bytes:,} B ({format_bytes(sample.feature_bytes)})",
                ),
                ("whole sample (+ ids, mask, meta)", f"{sample.total_bytes:,} B ({format_bytes(sample.total_bytes)})"),
                (
                    "global batch G",
                    f"{g} = {recipe.trainer.micro_batch_size} x "
                    f"{recipe.trainer.gradient_accumulation_steps} x {world} ranks",
                ),
                ("bytes per optimizer step", f"{step_bytes:,} B ({format_bytes(step_bytes)})"),
            ],
        )
    )

    ratio = tr.store_cap_bytes / tr.global_segment_bytes
    plan.sections.append(
        (
            "Mooncake",
            [
                ("protocol", f"{tr.protocol}, bind {tr.bind_address}"),
                ("global segment", format_bytes(tr.global_segment_bytes)),
                ("store cap (eviction ratio)", f"{format_bytes(tr.store_cap_bytes)} ({ratio:.4f})"),
                ("sample watermarks high/low", f"{tr.high_watermark_samples} / {tr.low_watermark_samples} (G = {g})"),
                (
                    "byte watermarks high/low",
                    f"{format_bytes(tr.high_watermark_bytes)} / {format_bytes(tr.low_watermark_bytes)}",
                ),
                (
                    "one step of largest samples",
                    f"{format_bytes(step_bytes)} "
                    f"(margin to high watermark {format_bytes(tr.high_watermark_bytes - step_bytes)})",
                ),
                ("lease / transfer timeout", f"{tr.kv_lease_ttl_s} s / {tr.transfer_timeout_s} s"),
            ],
        )
    )
    plan.findings.append(Finding("ok", "watermarks hold one global step and stay under the eviction cap"))

    memory = trainer_memory_per_rank(recipe)
    total_memory = sum(memory.values())
    counts = draft_parameter_counts(recipe.trainer.draft, recipe.num_aux_layers, cap.vocab_size)
    plan.numbers.update(trainer_memory_per_rank=total_memory, draft_trainable_params=counts["trainable"])
    mem_rows = [("trainable draft parameters", f"{counts['trainable']:,}")]
    mem_rows += [(label, format_bytes(value)) for label, value in memory.items()]
    mem_rows.append(("total per rank (estimate)", format_bytes(total_memory)))
    plan.sections.append((f"trainer memory per rank ({world} ranks)", mem_rows))
    if job.trainer.gpus_per_node:
        capacity = hw.accelerator_memory_bytes
        level = "ok" if total_memory < 0.9 * capacity else "blocker"
        plan.findings.append(
            Finding(
                level,
                f"trainer rank needs about {format_bytes(total_memory)} of "
                f"{format_bytes(capacity)} on one {hw.accelerator}",
            )
        )

    _capture_fit(recipe, plan)
    _throughput(recipe, plan, sample)
    return plan


def _capture_fit(recipe: Recipe, plan: Plan) -> None:
    from runtime.recipe.checks import host_needs_per_node
    from runtime.shared.sglang_fit import expert_offload_plan

    cap, hw = recipe.capture, recipe.plan
    gpus = recipe.job.capture.gpus_per_node * recipe.job.capture.nodes
    offload = expert_offload_plan(recipe)
    streamed = (
        int(offload.numbers.get("streaming_host_bytes_per_gpu", 0)) * recipe.job.capture.gpus_per_node if offload else 0
    )
    rows = []
    for node, needs in host_needs_per_node(recipe, streamed).items():
        memory = hw.capture_host_memory_bytes if node == "capture" else hw.trainer_host_memory_bytes
        used = sum(needs.values())
        parts = " + ".join(f"{format_bytes(v)} {k.split(' (')[0]}" for k, v in needs.items())
        rows.append((f"host memory, {node} node", f"{format_bytes(used)} ({parts}) of {format_bytes(memory)}"))
        plan.numbers[f"{node}_host_bytes"] = used  # above the node's memory the recipe checks refuse it
    if offload is not None:
        rows += offload.rows
        plan.numbers.update(offload.numbers)
        for level, message in offload.findings:
            if "do not fit" not in message:  # the fit verdict itself is stated once, below
                plan.findings.append(Finding("warn" if level == "warning" else level, message))
    if cap.target_weight_bytes is not None and gpus:
        hbm = gpus * hw.accelerator_memory_bytes
        rows += [
            ("target weights", f"{cap.target_weight_bytes / GB:,.0f} GB"),
            (f"HBM of {gpus} x {hw.accelerator}", f"{hbm / GB:,.0f} GB"),
        ]
        plan.numbers.update(target_weight_bytes=cap.target_weight_bytes, capture_hbm_bytes=hbm)
        streams = offload is not None and bool(offload.numbers.get("streaming_fits"))
        if cap.target_weight_bytes > hbm and not streams:  # with streaming the verdict came with the offload findings
            shortfall = cap.target_weight_bytes - hbm
            plan.findings.append(
                Finding(
                    "blocker",
                    f"the target's weights ({cap.target_weight_bytes / GB:,.0f} GB) exceed the capture node's HBM "
                    f"({gpus} x {hw.accelerator} = {hbm / GB:,.0f} GB) by {shortfall / GB:,.0f} GB: "
                    "they cannot be resident at this TP size",
                    _fit_options(recipe, offload.numbers if offload else {}, shortfall),
                )
            )
        elif not streams and (offload is None or not any(level == "blocker" for level, _ in offload.findings)):
            plan.findings.append(Finding("ok", "the target's weights fit the capture node's accelerator memory"))
    plan.sections.append(("capture node fit", rows))


def _fit_options(recipe: Recipe, numbers: dict[str, float], shortfall: float) -> tuple[str, ...]:
    """What to do about a target that does not fit, most practical first, each with the exact
    ``--set`` line (or why it is not available)."""
    from runtime.shared.sglang_fit import offload_support_0_5_23

    options = []
    two_nodes = numbers.get("weights_per_gpu_two_nodes_bytes")
    gpus = recipe.job.capture.gpus_per_node
    if recipe.capture.engine == "sglang" and gpus:
        per_gpu = f" ({two_nodes / GB:,.1f} GB of weights per GPU)" if two_nodes else ""
        options.append(
            f"two capture nodes, TP across them{per_gpu}: --set job.capture.nodes=2 "
            f"--set capture.sglang.tp_size={2 * gpus * recipe.job.capture.nodes}"
        )
        options.append(
            "larger-memory GPUs (8 x 288 GB B300): --set plan.accelerator=B300 "
            "--set plan.accelerator_memory_bytes=288GB --set capture.sglang.moe_runner_backend=flashinfer_mxfp4"
        )
    experts = numbers.get("offloaded_expert_bytes", shortfall)
    offload = f"expert offload to host memory ({experts / GB:,.0f} GB of experts"
    if "pcie_seconds_per_prefill" in numbers:
        offload += f", about {numbers['pcie_seconds_per_prefill']:.1f} s of PCIe per prefill"
    offload += ")"
    reasons = offload_support_0_5_23(recipe) if recipe.capture.engine == "sglang" else []
    if reasons:
        offload += f": not possible with SGLang 0.5.23 here ({len(reasons)} reasons: patches/sglang/README.md)"
    offload += (
        "; our expert streaming does it (capture.expert_streaming: enabled, gpu_budget_bytes), in the embedded "
        "engine and in the SGLang capture patch (version 2)"
    )
    options.append(offload)
    return tuple(options)


def _commit_overlap(
    recipe: Recipe, rows: list[tuple[str, str]], stages: dict[str, float], sample: SampleSize, capture_units: int
) -> None:
    """The capture side's commit (the Mooncake put of each sample): hidden behind the next forward
    by the commit pipeline, or added to the capture time without it."""
    cap = recipe.capture
    commit_s = sample.total_bytes / (recipe.plan.store_put_gbps * 1e9)
    # SGLang: one sink per server (TP group); embedded: one pipeline per replica, one batch each.
    slots = cap.effective_commit_staging_slots(1 if cap.engine == "sglang" else capture_units)
    if slots:
        stages["capture"] = max(stages["capture"], commit_s)
        how = (
            f"overlapped with the next forward ({slots} staging slot(s), capture.commit_staging_slots; "
            f"{format_bytes(slots * sample.feature_bytes)} pinned host memory)"
        )
    else:
        stages["capture"] += commit_s
        how = "added to the capture: capture.commit_staging_slots is 0 (no pipeline)"
    rows.append(
        (
            "commit s/sample",
            f"{commit_s:.3f} s  (Mooncake put at {recipe.plan.store_put_gbps:g} GB/s, checksums on the GPU), {how}",
        )
    )


def _capture_once_projection(
    recipe: Recipe, rows: list[tuple[str, str]], stages: dict[str, float], plan: Plan, steps: int
) -> None:
    """What the node-local feature cache would give this recipe (it is off): the first epoch at
    the capture rate, later epochs at the trainer's or the cache's."""
    seconds, idle, _ = _cached_run_seconds(recipe, stages, steps)
    rows.append(
        (
            "with trainer.feature_cache",
            f"{seconds / 3600:.2f} h, trainer idle {idle:.0%}: each row captured once, later epochs read from the "
            "trainer node's disk (off in this recipe: --set trainer.feature_cache.enabled=true "
            "--set trainer.feature_cache.dir=/local/nvme/dspark_cache)",
        )
    )
    plan.numbers.update(capture_once_run_seconds=seconds, capture_once_trainer_idle_fraction=idle)


def _cached_run_seconds(recipe: Recipe, stages: dict[str, float], steps: int) -> tuple[float, float, float]:
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


def _feature_cache(
    recipe: Recipe, rows: list[tuple[str, str]], stages: dict[str, float], plan: Plan, steps: int, sample: SampleSize
) -> float:
    """The run with ``trainer.feature_cache``: its disk, its read rate and the run time; returns the
    trainer's idle fraction over the whole run."""
    rows_count = recipe.data.num_rows or 0
    cache_bytes = rows_count * sample.total_bytes
    disk = recipe.plan.trainer_local_disk_bytes
    seconds, idle, read_s = _cached_run_seconds(recipe, stages, steps)
    samples = steps * recipe.trainer.global_batch_size
    first = min(samples, rows_count)
    rows.append(
        (
            "feature cache size",
            f"{format_bytes(cache_bytes)} ({rows_count} rows x {format_bytes(sample.total_bytes)}) on the trainer "
            f"node's disk ({format_bytes(disk)} assumed free, plan.trainer_local_disk_bytes)",
        )
    )
    rows.append(
        (
            "cache read s/sample",
            f"{read_s:.3f} s  ({format_bytes(sample.total_bytes)} at {recipe.plan.cache_read_gbps:g} GB/s, "
            "plan.cache_read_gbps: assumed until measured on the trainer node with tools/bench/feature_cache.py)",
        )
    )
    rows.append(
        (
            "run time with the cache",
            f"{seconds / 3600:.2f} h: epoch 0's {first} samples at {max(stages.values()):.3f} s (captured once), "
            f"then {samples - first} at {max(stages['train'], read_s):.3f} s (the slower of train and cache read); "
            f"trainer idle {idle:.0%} over the run",
        )
    )
    plan.numbers.update(
        feature_cache_bytes=cache_bytes,
        run_seconds=seconds,
        cache_read_s_per_sample=read_s,
        run_trainer_idle_fraction=idle,
    )
    if cache_bytes > disk:
        plan.findings.append(
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


def _throughput(recipe: Recipe, plan: Plan, sample: SampleSize) -> None:
    cap, hw = recipe.capture, recipe.plan
    t = recipe.data.max_length
    capture_units = max(1, recipe.job.capture.gpus_per_node * recipe.job.capture.nodes)
    trainer_units = (
        max(1, recipe.job.trainer.gpus_per_node * recipe.job.trainer.nodes)
        if recipe.job.trainer.gpus_per_node
        else recipe.trainer_world_size
    )
    peak = hw.accelerator_peak_tflops * 1e12
    rows: list[tuple[str, str]] = []
    stages: dict[str, float] = {}
    if cap.target_active_params:
        capture_flops = 2.0 * cap.target_active_params * t
        stages["capture"] = capture_flops / (capture_units * peak * hw.capture_efficiency)
        rows.append(
            (
                "capture s/sample",
                f"{stages['capture']:.3f} s  (2 x {cap.target_active_params:.3g} active "
                f"params x {t} tokens on {capture_units} x {hw.accelerator} at "
                f"{hw.capture_efficiency:.0%} of peak; attention not counted)",
            )
        )
    if "capture" in stages:
        _commit_overlap(recipe, rows, stages, sample, capture_units)
    link_bytes_s = hw.link_gbps * 1e9 / 8 * hw.link_efficiency
    stages["transfer"] = sample.total_bytes / link_bytes_s
    rows.append(
        (
            "transfer s/sample",
            f"{stages['transfer']:.3f} s  ({format_bytes(sample.total_bytes)} over "
            f"{hw.link_gbps:g} Gbit/s at {hw.link_efficiency:.0%})",
        )
    )
    train_flops = draft_train_flops_per_sample(recipe)
    stages["train"] = train_flops / (trainer_units * peak * hw.train_mfu)
    rows.append(
        (
            "train s/sample",
            f"{stages['train']:.3f} s  ({train_flops / 1e12:,.1f} TFLOP per sample on "
            f"{trainer_units} x {hw.accelerator} at {hw.train_mfu:.0%} MFU)",
        )
    )
    bottleneck = max(stages, key=lambda k: stages[k])
    slowest = stages[bottleneck]
    idle = 1.0 - stages["train"] / slowest
    rows.append(("bottleneck", f"{bottleneck} ({slowest:.3f} s/sample, {1 / slowest:.3f} samples/s)"))
    rows.append(("trainer idle fraction", f"{idle:.1%}"))
    samples = None
    cached = recipe.trainer.feature_cache.enabled and "capture" in stages and bool(recipe.data.num_rows)
    if recipe.data.num_rows:
        samples = recipe.data.num_rows * recipe.trainer.epochs
        steps = samples // recipe.trainer.global_batch_size
        if recipe.trainer.max_steps:
            steps = min(steps, recipe.trainer.max_steps)
        seconds = steps * recipe.trainer.global_batch_size * slowest
        rows.append(("optimizer steps", f"{steps} ({samples} samples over {recipe.trainer.epochs} epoch(s))"))
        plan.numbers.update(steps=steps, run_seconds=seconds)
        if cached:
            idle = _feature_cache(recipe, rows, stages, plan, steps, sample)
        else:
            rows.append(
                ("run time at the bottleneck", f"{seconds / 3600:.2f} h (every sample at max_length: an upper bound)")
            )
            if "capture" in stages and recipe.trainer.epochs > 1:
                _capture_once_projection(recipe, rows, stages, plan, steps)
    plan.numbers.update({f"{k}_s_per_sample": v for k, v in stages.items()})
    plan.numbers.update(trainer_idle_fraction=idle)
    plan.sections.append(("throughput model", rows))
    level = "warn" if idle > 0.5 else "ok"
    plan.findings.append(
        Finding(
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
    )
