"""The capture GPUs' memory plan for SGLang recipes (runtime/recipe/fit/capture_hbm.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from runtime.recipe.fit.capture_hbm import capture_hbm_fit, offload_support_0_5_23
from runtime.recipe.fit.expert_routing import K3_ROUTED_EXPERTS, K3_TOP_K, untouched_expert_fraction
from runtime.recipe.fit.report import Finding
from runtime.recipe.loader import load_recipe

K3 = Path(__file__).resolve().parent.parent / "recipes" / "kimi_k3_v1c.yaml"
GB = 10**9


NO_STREAMING = ["capture.expert_streaming.enabled=false"]


def test_k3_on_one_h200_node_does_not_fit_and_0_5_23_offers_no_offload() -> None:
    recipe = load_recipe(K3, NO_STREAMING).recipe
    plan = capture_hbm_fit(recipe)
    assert plan is not None
    levels = [f.level for f in plan.findings]
    assert levels == ["blocker"]
    text = plan.findings[0].message
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
    assert capture_hbm_fit(two_nodes).findings == [Finding("ok", "the weights fit resident: 97.5 GB per GPU at TP16")]
    b300 = load_recipe(K3, ["plan.accelerator=B300", "plan.accelerator_memory_bytes=288GB", *NO_STREAMING]).recipe
    assert capture_hbm_fit(b300).findings[0].level == "ok"
    b200 = load_recipe(K3, ["plan.accelerator=B200", "plan.accelerator_memory_bytes=192GB", *NO_STREAMING]).recipe
    assert capture_hbm_fit(b200).findings[-1].level == "blocker"


def test_tp_size_must_cover_the_capture_gpus() -> None:
    # Two capture nodes at TP8: a server per node (two capture shares), no blocker.
    per_node = capture_hbm_fit(load_recipe(K3, ["job.capture.nodes=2"]).recipe)
    assert not per_node.blockers
    # TP12 on two 8-GPU nodes fits neither a server per node nor one across both.
    recipe = load_recipe(K3, ["job.capture.nodes=2", "capture.sglang.tp_size=12"]).recipe
    plan = capture_hbm_fit(recipe)
    assert plan.findings[0] == Finding(
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
    assert capture_hbm_fit(tiny) is None


def test_k3_fits_with_streaming_and_the_plan_shows_the_numbers() -> None:
    recipe = load_recipe(K3).recipe
    plan = capture_hbm_fit(recipe)
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
    levels = {f.message.split(":")[0]: f.level for f in plan.findings}
    assert levels["fits with streaming"] == "ok"
    assert not plan.blockers
    assert any(f.level == "warn" and "not yet on a GPU" in f.message for f in plan.findings), "the plan is honest"
    rows = dict(plan.rows)
    assert rows["resident vs streamed per GPU"].startswith("78.8 GB resident + 5.9 GB buffers")


def test_a_streaming_budget_above_the_hbm_budget_is_a_blocker() -> None:
    plan = capture_hbm_fit(load_recipe(K3, ["capture.expert_streaming.gpu_budget_bytes=95GB"]).recipe)
    (message,) = [f.message for f in plan.blockers]
    assert "94.6 GB of experts and buffers" in message and "102.2 GB weight budget" in message
    assert "at most 88.4 GB" in message
    by_fraction = load_recipe(
        K3, ["capture.expert_streaming.gpu_budget_bytes=null", "capture.expert_streaming.resident_fraction=0.6"]
    ).recipe
    assert any("weight budget" in f.message for f in capture_hbm_fit(by_fraction).blockers)


def test_the_eval_decode_estimate_is_copy_bound_and_names_the_batch_that_makes_it_reasonable() -> None:
    from runtime.recipe.fit.eval_decode import PLANNING_ACCEPTANCE_LENGTH, estimate
    from runtime.recipe.fit.expert_streaming import target_streaming_split

    recipe = load_recipe(K3).recipe
    split = target_streaming_split(recipe)
    assert split is not None
    one, many = (estimate(recipe, split, K3_TOP_K, K3_ROUTED_EXPERTS, b) for b in (1, 128))
    # one request: its 8 tokens x top-16 touch about 13% of 896 experts per layer
    assert one.step_seconds == pytest.approx(split.host_bytes * (1 - (1 - 1 / 896) ** 128) / 50e9)
    # 128 requests touch every expert: the step costs one full pass of the streamed bytes, shared
    assert many.step_seconds == pytest.approx(split.host_bytes / 50e9, rel=1e-6)
    assert many.tokens_per_s == pytest.approx(128 * PLANNING_ACCEPTANCE_LENGTH / many.step_seconds)
    assert many.tokens_per_s > 10 * one.tokens_per_s
    rows = dict(capture_hbm_fit(recipe).rows)  # type: ignore[union-attr]
    assert rows["eval batch for 1 h"].startswith("eval.batch_size >= 64")
    assert "batch 128: 2.05 s/step, 250 tok/s, 0.3 h" in rows["eval decode (streamed)"]
