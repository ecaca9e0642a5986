"""Choosing the MoE exchange, start-up validation of the low-latency backends, and the
low-latency glue (chunking, layout conversion) on one process."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
import torch

import runtime.moe.experts as experts_module
from runtime.moe.exchange import ExchangeUnavailableError
from runtime.moe.exchange_limits import (
    STOCK_LIMITS,
    ExchangeShapeError,
    ExchangeShapes,
    beyond_limits,
    hard_problems,
    shape_error,
)
from runtime.moe.exchange_low_latency import LowLatencyExchange, packed_to_padded, padded_to_packed
from runtime.moe.exchange_nccl import AllToAllExchange
from runtime.moe.experts import LocalExperts
from runtime.moe.layer import ExpertParallelMoE, dense_moe_reference
from runtime.moe.mxfp4 import dequantize_reference, quantize_mxfp4
from runtime.moe.routing import TopKRouting
from runtime.moe.selection import add_moe_exchange_argument, chosen_exchange, make_exchange

K3_SHAPES = ExchangeShapes(hidden_size=3584, top_k=16, num_experts=896, world_size=8, max_tokens_per_rank=128)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_moe_exchange_argument(parser)
    return parser


def test_command_line_flag_overrides_the_recipe() -> None:
    assert chosen_exchange(_parser().parse_args([]), "nccl") == "nccl"
    assert chosen_exchange(_parser().parse_args([]), "mooncake") == "mooncake"
    assert chosen_exchange(_parser().parse_args(["--k3-moe-exchange", "deepep"]), "nccl") == "deepep"
    with pytest.raises(SystemExit):
        _parser().parse_args(["--k3-moe-exchange", "pplx"])


def test_nccl_is_built_without_extra_packages() -> None:
    exchange = make_exchange("nccl", None, num_experts=8, hidden_size=64, top_k=2)
    assert isinstance(exchange, AllToAllExchange) and exchange.experts_per_rank == 8


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None, reason="deep_ep is installed here")
def test_deepep_without_the_package_fails_with_the_fix() -> None:
    with pytest.raises(ExchangeUnavailableError, match=r"import deep_ep.*--k3-moe-exchange nccl"):
        make_exchange("deepep", None, num_experts=896, hidden_size=3584, top_k=16)


def test_mooncake_without_ep_support_fails_with_the_fix() -> None:
    try:
        import mooncake.ep  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("this Mooncake was built with EP support")
    with pytest.raises(ExchangeUnavailableError, match=r"mooncake\.ep.*capture\.moe_exchange: nccl"):
        make_exchange("mooncake", None, num_experts=896, hidden_size=3584, top_k=16)


def test_k3_shapes_are_beyond_stock_limits_and_the_message_says_why_and_how_to_fix() -> None:
    problems = beyond_limits(K3_SHAPES, STOCK_LIMITS["deepep"])
    assert len(problems) == 2
    message = str(shape_error("deepep", K3_SHAPES, problems, detail="EPException: Unsupported hidden"))
    for needle in (
        "hidden 3584 is not one of",
        "top-k 16 is above the compiled maximum 11",
        "Unsupported hidden",
        "--k3-moe-exchange nccl",
        "capture.moe_exchange: nccl",
        "896 experts over 8 ranks",
    ):
        assert needle in message, needle
    fits = ExchangeShapes(7168, 8, 256, 8, 128)
    assert beyond_limits(fits, STOCK_LIMITS["deepep"]) == [] and hard_problems(fits, STOCK_LIMITS["mooncake"]) == []


def test_layout_rules_no_build_can_change_are_hard_errors() -> None:
    bad = ExchangeShapes(hidden_size=3500, top_k=16, num_experts=896, world_size=6, max_tokens_per_rank=4096)
    problems = hard_problems(bad, STOCK_LIMITS["mooncake"])
    assert any("do not split evenly" in p for p in problems)
    assert any("not a multiple of 128" in p for p in problems)
    assert any("above the kernel's 1024" in p for p in problems)
    assert hard_problems(bad, STOCK_LIMITS["deepep"]) and not any(
        "1024" in p for p in hard_problems(bad, STOCK_LIMITS["deepep"])
    )


def test_padded_layout_round_trip_keeps_rows_grouped_by_expert() -> None:
    recv_x = torch.arange(3 * 4 * 2, dtype=torch.float32).reshape(3, 4, 2)
    counts = torch.tensor([2, 0, 4], dtype=torch.int32)
    rows, counts64, valid = padded_to_packed(recv_x, counts)
    assert counts64.dtype == torch.int64 and rows.tolist() == [[0, 1], [2, 3], [16, 17], [18, 19], [20, 21], [22, 23]]
    back = packed_to_padded(rows * 10, valid, recv_x)
    assert back[0, :2].tolist() == [[0, 10], [20, 30]] and bool((back[1] == 0).all()) and bool((back[0, 2:] == 0).all())


class _SingleRankKernels(LowLatencyExchange):
    """The low-latency kernel contract (DeepEP's documented layout and weighted combine), written
    out for one rank in plain torch, to test this package's chunking and layout glue on CPU."""

    name = "deepep"

    def _make_buffer(self) -> None:
        self.dispatch_calls = 0

    def _kernel_dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, object]:
        assert x.shape[0] <= self.max_tokens_per_rank and x.dtype == torch.bfloat16
        self.dispatch_calls += 1
        cap = self.max_tokens_per_rank * self.world_size
        recv = torch.zeros((self.experts_per_rank, cap, x.shape[1]), dtype=x.dtype)
        counts = torch.zeros(self.experts_per_rank, dtype=torch.int32)
        sources = []
        for t in range(x.shape[0]):
            for j, e in enumerate(expert_ids[t].tolist()):
                recv[e, counts[e]] = x[t]
                sources.append((e, int(counts[e]), t, j))
                counts[e] += 1
        return recv, counts, (sources, x.shape[0])

    def _kernel_combine(
        self, expert_out: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, handle: object
    ) -> torch.Tensor:
        sources, num_tokens = handle
        out = torch.zeros((num_tokens, expert_out.shape[2]))
        for e, slot, t, j in sources:
            out[t] += weights[t, j] * expert_out[e, slot].float()
        return out.to(torch.bfloat16)


def test_low_latency_run_chunks_prefill_and_dequantizes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(4)
    num_experts, hidden, inter, top_k, tokens = 4, 2048, 32, 2, 300
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    q_gate_up, q_down = quantize_mxfp4(gate_up), quantize_mxfp4(down)
    experts = LocalExperts(q_gate_up, q_down, compute_dtype=torch.bfloat16)
    exchange = _SingleRankKernels(None, num_experts, hidden, top_k, max_tokens_per_rank=128)
    layer = ExpertParallelMoE(torch.zeros(num_experts, hidden), experts, exchange, top_k)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
    ids[:, 0] = torch.where(ids[:, 1] == 0, 1, 0)  # expert 0 is hot; ids stay distinct per token
    w = torch.rand(tokens, top_k, generator=gen) + 0.1
    routing = TopKRouting(ids, w / w.sum(dim=1, keepdim=True))
    dequant_calls = []
    real = experts_module.dequantize_into
    monkeypatch.setattr(experts_module, "dequantize_into", lambda t, out: dequant_calls.append(1) or real(t, out))
    out = layer(x, routing)
    assert exchange.dispatch_calls == 3  # 128 + 128 + 44 tokens
    assert len(dequant_calls) == 2  # gate_up and down, once for all three chunks
    expected = dense_moe_reference(
        x, routing, dequantize_reference(q_gate_up, torch.float32), dequantize_reference(q_down, torch.float32)
    )
    torch.testing.assert_close(out.float(), expected, rtol=0.05, atol=0.05)
    with pytest.raises(ValueError, match="use run"):
        exchange.dispatch(x, routing)


def test_low_latency_backends_reject_layout_errors_before_touching_the_kernels() -> None:
    with pytest.raises(ExchangeShapeError, match="not a multiple of 128"):
        _SingleRankKernels(None, 4, 100, 2)


@pytest.mark.gpu
def test_deepep_at_k3_shapes_fails_cleanly_or_works() -> None:
    """On a GPU machine with DeepEP: K3 shapes either pass the start-up probe (a patched build)
    or raise the clear ExchangeShapeError, never a crash."""
    pytest.importorskip("deep_ep")
    import torch.distributed as dist

    from runtime.transport.loopback import free_port

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        exchange = make_exchange("deepep", None, num_experts=896, hidden_size=3584, top_k=16)
        assert exchange.accepted_beyond_stock_limits
    except ExchangeShapeError as exc:
        assert "--k3-moe-exchange nccl" in str(exc)
    finally:
        dist.destroy_process_group()
