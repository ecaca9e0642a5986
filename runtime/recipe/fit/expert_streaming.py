"""The SGLang target's routed experts streamed from host memory (``capture.expert_streaming``):
which MoE layers stay resident on each capture GPU, and whether that fits the GPU's weight budget,
the capture node's host memory and the prefill's time (the copies must hide behind compute)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.recipe.fit.eval_decode import eval_decode_rows
from runtime.recipe.fit.expert_routing import K3_ROUTED_EXPERTS, K3_TOP_K, untouched_expert_fraction
from runtime.recipe.fit.prefill import prefill_seconds, routed_expert_active_params
from runtime.recipe.fit.report import Finding, FitReport
from runtime.recipe.schema import Recipe
from runtime.recipe.sizes import segment_shares
from runtime.recipe.streaming_budget import StreamingBudgetError, StreamingSplit, split_layers
from runtime.recipe.units import GB

SGLANG_PATCH_STREAMS_EXPERTS_SINCE = "kimi_k3_dspark_sglang_0.5.23/2"
"""The capture patch version that creates streamed layers' experts in host memory and streams them
(runtime/capture/sglang_streaming.py). Served so far on the CPU only (Qwen3-MoE, bf16/fp32
experts), not on a GPU and not with K3's MXFP4 runner: the plan says so in a warning."""


def target_streaming_split(recipe: Recipe) -> StreamingSplit | None:
    """The resident/streamed split of one capture GPU for an SGLang target whose routed-expert
    bytes the recipe states (TP shards every MoE layer's experts over ``tp_size`` GPUs); None when
    streaming is off or the recipe lacks the sizes. Raises :class:`StreamingBudgetError`."""
    c = recipe.capture
    s = c.expert_streaming
    if not s.enabled or c.engine != "sglang" or not c.routed_expert_weight_bytes:
        return None
    if (s.gpu_budget_bytes is None) == (s.resident_fraction is None):
        return None
    layers = c.num_moe_layers or c.num_target_layers
    return split_layers(
        layers,
        math.ceil(c.routed_expert_weight_bytes / layers / c.sglang.tp_size),
        prefetch_layers=s.prefetch_layers,
        gpu_budget_bytes=s.gpu_budget_bytes,
        resident_fraction=s.resident_fraction,
    )


def streamed_pcie_seconds(recipe: Recipe) -> float:
    """Seconds one capture GPU spends copying its streamed experts over PCIe per prefill (0 without
    streaming): every streamed expert a prefill routes to crosses once, at ``plan.pcie_h2d_bytes_per_s``."""
    try:
        split = target_streaming_split(recipe)
    except (StreamingBudgetError, ValueError):
        return 0.0
    if split is None:
        return 0.0
    untouched = untouched_expert_fraction(recipe.data.max_length, K3_TOP_K, K3_ROUTED_EXPERTS)
    return split.host_bytes * (1.0 - untouched) / recipe.plan.pcie_h2d_bytes_per_s


@dataclass(frozen=True)
class StreamingFit:
    """The numbers of streaming on one capture GPU at the recipe's TP size, per prefill of
    ``data.max_length`` tokens."""

    split: StreamingSplit
    weight_budget_bytes: float
    """HBM per GPU for weights (after the KV/state reserve)."""
    dense_bytes_per_gpu: float
    """Non-expert weights per GPU (always resident)."""
    untouched_fraction: float
    """Share of experts a prefill routes no token to."""
    pcie_bytes_per_prefill: float
    """Streamed expert bytes one GPU copies per prefill."""
    pcie_seconds_per_prefill: float
    expert_flops_per_prefill: float
    """Routed-expert FLOPs one GPU computes per prefill."""
    expert_compute_seconds: float
    prefill_seconds: float
    """The whole prefill's compute (experts, dense, attention: runtime/recipe/fit/prefill.py; nan
    without ``capture.target_active_params``)."""
    capture_host_bytes: int
    """The capture node's host memory: streamed experts of all its GPUs + its Mooncake segment share."""
    capture_host_memory_bytes: int

    @property
    def hbm_bytes_per_gpu(self) -> float:
        """Dense weights + resident experts + streaming buffers."""
        return self.dense_bytes_per_gpu + self.split.device_bytes

    @property
    def fits_hbm(self) -> bool:
        """Resident experts and buffers fit the weight budget."""
        return self.hbm_bytes_per_gpu <= self.weight_budget_bytes

    @property
    def fits_host(self) -> bool:
        """The capture node's host memory holds the streamed experts and its segment share."""
        return self.capture_host_bytes <= self.capture_host_memory_bytes


def streaming_fit(
    recipe: Recipe, weight_budget_bytes: float, dense_bytes_per_gpu: float, top_k: int, num_experts: int
) -> StreamingFit | None:
    """The streaming numbers of ``recipe`` (None without a split; raises
    :class:`StreamingBudgetError` for a budget that cannot hold the streaming buffers)."""
    split = target_streaming_split(recipe)
    if split is None:
        return None
    cap, hw, tr = recipe.capture, recipe.plan, recipe.transport
    tp = cap.sglang.tp_size
    t = recipe.data.max_length
    untouched = untouched_expert_fraction(t, top_k, num_experts)
    pcie_bytes = split.host_bytes * (1.0 - untouched)
    expert_flops = 2.0 * t * routed_expert_active_params(recipe) / tp
    capture_segment, _ = segment_shares(tr.global_segment_bytes, tr.segment_placement)
    return StreamingFit(
        split=split,
        weight_budget_bytes=weight_budget_bytes,
        dense_bytes_per_gpu=dense_bytes_per_gpu,
        untouched_fraction=untouched,
        pcie_bytes_per_prefill=pcie_bytes,
        pcie_seconds_per_prefill=pcie_bytes / hw.pcie_h2d_bytes_per_s,
        expert_flops_per_prefill=expert_flops,
        expert_compute_seconds=expert_flops / (hw.expert_compute_tflops * 1e12),
        prefill_seconds=prefill_seconds(recipe, tp) if cap.target_active_params else float("nan"),
        capture_host_bytes=recipe.job.capture.gpus_per_node * split.host_bytes + capture_segment,
        capture_host_memory_bytes=hw.capture_host_memory_bytes,
    )


def add_streaming_fit(
    report: FitReport,
    recipe: Recipe,
    weight_budget_bytes: float,
    dense_bytes_per_gpu: float,
    top_k: int,
    num_experts: int,
) -> None:
    """Add the fit with routed experts streamed from host memory to ``report``: resident vs
    streamed bytes per GPU, host bytes per node, PCIe bytes and time per prefill against the
    expert compute time per prefill."""
    try:
        fit = streaming_fit(recipe, weight_budget_bytes, dense_bytes_per_gpu, top_k, num_experts)
    except StreamingBudgetError as exc:
        report.findings.append(Finding("blocker", str(exc)))
        return
    if fit is None:
        return
    report.numbers.update(_streaming_numbers(fit))
    report.rows += _streaming_rows(recipe, fit)
    report.rows += eval_decode_rows(recipe, fit.split, top_k, num_experts)
    report.findings += _streaming_findings(recipe, fit)


def _streaming_numbers(fit: StreamingFit) -> dict[str, float]:
    split = fit.split
    numbers = {
        "streaming_resident_layers": split.resident_layers,
        "streaming_streamed_layers": split.streamed_layers,
        "streaming_layer_bytes_per_gpu": split.layer_bytes,
        "streaming_resident_bytes_per_gpu": split.resident_bytes,
        "streaming_buffer_bytes_per_gpu": split.buffer_bytes,
        "streaming_host_bytes_per_gpu": split.host_bytes,
        "streaming_hbm_bytes_per_gpu": fit.hbm_bytes_per_gpu,
        "capture_host_bytes": fit.capture_host_bytes,
        "pcie_bytes_per_prefill_per_gpu": fit.pcie_bytes_per_prefill,
        "pcie_seconds_per_prefill": fit.pcie_seconds_per_prefill,
        "expert_compute_seconds_per_prefill": fit.expert_compute_seconds,
        "prefill_compute_seconds": fit.prefill_seconds,
    }
    if fit.fits_hbm and fit.fits_host:
        numbers["streaming_fits"] = 1.0
    return numbers


def _streaming_rows(recipe: Recipe, fit: StreamingFit) -> list[tuple[str, str]]:
    cap, hw, split = recipe.capture, recipe.plan, fit.split
    t = recipe.data.max_length
    return [
        ("expert streaming", f"MoE layers per GPU: {split.resident_layers} resident, {split.streamed_layers} streamed "
         f"of {split.num_layers} ({split.layer_bytes / GB:.2f} GB of experts per layer per GPU), prefetch "
         f"{cap.expert_streaming.prefetch_layers} layer(s) ahead into {split.num_buffers} buffers"),
        ("resident vs streamed per GPU", f"{split.resident_bytes / GB:,.1f} GB resident + {split.buffer_bytes / GB:,.1f} "
         f"GB buffers on the GPU, {split.host_bytes / GB:,.1f} GB in pinned host memory "
         f"({split.streamed_fraction:.0%} of the layers)"),
        ("HBM per GPU with streaming", f"{fit.hbm_bytes_per_gpu / GB:,.1f} GB ({fit.dense_bytes_per_gpu / GB:,.1f} dense + "
         f"{split.device_bytes / GB:,.1f} experts and buffers) of the {fit.weight_budget_bytes / GB:,.1f} GB weight budget"),
        (f"PCIe per {t}-token prefill", f"{fit.pcie_bytes_per_prefill / GB:,.1f} GB per GPU, "
         f"{fit.pcie_seconds_per_prefill:.2f} s at {hw.pcie_h2d_bytes_per_s / GB:.0f} GB/s "
         f"({1 - fit.untouched_fraction:.0%} of experts are routed to)"),
        ("expert compute per prefill", f"{fit.expert_compute_seconds:.2f} s per GPU ({fit.expert_flops_per_prefill / 1e12:,.0f} "
         f"TFLOP at {hw.expert_compute_tflops:g} TFLOP/s); whole prefill {fit.prefill_seconds:.2f} s (throughput model)"),
    ]  # fmt: skip


def _streaming_findings(recipe: Recipe, fit: StreamingFit) -> list[Finding]:
    """The HBM verdict (a blocker), nothing when the host memory is short (the per-node host memory
    check reports it), else whether the copies hide behind compute, and how far streaming is proven."""
    split, tp = fit.split, recipe.capture.sglang.tp_size
    hbm_used, budget, dense = fit.hbm_bytes_per_gpu, fit.weight_budget_bytes, fit.dense_bytes_per_gpu
    if not fit.fits_hbm:
        return [
            Finding(
                "blocker",
                f"capture.expert_streaming keeps {split.device_bytes / GB:,.1f} GB of experts and buffers per GPU, "
                f"{hbm_used / GB:,.1f} GB of weights with the {dense / GB:,.1f} GB of dense weights, above "
                f"the {budget / GB:,.1f} GB weight budget; set gpu_budget_bytes to at most "
                f"{(budget - dense) / GB:,.1f} GB",
            )
        ]
    if not fit.fits_host:
        return []
    pcie_s, expert_s, prefill_s = fit.pcie_seconds_per_prefill, fit.expert_compute_seconds, fit.prefill_seconds
    if pcie_s <= expert_s:
        overlap = f"the copies ({pcie_s:.2f} s) hide behind the expert compute ({expert_s:.2f} s)"
    elif pcie_s <= prefill_s:
        overlap = (
            f"the copies ({pcie_s:.2f} s) exceed the expert compute ({expert_s:.2f} s) but hide behind the whole "
            f"prefill ({prefill_s:.2f} s) when prefetched {recipe.capture.expert_streaming.prefetch_layers} layer(s) ahead"
        )
    else:
        overlap = f"the copies ({pcie_s:.2f} s) exceed the whole prefill ({prefill_s:.2f} s): capture is PCIe-bound"
    gpus_per_node = recipe.job.capture.gpus_per_node
    return [
        Finding(
            "ok" if pcie_s <= prefill_s else "warn",
            f"fits with streaming: {hbm_used / GB:,.1f} GB of HBM per GPU at TP{tp} ({split.resident_layers} of "
            f"{split.num_layers} MoE layers' experts resident), {gpus_per_node * split.host_bytes / GB:,.0f} GB of "
            f"experts in the capture node's host memory, {fit.pcie_bytes_per_prefill / GB:,.1f} GB over PCIe per GPU "
            "per prefill; " + overlap,
        ),
        Finding(
            "warn",
            f"the SGLang capture patch streams experts since {SGLANG_PATCH_STREAMS_EXPERTS_SINCE}, served so far "
            "on the CPU only (Qwen3-MoE: captures byte-identical to all-resident), not yet on a GPU nor with K3's "
            "MXFP4 Marlin runner: the smoke gate is the first real run, submit it before the full job",
        ),
    ]
