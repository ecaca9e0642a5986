"""Expert streaming inside the SGLang server, without SGLang (runtime/capture/sglang_streaming.py).

A stand-in for SGLang's fused-MoE layer (the attributes the helper recognises it by, weights read
at forward time as SGLang's quant methods do) is built the way SGLang builds a model: under a
default device, each layer's weights created by ``create_weights`` inside
:func:`expert_weights_device`. The streamed layers' weights must land in host memory while the
others follow the default device, and after :func:`attach_expert_streaming` the outputs must equal
the all-resident model's bit for bit. The real server runs in tests/test_sglang_server.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from runtime.capture import sglang_streaming
from runtime.capture.sglang_streaming import (
    ExpertStreamingSetupError,
    attach_expert_streaming,
    expert_weights_device,
    sglang_expert_weights,
)
from runtime.recipe.loader import load_recipe, write_resolved

REPO = Path(__file__).resolve().parent.parent
EXPERTS, HIDDEN, WIDTH, LAYERS = 4, 8, 6, 8


class FakeFusedMoE(nn.Module):
    """SGLang's FusedMoE as the helper sees it: num_local_experts, quant_method, [E, ...] weights."""

    def __init__(self, recipe_path: str, seed: int) -> None:
        super().__init__()
        self.num_local_experts = EXPERTS
        self.quant_method = object()
        self.scale = nn.Parameter(torch.ones(HIDDEN), requires_grad=False)  # not per expert: stays put
        with expert_weights_device(recipe_path):
            gen = torch.Generator().manual_seed(seed)
            self.w13_weight = nn.Parameter(
                0.2 * torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, generator=gen), requires_grad=False
            )
            self.w2_weight = nn.Parameter(0.2 * torch.randn(EXPERTS, HIDDEN, WIDTH, generator=gen), requires_grad=False)
            self.devices = (torch.empty(0).device, self.w13_weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert = int(x[0].argmax()) % EXPERTS  # an input-dependent expert, as a router would pick
        gate, up = (x @ self.w13_weight[expert].T).chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gate) * up) @ self.w2_weight[expert].T * self.scale


class FakeModel(nn.Module):
    def __init__(self, recipe_path: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(FakeFusedMoE(recipe_path, seed=i) for i in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def resolved_tiny(tmp_path: Path, *overrides: str) -> str:
    loaded = load_recipe(REPO / "recipes" / "tiny.yaml", list(overrides))
    return str(write_resolved(loaded, tmp_path / f"job{len(os.listdir(tmp_path))}", REPO))


STREAMING = ["capture.expert_streaming.enabled=true", "capture.expert_streaming.resident_fraction=0.25"]


def test_streamed_layers_are_created_in_host_memory_and_compute_exactly_like_resident(tmp_path: Path) -> None:
    plain_path = resolved_tiny(tmp_path)
    streamed_path = resolved_tiny(tmp_path, *STREAMING)
    with torch.device("meta"):  # what the loader's device context is for the layers that stay resident
        probe = FakeModel(streamed_path)
    sglang_streaming._PLANS.clear()
    placed = [layer.w13_weight.device.type for layer in probe.layers]
    assert placed.count("cpu") == 6 and placed.count("meta") == 2, placed  # 25% of 8 layers resident
    assert all(layer.scale.device.type == "meta" for layer in probe.layers), "only expert tensors move"

    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(7))
    reference = FakeModel(plain_path)(x)
    sglang_streaming._PLANS.clear()
    model = FakeModel(streamed_path)
    store = attach_expert_streaming(model, streamed_path, "cpu")
    assert store is not None and store.split.streamed_layers == 6 and store.split.num_buffers == 2
    assert "w13_weight" not in dict(model.layers[0].named_parameters()), "the store owns the expert weights"
    assert torch.equal(model(x), reference)
    assert torch.equal(model(x), reference), "buffers are reused on the second pass"
    assert store.stats.copies >= 6
    assert attach_expert_streaming(model, streamed_path, "cpu") is store, "idempotent"


def test_streaming_off_changes_nothing_and_a_layer_count_mismatch_is_named(tmp_path: Path) -> None:
    sglang_streaming._PLANS.clear()
    plain_path = resolved_tiny(tmp_path)
    model = FakeModel(plain_path)
    assert attach_expert_streaming(model, plain_path, "cpu") is None
    assert sglang_expert_weights(model.layers[0]) == ("w13_weight", "w2_weight")
    assert sglang_expert_weights(model) is None

    wrong = resolved_tiny(tmp_path, *STREAMING, "capture.num_moe_layers=6")
    sglang_streaming._PLANS.clear()
    with pytest.raises(ExpertStreamingSetupError, match="more than 6 MoE layers.*capture.num_moe_layers"):
        FakeModel(wrong)
    sglang_streaming._PLANS.clear()
