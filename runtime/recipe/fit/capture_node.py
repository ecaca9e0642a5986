"""The plan's "capture node fit" section: what lives in each node's host memory, whether the
target's weights fit the capture GPUs (:mod:`runtime.recipe.fit.capture_hbm`), and what to do when
they do not."""

from __future__ import annotations

from dataclasses import replace

from runtime.recipe.fit.capture_hbm import capture_hbm_fit, offload_support_0_5_23
from runtime.recipe.fit.host_memory import host_needs_per_node, streamed_expert_host_bytes
from runtime.recipe.fit.report import Finding, FitReport
from runtime.recipe.schema import Recipe
from runtime.recipe.units import GB, format_bytes


def capture_node_fit(recipe: Recipe) -> FitReport:
    """Host memory per node, the capture GPUs' memory plan (SGLang), and the verdict on the
    target's weights against the capture node's HBM."""
    report = FitReport("capture node fit")
    hbm_fit = capture_hbm_fit(recipe)
    # The same figure the recipe checks refuse on: every GPU's streamed experts whenever streaming
    # splits the layers (also when the weights would fit resident: the runtime streams them then too).
    _add_host_memory(report, recipe, streamed_expert_host_bytes(recipe))
    if hbm_fit is not None:
        report.rows += hbm_fit.rows
        report.numbers.update(hbm_fit.numbers)
        report.findings += hbm_fit.findings
    _add_weights_verdict(report, recipe, hbm_fit)
    return report


def _add_host_memory(report: FitReport, recipe: Recipe, streamed_expert_bytes: int) -> None:
    """One row per node: what lives in its host memory against ``plan.<node>_host_memory_bytes``
    (above it the recipe checks refuse the recipe)."""
    hw = recipe.plan
    for node, needs in host_needs_per_node(recipe, streamed_expert_bytes).items():
        memory = hw.capture_host_memory_bytes if node == "capture" else hw.trainer_host_memory_bytes
        used = sum(needs.values())
        parts = " + ".join(f"{format_bytes(v)} {k.split(' (')[0]}" for k, v in needs.items())
        report.rows.append((f"host memory, {node} node", f"{format_bytes(used)} ({parts}) of {format_bytes(memory)}"))
        report.numbers[f"{node}_host_bytes"] = used


def _add_weights_verdict(report: FitReport, recipe: Recipe, hbm_fit: FitReport | None) -> None:
    """The target's weights against the HBM of all capture GPUs: a blocker with the options when
    they exceed it (unless streaming fits them), else ok (unless the HBM fit found a blocker)."""
    cap, hw = recipe.capture, recipe.plan
    gpus = recipe.job.capture.gpus_per_node * recipe.job.capture.nodes
    if cap.target_weight_bytes is None or not gpus:
        return
    hbm = gpus * hw.accelerator_memory_bytes
    report.rows += [
        ("target weights", f"{cap.target_weight_bytes / GB:,.0f} GB"),
        (f"HBM of {gpus} x {hw.accelerator}", f"{hbm / GB:,.0f} GB"),
    ]
    report.numbers.update(target_weight_bytes=cap.target_weight_bytes, capture_hbm_bytes=hbm)
    streams = hbm_fit is not None and bool(hbm_fit.numbers.get("streaming_fits"))
    if cap.target_weight_bytes > hbm and not streams:  # with streaming the verdict came with its findings
        shortfall = cap.target_weight_bytes - hbm
        # The verdict is stated once: this total replaces the HBM fit's per-GPU "do not fit".
        report.findings = [f for f in report.findings if not _per_gpu_verdict(f)]
        report.findings.append(
            Finding(
                "blocker",
                f"the target's weights ({cap.target_weight_bytes / GB:,.0f} GB) exceed the capture node's HBM "
                f"({gpus} x {hw.accelerator} = {hbm / GB:,.0f} GB) by {shortfall / GB:,.0f} GB: "
                "they cannot be resident at this TP size",
                fit_options(recipe, hbm_fit.numbers if hbm_fit else {}, shortfall),
            )
        )
    elif not streams and hbm_fit is not None and any(_per_gpu_verdict(f) for f in hbm_fit.findings):
        # All GPUs together would hold the weights, one GPU's share does not: the per-GPU blocker
        # stands, with the options.
        per_gpu = hbm_fit.numbers["weights_per_gpu_bytes"] - hbm_fit.numbers["weight_budget_per_gpu_bytes"]
        options = fit_options(recipe, hbm_fit.numbers, per_gpu * recipe.capture.sglang.tp_size)
        report.findings = [replace(f, options=options) if _per_gpu_verdict(f) else f for f in report.findings]
    elif not streams and (hbm_fit is None or not hbm_fit.blockers):
        report.findings.append(Finding("ok", "the target's weights fit the capture node's accelerator memory"))


def _per_gpu_verdict(finding: Finding) -> bool:
    """The HBM fit's blocker: one GPU's share of the weights exceeds its budget at the TP size."""
    return finding.level == "blocker" and "do not fit" in finding.message


def fit_options(recipe: Recipe, numbers: dict[str, float], shortfall: float) -> tuple[str, ...]:
    """What to do about a target that does not fit, most practical first, each with the exact
    ``--set`` line (or why it is not available); ``numbers`` are the HBM fit's."""
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
