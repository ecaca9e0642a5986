"""The capture prefill split into experts, dense, attention and PCIe: the layer mix as SGLang reads
the target's config, the parts adding up to the capture time, and attention's share growing with
the sequence length."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from launcher.plan import make_plan
from runtime.recipe import Recipe, RecipeError, load_recipe
from runtime.recipe.fit.expert_streaming import streamed_pcie_seconds
from runtime.recipe.fit.prefill import (
    LayerMix,
    full_attention_flops_per_layer,
    layer_mix,
    prefill_split,
)

K3 = Path(__file__).resolve().parent.parent / "recipes" / "kimi_k3_v1c.yaml"


def _at_length(recipe: Recipe, tokens: int) -> Recipe:
    return recipe.model_copy(update={"data": recipe.data.model_copy(update={"max_length": tokens})})


def test_k3_layer_mix_is_read_as_sglang_reads_the_config() -> None:
    recipe = load_recipe(K3).recipe
    # 1-based lists: layer 93 (the last) and every 4th are MLA, the other 69 KDA
    assert layer_mix(recipe) == LayerMix(full_layers=24, linear_layers=69)
    t = recipe.data.max_length
    assert full_attention_flops_per_layer(recipe) == 2.0 * 96 * (128 + 64 + 128) * t * (t + 1) / 2
    without = recipe.model_copy(update={"capture": recipe.capture.model_copy(update={"target_attention": None})})
    assert layer_mix(without) is None and prefill_split(without, 8).attention_seconds == 0.0
    assert "prefill: attention     not counted (capture.target_attention is not set)" in make_plan(without).render()


def test_a_full_attn_list_that_disagrees_with_kda_layers_is_refused() -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(K3, ["capture.target_attention.linear_attn_config.full_attn_layers=[4, 8]"])
    message = str(info.value)
    assert "capture.target_attention.linear_attn_config.full_attn_layers" in message
    assert "lists 2 layers, but the 24 layers not in kda_layers are full attention" in message
    with pytest.raises(RecipeError, match=r"names layers \[94\] outside 1\.\.93"):
        load_recipe(K3, ["capture.target_attention.linear_attn_config.kda_layers=[1, 94]"])


def test_the_split_adds_up_to_the_capture_time_of_the_plan() -> None:
    recipe = load_recipe(K3).recipe
    split = prefill_split(recipe, 8)
    assert split.seconds == pytest.approx(split.expert_seconds + split.dense_seconds + split.attention_seconds)
    assert min(split.expert_seconds, split.dense_seconds, split.attention_seconds) > 0
    plan = make_plan(recipe)
    numbers = plan.numbers
    assert numbers["prefill_compute_s"] == pytest.approx(split.seconds)
    assert numbers["prefill_pcie_s"] == pytest.approx(streamed_pcie_seconds(recipe)) and numbers["prefill_pcie_s"] > 0
    # two engines (one per node) copy their own experts while capturing different samples
    two = make_plan(load_recipe(K3, ["job.capture.nodes=2"]).recipe).numbers
    assert two["prefill_pcie_s"] == pytest.approx(numbers["prefill_pcie_s"] / 2)
    # the copies overlap the compute: the capture takes the longer (the commit is overlapped too)
    assert numbers["capture_s_per_sample"] == pytest.approx(max(split.seconds, numbers["prefill_pcie_s"]))
    text = plan.render()
    for part in ("experts", "dense", "attention", "compute", "PCIe"):
        assert f"prefill: {part}" in text
    assert "24 full (MLA) layers, causal at 65536 tokens" in text and "69 KDA linear layers" in text
    assert "attention not counted" not in text


def test_attention_share_grows_with_the_sequence_length() -> None:
    recipe = load_recipe(K3).recipe
    shares = []
    for tokens in (4096, 16384, 65536):
        split = prefill_split(_at_length(recipe, tokens), 8)
        shares.append(split.attention_seconds / split.seconds)
    assert shares[0] < shares[1] < shares[2]
    assert shares[0] < 0.05 and shares[2] > 0.15  # a few % at 4K, about a fifth of the prefill at 64K


def test_one_trainer_idle_figure_defined_over_the_run() -> None:
    plan = make_plan(load_recipe(K3).recipe)
    text = plan.render()
    idle = plan.numbers["trainer_idle_fraction"]
    n = plan.numbers
    assert idle == pytest.approx(1 - 4608 * n["train_s_per_sample"] / n["run_seconds"])
    assert text.count("trainer idle") == 1 and f"trainer idle             {idle:.0%} of the run" in text
    assert f"expected to idle {idle:.0%} of the time over the run" in text
    assert "trainer idle fraction" not in text
    uncached = make_plan(load_recipe(K3, ["trainer.feature_cache.enabled=false"]).recipe)
    text = uncached.render()
    assert len(set(re.findall(r"idle\s+(\d+)%", text))) == 1, "one idle percentage, in the row and the finding"
    assert f"expected to idle {uncached.numbers['trainer_idle_fraction']:.0%} of the time" in text
