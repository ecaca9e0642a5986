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
    if s.tp_size != gpus:
        plan.findings.append(
            (
                "blocker",
                f"capture.sglang.tp_size is {s.tp_size} but the capture group has {gpus} GPUs "
                f"({recipe.job.capture.nodes} node(s) x {recipe.job.capture.gpus_per_node}); set tp_size to {gpus}",
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
