"""Does the target fit the SGLang capture node, and what would expert offload cost? (torch-free)

The launcher's plan calls :func:`expert_offload_plan` for ``capture.engine: sglang`` recipes. It
answers, with numbers, the question of patches/sglang/README.md ("Fitting K3 on one 8 x H200 node"):
how much of the routed experts must leave HBM, how much host RAM that takes next to the Mooncake
segment, how many bytes cross PCIe per prefill, and whether SGLang 0.5.23 can do it for this recipe
at all. It also sizes the two alternatives (more capture GPUs, larger GPUs).

Model assumptions (K3 defaults, arguments for other targets): the store for offloaded experts is
pinned host memory; a prefill of T tokens routes T x top_k entries over E experts per layer, so an
expert is left untouched with probability (1 - 1/E)^(T x top_k) -- zero in practice for K3 at any
T above a few hundred tokens -- and every offloaded expert crosses PCIe once per prefill.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from runtime.recipe.schema import Recipe
from runtime.recipe.sizes import segment_shares

GB = 10**9

K3_ROUTED_EXPERTS = 896
K3_TOP_K = 16
KV_RESERVE_BYTES_PER_GPU = 5 * GB
"""KV pool for one 66K-token request plus linear-attention state slots (an estimate; MLA keeps
576 bf16 values per token per MLA layer)."""
PCIE_H2D_BYTES_PER_S = 50 * GB
"""Pinned host-to-device copy rate of one PCIe Gen5 x16 link (about 50 GB/s in practice)."""
B300_MEMORY_BYTES = 288 * GB


@dataclass
class OffloadPlan:
    """Rows for the plan's report, findings (``ok`` / ``warning`` / ``blocker``), raw numbers."""

    rows: list[tuple[str, str]] = field(default_factory=list)
    findings: list[tuple[str, str]] = field(default_factory=list)
    numbers: dict[str, float] = field(default_factory=dict)


def untouched_expert_fraction(num_tokens: int, top_k: int, num_experts: int) -> float:
    """Expected fraction of experts no token of a prefill routes to (uniform routing)."""
    return math.exp(num_tokens * top_k * math.log1p(-1.0 / num_experts))


def offload_support_0_5_23(recipe: Recipe) -> list[str]:
    """Why SGLang 0.5.23 cannot serve this recipe with experts in host memory (empty: it can)."""
    s = recipe.capture.sglang
    reasons = []
    mxfp4_marlin = s.moe_runner_backend == "marlin"
    if s.tp_size > 1:
        reasons.append(
            f"--enable-paged-experts is single-GPU only (check_paged_experts_compat rejects --tp-size {s.tp_size})"
        )
    if mxfp4_marlin:
        reasons.append(
            "--enable-paged-experts has no format for FP8-config MXFP4 experts on the Marlin runner "
            "(Mxfp4MarlinMoEMethod is not among paged_experts/formats.py FORMATS)"
        )
        reasons.append(
            "--cpu-offload-gb moves a layer's parameters to host memory when the layer is built; the MXFP4 "
            "Marlin repack (prepare_moe_mxfp4_layer_for_marlin) then runs the CUDA repack kernel on those "
            "host tensors"
        )
    reasons.append(
        "--offload-group-size needs a submodule accessor that kimi_k3.py's make_pp_layers call does not pass, "
        "and its shm_cpu / sharded_gpu modes assert tp_size == 1"
    )
    return reasons


def expert_offload_plan(
    recipe: Recipe,
    *,
    num_routed_experts: int = K3_ROUTED_EXPERTS,
    top_k: int = K3_TOP_K,
    kv_reserve_bytes_per_gpu: int = KV_RESERVE_BYTES_PER_GPU,
    pcie_h2d_bytes_per_s: float = PCIE_H2D_BYTES_PER_S,
) -> OffloadPlan | None:
    """The capture-node memory plan of an SGLang recipe; None when the recipe lacks the sizes."""
    cap = recipe.capture
    s = cap.sglang
    if cap.engine != "sglang" or cap.target_weight_bytes is None:
        return None
    gpus = recipe.job.capture.nodes * recipe.job.capture.gpus_per_node
    plan = OffloadPlan()
    if gpus <= 0:
        plan.findings.append(("blocker", "the capture het group requests no GPUs for an SGLang engine"))
        return plan
    from runtime.recipe.checks import capture_shares

    servers = capture_shares(recipe)
    if s.tp_size * servers != gpus:
        per_node = recipe.job.capture.gpus_per_node
        plan.findings.append(
            (
                "blocker",
                f"capture.sglang.tp_size is {s.tp_size} but the capture group has {gpus} GPUs "
                f"({recipe.job.capture.nodes} node(s) x {per_node}) for {servers} server(s); set tp_size to "
                f"{per_node} (a server per node) or {gpus} (one server across the nodes)",
            )
        )
    hbm = recipe.plan.accelerator_memory_bytes
    weights = cap.target_weight_bytes
    experts = cap.routed_expert_weight_bytes or 0
    dense = weights - experts
    budget = hbm * s.mem_fraction_static
    per_gpu = weights / s.tp_size
    plan.numbers.update(
        weights_per_gpu_bytes=per_gpu,
        weight_budget_per_gpu_bytes=budget - kv_reserve_bytes_per_gpu,
    )
    plan.rows += [
        ("weights per GPU at TP" + str(s.tp_size), f"{per_gpu / GB:,.1f} GB"),
        (
            "weight budget per GPU",
            f"{(budget - kv_reserve_bytes_per_gpu) / GB:,.1f} GB ({hbm / GB:,.0f} GB x mem_fraction_static "
            f"{s.mem_fraction_static:g} - {kv_reserve_bytes_per_gpu / GB:,.0f} GB KV/state)",
        ),
    ]
    if per_gpu <= budget - kv_reserve_bytes_per_gpu:
        plan.findings.append(("ok", f"the weights fit resident: {per_gpu / GB:,.1f} GB per GPU at TP{s.tp_size}"))
        return plan
    if cap.expert_streaming.enabled and experts:
        _streaming_rows(recipe, plan, budget - kv_reserve_bytes_per_gpu, dense / s.tp_size, top_k, num_routed_experts)
        return plan

    resident_budget = budget - kv_reserve_bytes_per_gpu - dense / s.tp_size
    offloaded = experts - max(0.0, resident_budget) * s.tp_size if experts else float("nan")
    if experts and resident_budget > 0 and offloaded <= experts:
        untouched = untouched_expert_fraction(recipe.data.max_length, top_k, num_routed_experts)
        pcie_bytes = offloaded * (1.0 - untouched)
        pcie_s = pcie_bytes / s.tp_size / pcie_h2d_bytes_per_s
        segment = recipe.transport.global_segment_bytes
        host = recipe.plan.capture_host_memory_bytes
        plan.numbers.update(
            offloaded_expert_bytes=offloaded,
            resident_expert_fraction=1.0 - offloaded / experts,
            host_bytes_offload=offloaded + segment,
            host_bytes_paged=experts + segment,
            pcie_bytes_per_prefill=pcie_bytes,
            pcie_seconds_per_prefill=pcie_s,
        )
        plan.rows += [
            ("routed experts that must leave HBM", f"{offloaded / GB:,.0f} GB of {experts / GB:,.0f} GB "
             f"({offloaded / experts:.0%}; {offloaded / s.tp_size / GB:,.1f} GB per GPU)"),
            ("host RAM: offloaded experts + Mooncake segment",
             f"{(offloaded + segment) / GB:,.0f} GB (paged experts keeps all experts on the host: "
             f"{(experts + segment) / GB:,.0f} GB) of {host / GB:,.0f} GB"),
            (f"PCIe per {recipe.data.max_length}-token prefill",
             f"{pcie_bytes / GB:,.0f} GB ({pcie_bytes / s.tp_size / GB:,.1f} GB per GPU, about {pcie_s:.1f} s at "
             f"{pcie_h2d_bytes_per_s / GB:.0f} GB/s per link; {1 - untouched:.0%} of experts are routed to)"),
        ]  # fmt: skip
    else:
        plan.rows.append(("routed experts", "unknown (capture.routed_expert_weight_bytes)" if not experts else
                          "the non-expert weights alone exceed the budget"))  # fmt: skip
    reasons = offload_support_0_5_23(recipe)
    plan.findings.append(
        (
            "blocker",
            f"the weights ({weights / GB:,.0f} GB, {per_gpu / GB:,.1f} GB per GPU) do not fit {gpus} x "
            f"{recipe.plan.accelerator} at TP{s.tp_size}, and SGLang 0.5.23 offers no expert offload for "
            "this recipe: " + "; ".join(reasons),
        )
    )
    two_nodes = weights / (2 * gpus)
    b300_budget = B300_MEMORY_BYTES * s.mem_fraction_static - kv_reserve_bytes_per_gpu
    plan.rows += [
        (f"alternative: 2 capture nodes, TP{2 * gpus}", f"{two_nodes / GB:,.1f} GB per GPU "
         f"({'fits' if two_nodes <= budget - kv_reserve_bytes_per_gpu else 'does not fit'})"),
        (f"alternative: {gpus} x B300 ({B300_MEMORY_BYTES / GB:.0f} GB)", f"{per_gpu / GB:,.1f} GB per GPU of "
         f"{b300_budget / GB:,.1f} GB ({'fits' if per_gpu <= b300_budget else 'does not fit'}; "
         "--moe-runner-backend flashinfer_mxfp4: MXFP4 Marlin needs SM90/SM120)"),
    ]  # fmt: skip
    plan.numbers.update(weights_per_gpu_two_nodes_bytes=two_nodes, b300_weight_budget_bytes=b300_budget)
    return plan


SGLANG_PATCH_STREAMS_EXPERTS_SINCE = "kimi_k3_dspark_sglang_0.5.23/2"
"""The capture patch version that creates streamed layers' experts in host memory and streams them
(runtime/capture/sglang_streaming.py). Served so far on the CPU only (Qwen3-MoE, bf16/fp32
experts), not on a GPU and not with K3's MXFP4 runner: the plan says so in a warning."""
MXFP4_BITS_PER_WEIGHT = 4.25
"""E2M1 value (4 bits) plus one 8-bit E8M0 scale per 32 weights."""


def _streaming_rows(
    recipe: Recipe, plan: OffloadPlan, weight_budget: float, dense_per_gpu: float, top_k: int, num_experts: int
) -> None:
    """The fit with routed experts streamed from host memory (capture.expert_streaming): resident vs
    streamed bytes per GPU, host bytes per node, PCIe bytes and time per prefill against the expert
    compute time per prefill (the copies must hide behind compute)."""
    from runtime.recipe.checks import target_streaming_split
    from runtime.recipe.streaming_budget import StreamingBudgetError

    cap, s, hw, tr = recipe.capture, recipe.capture.sglang, recipe.plan, recipe.transport
    tp = s.tp_size
    try:
        split = target_streaming_split(recipe)
    except StreamingBudgetError as exc:
        plan.findings.append(("blocker", str(exc)))
        return
    if split is None:
        return
    t = recipe.data.max_length
    gpus_per_node = recipe.job.capture.gpus_per_node
    experts = cap.routed_expert_weight_bytes or 0
    hbm_used = dense_per_gpu + split.device_bytes
    untouched = untouched_expert_fraction(t, top_k, num_experts)
    pcie_bytes = split.host_bytes * (1.0 - untouched)
    pcie_s = pcie_bytes / hw.pcie_h2d_bytes_per_s
    expert_params = experts * 8 / MXFP4_BITS_PER_WEIGHT
    expert_flops = 2.0 * t * expert_params * top_k / num_experts / tp
    expert_s = expert_flops / (hw.expert_compute_tflops * 1e12)
    prefill_s = (
        2.0 * cap.target_active_params * t / (tp * hw.accelerator_peak_tflops * 1e12 * hw.capture_efficiency)
        if cap.target_active_params
        else float("nan")
    )
    capture_segment, _ = segment_shares(tr.global_segment_bytes, tr.segment_placement)
    capture_host = gpus_per_node * split.host_bytes + capture_segment
    plan.numbers.update(
        streaming_resident_layers=split.resident_layers,
        streaming_streamed_layers=split.streamed_layers,
        streaming_layer_bytes_per_gpu=split.layer_bytes,
        streaming_resident_bytes_per_gpu=split.resident_bytes,
        streaming_buffer_bytes_per_gpu=split.buffer_bytes,
        streaming_host_bytes_per_gpu=split.host_bytes,
        streaming_hbm_bytes_per_gpu=hbm_used,
        capture_host_bytes=capture_host,
        pcie_bytes_per_prefill_per_gpu=pcie_bytes,
        pcie_seconds_per_prefill=pcie_s,
        expert_compute_seconds_per_prefill=expert_s,
        prefill_compute_seconds=prefill_s,
    )
    plan.rows += [
        ("expert streaming", f"MoE layers per GPU: {split.resident_layers} resident, {split.streamed_layers} streamed "
         f"of {split.num_layers} ({split.layer_bytes / GB:.2f} GB of experts per layer per GPU), prefetch "
         f"{cap.expert_streaming.prefetch_layers} layer(s) ahead into {split.num_buffers} buffers"),
        ("resident vs streamed per GPU", f"{split.resident_bytes / GB:,.1f} GB resident + {split.buffer_bytes / GB:,.1f} "
         f"GB buffers on the GPU, {split.host_bytes / GB:,.1f} GB in pinned host memory "
         f"({split.streamed_fraction:.0%} of the layers)"),
        ("HBM per GPU with streaming", f"{hbm_used / GB:,.1f} GB ({dense_per_gpu / GB:,.1f} dense + "
         f"{split.device_bytes / GB:,.1f} experts and buffers) of the {weight_budget / GB:,.1f} GB weight budget"),
        (f"PCIe per {t}-token prefill", f"{pcie_bytes / GB:,.1f} GB per GPU, {pcie_s:.2f} s at "
         f"{hw.pcie_h2d_bytes_per_s / GB:.0f} GB/s ({1 - untouched:.0%} of experts are routed to)"),
        ("expert compute per prefill", f"{expert_s:.2f} s per GPU ({expert_flops / 1e12:,.0f} TFLOP at "
         f"{hw.expert_compute_tflops:g} TFLOP/s); whole prefill {prefill_s:.2f} s (throughput model)"),
    ]  # fmt: skip
    if hbm_used > weight_budget:
        plan.findings.append(
            (
                "blocker",
                f"capture.expert_streaming keeps {split.device_bytes / GB:,.1f} GB of experts and buffers per GPU, "
                f"{hbm_used / GB:,.1f} GB of weights with the {dense_per_gpu / GB:,.1f} GB of dense weights, above "
                f"the {weight_budget / GB:,.1f} GB weight budget; set gpu_budget_bytes to at most "
                f"{(weight_budget - dense_per_gpu) / GB:,.1f} GB",
            )
        )
        return
    if capture_host > hw.capture_host_memory_bytes:
        return  # the plan's per-node host memory check reports it
    if pcie_s <= expert_s:
        overlap = f"the copies ({pcie_s:.2f} s) hide behind the expert compute ({expert_s:.2f} s)"
    elif pcie_s <= prefill_s:
        overlap = (
            f"the copies ({pcie_s:.2f} s) exceed the expert compute ({expert_s:.2f} s) but hide behind the whole "
            f"prefill ({prefill_s:.2f} s) when prefetched {cap.expert_streaming.prefetch_layers} layer(s) ahead"
        )
    else:
        overlap = f"the copies ({pcie_s:.2f} s) exceed the whole prefill ({prefill_s:.2f} s): capture is PCIe-bound"
    plan.numbers["streaming_fits"] = 1.0
    plan.findings.append(
        (
            "ok" if pcie_s <= prefill_s else "warning",
            f"fits with streaming: {hbm_used / GB:,.1f} GB of HBM per GPU at TP{tp} ({split.resident_layers} of "
            f"{split.num_layers} MoE layers' experts resident), {gpus_per_node * split.host_bytes / GB:,.0f} GB of "
            f"experts in the capture node's host memory, {pcie_bytes / GB:,.1f} GB over PCIe per GPU per prefill; "
            + overlap,
        )
    )
    plan.findings.append(
        (
            "warning",
            f"the SGLang capture patch streams experts since {SGLANG_PATCH_STREAMS_EXPERTS_SINCE}, served so far "
            "on the CPU only (Qwen3-MoE: captures byte-identical to all-resident), not yet on a GPU nor with K3's "
            "MXFP4 Marlin runner: the smoke gate is the first real run, submit it before the full job",
        )
    )
