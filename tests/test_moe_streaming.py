"""Routed experts streamed from host memory (runtime/moe/streaming*): the budget arithmetic and its
refusals, the store's buffer reuse and prefetch order, and models whose experts are streamed giving
bit-identical outputs to the same models with every expert resident (HF experts, LocalExperts
dense and MXFP4, expert-parallel layer). The CUDA path (pinned memory, copy stream, events) runs
in the ``gpu`` tests."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeModel

from runtime.moe.exchange_nccl import AllToAllExchange
from runtime.moe.experts import LocalExperts
from runtime.moe.hf_adapter import shard_moe_experts
from runtime.moe.layer import ExpertParallelMoE
from runtime.moe.mxfp4 import quantize_mxfp4
from runtime.moe.routing import route_topk
from runtime.moe.streaming import StreamedExpertStore
from runtime.moe.streaming_modules import find_expert_modules, stream_experts
from runtime.recipe.streaming_budget import (
    StreamingBudgetError,
    check_host_memory,
    split_layers,
    spread_resident,
)

GB = 10**9


# ---------------------------------------------------------------------------------------------
# budget arithmetic


def test_budget_keeps_buffers_and_as_many_layers_as_fit() -> None:
    split = split_layers(10, 2 * GB, prefetch_layers=1, gpu_budget_bytes=9 * GB)
    # 9 GB - 2 buffers x 2 GB = 5 GB -> 2 resident layers, 8 streamed
    assert (split.num_buffers, split.resident_layers, split.streamed_layers) == (2, 2, 8)
    assert split.device_bytes == 8 * GB and split.host_bytes == 16 * GB
    assert split.device_bytes <= 9 * GB
    assert split.streamed_fraction == pytest.approx(0.8)


def test_a_budget_that_holds_everything_streams_nothing() -> None:
    split = split_layers(4, GB, gpu_budget_bytes=4 * GB)
    assert split.resident == (True,) * 4 and split.num_buffers == 0 and split.host_bytes == 0


def test_deeper_prefetch_takes_more_buffers() -> None:
    split = split_layers(10, GB, prefetch_layers=3, gpu_budget_bytes=6 * GB)
    assert (split.num_buffers, split.resident_layers) == (4, 2)


def test_a_budget_below_the_buffers_is_refused_with_both_numbers() -> None:
    with pytest.raises(StreamingBudgetError) as caught:
        split_layers(10, 2 * GB, prefetch_layers=2, gpu_budget_bytes=5 * GB)
    text = str(caught.value)
    assert "capture.expert_streaming.gpu_budget_bytes is 5.00 GB" in text
    assert "3 streaming buffers" in text and "6.00 GB" in text and "fix:" in text


def test_resident_fraction_and_even_spread() -> None:
    split = split_layers(8, GB, resident_fraction=0.25)
    assert split.resident_layers == 2 and split.num_buffers == 2
    assert spread_resident(8, 2) == (False, False, False, True, False, False, False, True)
    assert sum(spread_resident(93, 23)) == 23
    assert spread_resident(3, 0) == (False,) * 3 and spread_resident(3, 3) == (True,) * 3
    with pytest.raises(ValueError, match="exactly one"):
        split_layers(8, GB, resident_fraction=0.5, gpu_budget_bytes=GB)


def test_host_memory_check_names_every_part_and_the_total() -> None:
    assert check_host_memory({"experts": GB}, 2 * GB, node="capture", host_field="plan.x") is None
    error = check_host_memory(
        {"streamed experts": 1500 * GB, "Mooncake segment": 1100 * GB}, 2048 * GB, node="capture", host_field="plan.x"
    )
    assert error is not None
    text = str(error)
    assert "plan.x is 2,048.00 GB" in text and "1,500.00 GB" in text and "2,600.00 GB" in text


# ---------------------------------------------------------------------------------------------
# the store (CPU path: synchronous copies)


def _layers(count: int) -> list[dict[str, torch.Tensor]]:
    return [{"a": torch.full((4, 3), float(i)), "b": torch.arange(6, dtype=torch.uint8) + i} for i in range(count)]


def test_store_returns_each_layers_bytes_through_reused_buffers() -> None:
    layers = _layers(6)
    split = split_layers(6, 1, resident_fraction=1 / 3)
    store = StreamedExpertStore(copy.deepcopy(layers), split, "cpu")
    pointers = set()
    for _ in range(3):  # three forwards: wrap-around prefetch
        for layer in range(6):
            with store.layer(layer) as weights:
                assert torch.equal(weights["a"], layers[layer]["a"]) and torch.equal(weights["b"], layers[layer]["b"])
                if not split.resident[layer]:
                    pointers.add(weights["a"].data_ptr())
    assert len(pointers) == split.num_buffers == 2  # no allocation per layer
    assert store.stats.misses == 1  # only the very first streamed layer was not prefetched
    assert store.stats.copies == 3 * split.streamed_layers + split.num_buffers  # + the next forward's first
    assert store.host_bytes == split.streamed_layers * (12 * 4 + 6)


def test_store_is_correct_out_of_order_and_refuses_nested_acquires() -> None:
    layers = _layers(5)
    store = StreamedExpertStore(copy.deepcopy(layers), split_layers(5, 1, resident_fraction=0.0), "cpu")
    for layer in (3, 0, 4, 4, 1, 2):
        with store.layer(layer) as weights:
            assert torch.equal(weights["a"], layers[layer]["a"])
    assert store.stats.misses >= 2
    store.acquire(1)
    with pytest.raises(RuntimeError, match="still acquired"):
        store.acquire(2)
    with pytest.raises(RuntimeError, match="release of MoE layer 2"):
        store.release(2)


def test_store_refuses_streamed_layers_of_different_shapes() -> None:
    layers = _layers(3)
    layers[2]["a"] = torch.zeros(5, 3)
    with pytest.raises(ValueError, match="same names, shapes and dtypes"):
        StreamedExpertStore(layers, split_layers(3, 1, resident_fraction=0.0), "cpu")


# ---------------------------------------------------------------------------------------------
# models with streamed experts equal the same models all-resident


def _tiny_hf_model(num_layers: int = 4) -> Qwen3MoeModel:
    config = Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[],
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return Qwen3MoeModel(config).float().eval()


@pytest.mark.parametrize("resident_fraction", [0.0, 0.25, 1.0])
def test_hf_model_with_streamed_experts_is_bit_identical(resident_fraction: float) -> None:
    model = _tiny_hf_model()
    streamed = copy.deepcopy(model)
    store = stream_experts(streamed, "cpu", resident_fraction=resident_fraction)
    assert find_expert_modules(streamed) == []  # weights left the modules
    assert all(layer.mlp.experts.gate_up_proj is None for layer in streamed.layers)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).last_hidden_state
        for _ in range(2):
            assert torch.equal(streamed(ids).last_hidden_state, expected)
    assert store.stats.acquires == 8
    assert store.split.streamed_layers == 4 - int(4 * resident_fraction)


def test_a_budget_too_small_for_the_buffers_is_refused_by_stream_experts() -> None:
    model = _tiny_hf_model()
    layer_bytes = sum(
        p.numel() * 4 for p in (model.layers[0].mlp.experts.gate_up_proj, model.layers[0].mlp.experts.down_proj)
    )
    with pytest.raises(StreamingBudgetError, match="below the 2 streaming buffers"):
        stream_experts(model, "cpu", gpu_budget_bytes=layer_bytes + 1)


@pytest.mark.parametrize("quantized", [False, True])
def test_expert_parallel_layers_with_streamed_local_experts_are_bit_identical(quantized: bool) -> None:
    torch.manual_seed(2)
    layers = []
    for _ in range(3):
        gate_up, down = torch.randn(8, 64, 32) * 0.1, torch.randn(8, 32, 32) * 0.1
        if quantized:
            gate_up, down = quantize_mxfp4(gate_up), quantize_mxfp4(down)
        experts = LocalExperts(gate_up, down, compute_dtype=torch.float32)
        layers.append(ExpertParallelMoE(torch.randn(8, 32), experts, AllToAllExchange(None, 8), top_k=2))
    stack = torch.nn.Sequential(*layers)
    streamed = copy.deepcopy(stack)
    store = stream_experts(streamed, "cpu", resident_fraction=0.0)
    assert store.split.streamed_layers == 3
    hidden = torch.randn(20, 32)
    with torch.no_grad():
        assert torch.equal(streamed(hidden), stack(hidden))
        assert torch.equal(streamed(hidden), stack(hidden))


def test_sharded_hf_model_streams_its_local_experts() -> None:
    model = _tiny_hf_model(3)
    reference = copy.deepcopy(model)
    shard_moe_experts(reference, None)
    shard_moe_experts(model, None)
    stream_experts(model, "cpu", resident_fraction=0.0)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(model(ids).last_hidden_state, reference(ids).last_hidden_state)


class _FusedMoELike(torch.nn.Module):
    """A serving engine's fused-MoE layer after its repack: packed weights and scales as parameters
    that its kernel reads by attribute at every forward."""

    def __init__(self, experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        q13, q2 = (
            quantize_mxfp4(torch.randn(experts, 2 * inter, hidden)),
            quantize_mxfp4(torch.randn(experts, hidden, inter)),
        )
        for name, tensor in (
            ("w13_weight", q13.blocks),
            ("w13_weight_scale", q13.scales),
            ("w2_weight", q2.blocks),
            ("w2_weight_scale", q2.scales),
        ):
            self.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from runtime.moe.mxfp4 import MXFP4Tensor, dequantize_reference

        w13 = dequantize_reference(MXFP4Tensor(self.w13_weight, self.w13_weight_scale), torch.float32)
        w2 = dequantize_reference(MXFP4Tensor(self.w2_weight, self.w2_weight_scale), torch.float32)
        gate, up = torch.einsum("th,eih->eti", x, w13).chunk(2, dim=-1)
        return x + torch.einsum("eti,ehi->th", torch.nn.functional.silu(gate) * up, w2) * 1e-3


def _fused_moe_names(module: torch.nn.Module) -> tuple[str, ...] | None:
    if not isinstance(module, _FusedMoELike):
        return None
    return tuple(name for name, _ in module.named_parameters(recurse=False) if name.startswith(("w13_", "w2_")))


def test_other_expert_layouts_stream_through_a_weight_names_function() -> None:
    torch.manual_seed(5)
    stack = torch.nn.Sequential(*(_FusedMoELike(4, 64, 32) for _ in range(4)))
    streamed = copy.deepcopy(stack)
    store = stream_experts(streamed, "cpu", resident_fraction=0.25, weight_names=_fused_moe_names)
    assert store.split.streamed_layers == 3 and streamed[0].w13_weight is None
    x = torch.randn(6, 64)
    with torch.no_grad():
        assert torch.equal(streamed(x), stack(x)) and torch.equal(streamed(x), stack(x))


def test_a_model_without_experts_is_refused() -> None:
    with pytest.raises(ValueError, match="expert_streaming.enabled: false"):
        stream_experts(torch.nn.Linear(2, 2), "cpu", resident_fraction=0.0)


# ---------------------------------------------------------------------------------------------
# CUDA: pinned host memory, copy stream, events


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch_layers", [1, 2])
def test_cuda_store_streams_pinned_layers_on_a_copy_stream(prefetch_layers: int) -> None:
    torch.manual_seed(3)
    num_layers, experts, hidden, inter = 6, 8, 256, 128
    weights = [  # small weights and a normed input per layer: the residual stays finite over 12 layers
        {"gate_up": torch.randn(experts, 2 * inter, hidden) * 0.05, "down": torch.randn(experts, hidden, inter) * 0.05}
        for _ in range(num_layers)
    ]
    routers = [torch.randn(experts, hidden, device="cuda") for _ in range(num_layers)]
    split = split_layers(num_layers, 1, prefetch_layers=prefetch_layers, resident_fraction=1 / 6)
    store = StreamedExpertStore(weights, split, "cuda", pinned=True, time_copies=True)
    assert all(store._weights[i]["gate_up"].is_pinned() for i in store._order)
    resident = [LocalExperts(w["gate_up"].cuda(), w["down"].cuda()) for w in weights]
    x = torch.randn(4096, hidden, device="cuda")
    streamed_x, resident_x = x, x
    for _ in range(2):
        for layer in range(num_layers):
            routing = route_topk(resident_x @ routers[layer].t(), 2)
            counts = torch.bincount(routing.expert_ids[:, 0], minlength=experts)
            order = torch.argsort(routing.expert_ids[:, 0], stable=True)
            streamed_in = torch.nn.functional.rms_norm(streamed_x, (hidden,))[order]
            resident_in = torch.nn.functional.rms_norm(resident_x, (hidden,))[order]
            with store.layer(layer) as w:
                experts_module = LocalExperts(w["gate_up"], w["down"])
                streamed_x = streamed_x + experts_module(streamed_in, counts)[torch.argsort(order)]
            resident_x = resident_x + resident[layer](resident_in, counts)[torch.argsort(order)]
        assert bool(torch.isfinite(resident_x).all()) and torch.equal(streamed_x, resident_x)
    torch.cuda.synchronize()
    assert store.stats.misses == 1 and store.copy_seconds() > 0
