"""The capture-node memory plan for SGLang recipes (runtime/shared/sglang_fit.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from runtime.recipe.loader import load_recipe
from runtime.shared.sglang_fit import (
    K3_ROUTED_EXPERTS,
    K3_TOP_K,
    expert_offload_plan,
    offload_support_0_5_23,
    untouched_expert_fraction,
)

K3 = Path(__file__).resolve().parent.parent / "recipes" / "kimi_k3_v1c.yaml"
GB = 10**9


NO_STREAMING = ["capture.expert_streaming.enabled=false"]


def test_k3_on_one_h200_node_does_not_fit_and_0_5_23_offers_no_offload() -> None:
    recipe = load_recipe(K3, NO_STREAMING).recipe
    plan = expert_offload_plan(recipe)
    assert plan is not None
    levels = [level for level, _ in plan.findings]
    assert levels == ["blocker"]
    text = plan.findings[0][1]
    assert "do not fit 8 x H200 at TP8" in text
    assert "single-GPU only" in text and "MXFP4 Marlin repack" in text and "--offload-group-size" in text
    n = plan.numbers
    assert n["weights_per_gpu_bytes"] == pytest.approx(1.56e12 / 8)
    budget = 141 * GB * 0.76 - 5 * GB
    assert n["weight_budget_per_gpu_bytes"] == pytest.approx(budget)
    dense_per_gpu = (1.56e12 - 1.45e12) / 8
    offloaded = 1.45e12 - (budget - dense_per_gpu) * 8
    assert n["offloaded_expert_bytes"] == pytest.approx(offloaded)
    assert 0.45 < n["resident_expert_fraction"] < 0.55
    # every expert is routed to in a 64K prefill, so all offloaded bytes cross PCIe each prefill
    assert n["pcie_bytes_per_prefill"] == pytest.approx(offloaded)
    assert n["pcie_seconds_per_prefill"] == pytest.approx(offloaded / 8 / (50 * GB))
    segment = 2**40
    assert n["host_bytes_offload"] == pytest.approx(offloaded + segment)
    assert n["host_bytes_paged"] == pytest.approx(1.45e12 + segment) and n["host_bytes_paged"] > 2 * 2**40
    rows = dict(plan.rows)
    assert "fits" in rows["alternative: 2 capture nodes, TP16"]
    assert rows["alternative: 8 x B300 (288 GB)"].startswith("195.0 GB per GPU of 213.9 GB (fits")


def test_the_alternatives_fit() -> None:
    two_nodes = load_recipe(K3, ["job.capture.nodes=2", "capture.sglang.tp_size=16", *NO_STREAMING]).recipe
    assert expert_offload_plan(two_nodes).findings == [("ok", "the weights fit resident: 97.5 GB per GPU at TP16")]
    b300 = load_recipe(K3, ["plan.accelerator=B300", "plan.accelerator_memory_bytes=288GB", *NO_STREAMING]).recipe
    assert expert_offload_plan(b300).findings[0][0] == "ok"
    b200 = load_recipe(K3, ["plan.accelerator=B200", "plan.accelerator_memory_bytes=192GB", *NO_STREAMING]).recipe
    assert expert_offload_plan(b200).findings[-1][0] == "blocker"


def test_tp_size_must_cover_the_capture_gpus() -> None:
    # Two capture nodes at TP8: a server per node (two capture shares), no blocker.
    per_node = expert_offload_plan(load_recipe(K3, ["job.capture.nodes=2"]).recipe)
    assert not [m for level, m in per_node.findings if level == "blocker"]
    # TP12 on two 8-GPU nodes fits neither a server per node nor one across both.
    recipe = load_recipe(K3, ["job.capture.nodes=2", "capture.sglang.tp_size=12"]).recipe
    plan = expert_offload_plan(recipe)
    assert plan.findings[0] == (
        "blocker",
        "capture.sglang.tp_size is 12 but the capture group has 16 GPUs (2 node(s) x 8) for 1 server(s); set "
        "tp_size to 8 (a server per node) or 16 (one server across the nodes)",
    )


def test_untouched_expert_fraction() -> None:
    assert untouched_expert_fraction(1, K3_TOP_K, K3_ROUTED_EXPERTS) == pytest.approx((1 - 1 / 896) ** 16)
    assert untouched_expert_fraction(65536, K3_TOP_K, K3_ROUTED_EXPERTS) < 1e-300
    assert untouched_expert_fraction(56, 16, 896) == pytest.approx(math.exp(-1.0), rel=1e-3)


def test_paged_experts_would_be_allowed_only_for_single_gpu_non_marlin() -> None:
    single = load_recipe(
        K3,
        [
            "job.capture.gpus_per_node=1",
            "capture.sglang.tp_size=1",
            "capture.sglang.moe_runner_backend=triton",
            *NO_STREAMING,
        ],
    ).recipe
    reasons = offload_support_0_5_23(single)
    assert not any("paged" in r for r in reasons)
    assert any("--offload-group-size" in r for r in reasons)


def test_embedded_recipes_have_no_sglang_plan() -> None:
    tiny = load_recipe(Path(K3).parent / "tiny.yaml").recipe
    assert expert_offload_plan(tiny) is None


def test_k3_fits_with_streaming_and_the_plan_shows_the_numbers() -> None:
    recipe = load_recipe(K3).recipe
    plan = expert_offload_plan(recipe)
    assert plan is not None
    n = plan.numbers
    layer = math.ceil(1.45e12 / 92 / 8)
    assert n["streaming_layer_bytes_per_gpu"] == layer
    # 85 GB budget - 3 buffers (prefetch 2 + 1) -> 40 resident layers, 52 streamed
    assert (n["streaming_resident_layers"], n["streaming_streamed_layers"]) == (40, 52)
    assert n["streaming_resident_bytes_per_gpu"] + n["streaming_buffer_bytes_per_gpu"] <= 85 * GB
    assert n["streaming_host_bytes_per_gpu"] == 52 * layer
    assert n["streaming_hbm_bytes_per_gpu"] <= 141 * GB * 0.76 - 5 * GB
    assert n["capture_host_bytes"] == 8 * 52 * layer + 2**40
    assert n["pcie_bytes_per_prefill_per_gpu"] == pytest.approx(52 * layer)
    assert n["pcie_seconds_per_prefill"] == pytest.approx(52 * layer / (50 * GB))
    expert_flops = 2 * 65536 * (1.45e12 * 8 / 4.25) * 16 / 896 / 8
    assert n["expert_compute_seconds_per_prefill"] == pytest.approx(expert_flops / 500e12)
    levels = dict((message.split(":")[0], level) for level, message in plan.findings)
    assert levels["fits with streaming"] == "ok"
    assert not [m for level, m in plan.findings if level == "blocker"]
    assert any(level == "warning" and "not yet on a GPU" in m for level, m in plan.findings), "the plan is honest"
    rows = dict(plan.rows)
    assert rows["resident vs streamed per GPU"].startswith("78.8 GB resident + 5.9 GB buffers")


def test_a_streaming_budget_above_the_hbm_budget_is_a_blocker() -> None:
    plan = expert_offload_plan(load_recipe(K3, ["capture.expert_streaming.gpu_budget_bytes=95GB"]).recipe)
    (message,) = [m for level, m in plan.findings if level == "blocker"]
    assert "94.6 GB of experts and buffers" in message and "102.2 GB weight budget" in message
    assert "at most 88.4 GB" in message
    by_fraction = load_recipe(
        K3, ["capture.expert_streaming.gpu_budget_bytes=null", "capture.expert_streaming.resident_fraction=0.6"]
    ).recipe
    assert any("weight budget" in m for level, m in expert_offload_plan(by_fraction).findings if level == "blocker")
