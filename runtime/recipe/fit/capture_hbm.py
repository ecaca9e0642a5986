"""Do the target's weights fit the capture GPUs of an SGLang recipe at its TP size, and if not, what
would expert offload cost? Resident, streamed (``capture.expert_streaming``) or offloaded experts,
and the two alternatives (more capture GPUs, larger GPUs).

This answers, with numbers, the question of patches/sglang/README.md ("Fitting K3 on one 8 x H200
node"): how much of the routed experts must leave HBM, how much host RAM that takes next to the
Mooncake segment, how many bytes cross PCIe per prefill, and whether SGLang 0.5.23 can do it for
this recipe at all. Model assumptions (K3 defaults): the store for offloaded experts is pinned host
memory, copied at ``plan.pcie_h2d_bytes_per_s`` per link (the rate streaming uses too), and every
offloaded expert a prefill routes to crosses PCIe once per prefill
(:mod:`runtime.recipe.fit.expert_routing`).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.recipe.capture_layout import capture_shares
from runtime.recipe.fit.expert_routing import K3_ROUTED_EXPERTS, K3_TOP_K, untouched_expert_fraction
from runtime.recipe.fit.expert_streaming import add_streaming_fit
from runtime.recipe.fit.report import Finding, FitReport
from runtime.recipe.schema import Recipe
from runtime.recipe.units import GB

KV_RESERVE_BYTES_PER_GPU = 5 * GB
"""KV pool for one 66K-token request plus linear-attention state slots (an estimate; MLA keeps
576 bf16 values per token per MLA layer)."""
B300_MEMORY_BYTES = 288 * GB


@dataclass(frozen=True)
class WeightBudget:
    """The target's weights against one capture GPU's memory at the recipe's TP size."""

    gpus: int
    """Capture GPUs of the job."""
    tp_size: int
    weights_bytes: int
    expert_bytes: int
    """Routed-expert bytes of the target (0: unknown)."""
    accelerator_memory_bytes: int
    mem_fraction_static: float

    @property
    def dense_bytes(self) -> int:
        """Weights that are not routed experts."""
        return self.weights_bytes - self.expert_bytes

    @property
    def weights_per_gpu_bytes(self) -> float:
        """The weights' share of one GPU."""
        return self.weights_bytes / self.tp_size

    def weight_budget_per_gpu_bytes(self, accelerator_memory_bytes: int | None = None) -> float:
        """What one GPU (of ``accelerator_memory_bytes``, default the recipe's) has for weights: its
        static memory fraction less the KV/state reserve."""
        memory = self.accelerator_memory_bytes if accelerator_memory_bytes is None else accelerator_memory_bytes
        return memory * self.mem_fraction_static - KV_RESERVE_BYTES_PER_GPU


def weight_budget(recipe: Recipe) -> WeightBudget:
    """The weight budget of an SGLang recipe (weights 0 when ``capture.target_weight_bytes`` is unset)."""
    cap = recipe.capture
    return WeightBudget(
        gpus=recipe.job.capture.nodes * recipe.job.capture.gpus_per_node,
        tp_size=cap.sglang.tp_size,
        weights_bytes=cap.target_weight_bytes or 0,
        expert_bytes=cap.routed_expert_weight_bytes or 0,
        accelerator_memory_bytes=recipe.plan.accelerator_memory_bytes,
        mem_fraction_static=cap.sglang.mem_fraction_static,
    )


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


def capture_hbm_fit(recipe: Recipe) -> FitReport | None:
    """The capture GPUs' memory plan of an SGLang recipe; None when the recipe lacks the sizes (or
    uses the embedded engine)."""
    cap = recipe.capture
    if cap.engine != "sglang" or cap.target_weight_bytes is None:
        return None
    report = FitReport("capture GPU memory")
    budget = weight_budget(recipe)
    if budget.gpus <= 0:
        report.findings.append(Finding("blocker", "the capture het group requests no GPUs for an SGLang engine"))
        return report
    report.findings += _tp_size_findings(recipe, budget.gpus)
    _add_budget(report, recipe, budget)
    if budget.weights_per_gpu_bytes <= budget.weight_budget_per_gpu_bytes():
        report.findings.append(
            Finding(
                "ok",
                f"the weights fit resident: {budget.weights_per_gpu_bytes / GB:,.1f} GB per GPU at TP{budget.tp_size}",
            )
        )
        return report
    if cap.expert_streaming.enabled and budget.expert_bytes:
        dense_per_gpu = budget.dense_bytes / budget.tp_size
        add_streaming_fit(
            report, recipe, budget.weight_budget_per_gpu_bytes(), dense_per_gpu, K3_TOP_K, K3_ROUTED_EXPERTS
        )
        return report
    _add_offload(report, recipe, budget)
    report.findings.append(
        Finding(
            "blocker",
            f"the weights ({budget.weights_bytes / GB:,.0f} GB, {budget.weights_per_gpu_bytes / GB:,.1f} GB per GPU) "
            f"do not fit {budget.gpus} x {recipe.plan.accelerator} at TP{budget.tp_size}, and SGLang 0.5.23 offers "
            "no expert offload for this recipe: " + "; ".join(offload_support_0_5_23(recipe)),
        )
    )
    _add_alternatives(report, budget)
    return report


def _tp_size_findings(recipe: Recipe, gpus: int) -> list[Finding]:
    """A blocker when ``tp_size`` fits neither a server per node nor one server across the nodes."""
    tp_size, servers = recipe.capture.sglang.tp_size, capture_shares(recipe)
    if tp_size * servers == gpus:
        return []
    per_node = recipe.job.capture.gpus_per_node
    return [
        Finding(
            "blocker",
            f"capture.sglang.tp_size is {tp_size} but the capture group has {gpus} GPUs "
            f"({recipe.job.capture.nodes} node(s) x {per_node}) for {servers} server(s); set tp_size to "
            f"{per_node} (a server per node) or {gpus} (one server across the nodes)",
        )
    ]


def _add_budget(report: FitReport, recipe: Recipe, budget: WeightBudget) -> None:
    s = recipe.capture.sglang
    report.numbers.update(
        weights_per_gpu_bytes=budget.weights_per_gpu_bytes,
        weight_budget_per_gpu_bytes=budget.weight_budget_per_gpu_bytes(),
    )
    report.rows += [
        ("weights per GPU at TP" + str(s.tp_size), f"{budget.weights_per_gpu_bytes / GB:,.1f} GB"),
        (
            "weight budget per GPU",
            f"{budget.weight_budget_per_gpu_bytes() / GB:,.1f} GB ({recipe.plan.accelerator_memory_bytes / GB:,.0f} GB "
            f"x mem_fraction_static {s.mem_fraction_static:g} - {KV_RESERVE_BYTES_PER_GPU / GB:,.0f} GB KV/state)",
        ),
    ]


def _add_offload(report: FitReport, recipe: Recipe, budget: WeightBudget) -> None:
    """What expert offload would take: experts that leave HBM, host RAM, PCIe per prefill."""
    experts, tp = budget.expert_bytes, budget.tp_size
    resident_budget = budget.weight_budget_per_gpu_bytes() - budget.dense_bytes / tp
    offloaded = experts - max(0.0, resident_budget) * tp if experts else float("nan")
    if not (experts and resident_budget > 0 and offloaded <= experts):
        report.rows.append(("routed experts", "unknown (capture.routed_expert_weight_bytes)" if not experts else
                            "the non-expert weights alone exceed the budget"))  # fmt: skip
        return
    t = recipe.data.max_length
    untouched = untouched_expert_fraction(t, K3_TOP_K, K3_ROUTED_EXPERTS)
    pcie_rate = recipe.plan.pcie_h2d_bytes_per_s
    pcie_bytes = offloaded * (1.0 - untouched)
    pcie_s = pcie_bytes / tp / pcie_rate
    segment = recipe.transport.global_segment_bytes
    host = recipe.plan.capture_host_memory_bytes
    report.numbers.update(
        offloaded_expert_bytes=offloaded,
        resident_expert_fraction=1.0 - offloaded / experts,
        host_bytes_offload=offloaded + segment,
        host_bytes_paged=experts + segment,
        pcie_bytes_per_prefill=pcie_bytes,
        pcie_seconds_per_prefill=pcie_s,
    )
    report.rows += [
        ("routed experts that must leave HBM", f"{offloaded / GB:,.0f} GB of {experts / GB:,.0f} GB "
         f"({offloaded / experts:.0%}; {offloaded / tp / GB:,.1f} GB per GPU)"),
        ("host RAM: offloaded experts + Mooncake segment",
         f"{(offloaded + segment) / GB:,.0f} GB (paged experts keeps all experts on the host: "
         f"{(experts + segment) / GB:,.0f} GB) of {host / GB:,.0f} GB"),
        (f"PCIe per {t}-token prefill",
         f"{pcie_bytes / GB:,.0f} GB ({pcie_bytes / tp / GB:,.1f} GB per GPU, about {pcie_s:.1f} s at "
         f"{pcie_rate / GB:.0f} GB/s per link; {1 - untouched:.0%} of experts are routed to)"),
    ]  # fmt: skip


def _add_alternatives(report: FitReport, budget: WeightBudget) -> None:
    """Two capture nodes at twice the TP size, and B300s (288 GB) at this one."""
    gpus, per_gpu = budget.gpus, budget.weights_per_gpu_bytes
    two_nodes = budget.weights_bytes / (2 * gpus)
    fits_two_nodes = two_nodes <= budget.weight_budget_per_gpu_bytes()
    b300_budget = budget.weight_budget_per_gpu_bytes(B300_MEMORY_BYTES)
    report.rows += [
        (f"alternative: 2 capture nodes, TP{2 * gpus}", f"{two_nodes / GB:,.1f} GB per GPU "
         f"({'fits' if fits_two_nodes else 'does not fit'})"),
        (f"alternative: {gpus} x B300 ({B300_MEMORY_BYTES / GB:.0f} GB)", f"{per_gpu / GB:,.1f} GB per GPU of "
         f"{b300_budget / GB:,.1f} GB ({'fits' if per_gpu <= b300_budget else 'does not fit'}; "
         "--moe-runner-backend flashinfer_mxfp4: MXFP4 Marlin needs SM90/SM120)"),
    ]  # fmt: skip
    report.numbers.update(weights_per_gpu_two_nodes_bytes=two_nodes, b300_weight_budget_bytes=b300_budget)
