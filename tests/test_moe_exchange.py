"""The MoE exchange: pure planning on one process, then EP = 1, 2, 4 over a real gloo group
against the single-process dense MoE."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.moe.exchange_nccl import AllToAllExchange
from runtime.moe.experts import LocalExperts
from runtime.moe.layer import ExpertParallelMoE, dense_moe_reference
from runtime.moe.mxfp4 import dequantize_reference, quantize_mxfp4
from runtime.moe.plan import expert_major_order, gather_sum, plan_dispatch
from runtime.moe.routing import TopKRouting, route_topk
from runtime.transport.loopback import free_port

# ----------------------------------------------------------------------------------------------
# planning (one process)
# ----------------------------------------------------------------------------------------------


def _routing(ids: list[list[int]], weights: list[list[float]] | None = None) -> TopKRouting:
    ids_t = torch.tensor(ids, dtype=torch.int64)
    w = torch.tensor(weights, dtype=torch.float32) if weights is not None else torch.full(ids_t.shape, 0.5)
    return TopKRouting(ids_t, w)


def test_plan_sends_one_row_per_token_and_rank_even_when_topk_repeats_a_rank() -> None:
    # 2 ranks x 2 experts. Token 0: experts 0 and 1 (both rank 0); token 1: 3 and 0; token 2: 2, 3.
    routing = _routing([[0, 1], [3, 0], [2, 3]], [[0.6, 0.4], [0.7, 0.3], [0.1, 0.9]])
    plan = plan_dispatch(routing, experts_per_rank=2, world_size=2)
    assert plan.send_counts == [2, 2]
    assert plan.send_token_index.tolist() == [0, 1, 1, 2]  # rank 0: tokens 0, 1; rank 1: tokens 1, 2
    assert plan.send_local_ids.tolist() == [[0, 1], [-1, 0], [1, -1], [0, 1]]
    expected_weights = torch.tensor([[0.6, 0.4], [0.0, 0.3], [0.7, 0.0], [0.1, 0.9]])
    assert torch.equal(plan.send_weights, expected_weights)
    assert plan.token_rank_row.tolist() == [[0, -1], [1, 2], [-1, 3]]


def test_plan_handles_no_tokens_and_unused_slots() -> None:
    empty = TopKRouting(torch.empty((0, 3), dtype=torch.int64), torch.empty((0, 3)))
    plan = plan_dispatch(empty, experts_per_rank=4, world_size=2)
    assert plan.send_counts == [0, 0] and plan.send_token_index.numel() == 0
    unused = plan_dispatch(_routing([[-1, 5], [-1, -1]]), experts_per_rank=4, world_size=2)
    assert unused.send_counts == [0, 1] and unused.send_local_ids.tolist() == [[-1, 1]]
    with pytest.raises(ValueError, match="outside -1..7"):
        plan_dispatch(_routing([[8, 0]]), experts_per_rank=4, world_size=2)


def test_expert_major_order_groups_pairs_by_expert_and_leaves_empty_experts_empty() -> None:
    local_ids = torch.tensor([[2, -1, 0], [0, 2, -1], [-1, -1, 2]], dtype=torch.int32)
    order = expert_major_order(local_ids, num_local_experts=4)
    assert order.tokens_per_expert.tolist() == [2, 0, 3, 0]
    assert order.pair_row.tolist() == [0, 1, 0, 1, 2]  # expert 0: rows 0, 1; expert 2: rows 0, 1, 2
    assert order.slot_pair.tolist() == [[2, -1, 0], [1, 3, -1], [-1, -1, 4]]


def test_gather_sum_is_fixed_order_and_ignores_missing_entries_even_next_to_inf() -> None:
    values = torch.tensor([[1.0, 2.0], [10.0, 20.0], [float("inf"), 0.0]])
    index = torch.tensor([[1, 0], [-1, 1], [-1, -1]])
    weights = torch.tensor([[2.0, 3.0], [0.0, 1.0], [1.0, 1.0]])
    out = gather_sum(values, index, weights, chunk_rows=2)
    assert out.tolist() == [[23.0, 46.0], [10.0, 20.0], [0.0, 0.0]]


def test_single_process_exchange_matches_dense_moe_bitwise_with_router() -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up, down = torch.randn(8, 64, 32, generator=gen) / 6, torch.randn(8, 32, 32, generator=gen) / 6
    hidden = torch.randn(33, 32, generator=gen)
    layer = ExpertParallelMoE(
        torch.randn(8, 32, generator=gen), LocalExperts(gate_up, down), AllToAllExchange(None, 8), 3
    )
    routing = layer.route(hidden)
    assert torch.equal(routing.expert_ids, route_topk(hidden @ layer.router_weight.t(), 3).expert_ids)
    torch.testing.assert_close(layer(hidden), dense_moe_reference(hidden, routing, gate_up, down), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# EP = 1, 2, 4 over a real 4-process gloo group
# ----------------------------------------------------------------------------------------------

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 32, 32, 3
# Skewed routing: only experts 0, 1, 2, 5 are ever chosen. At EP = 4 (two experts per rank) rank 3
# receives nothing, experts 3, 4, 6, 7 get no tokens, and a token routed to 0 and 1 sends one row to
# rank 0 for two slots. Tokens per rank are uneven and rank 1 brings none at EP = 4.
HOT_EXPERTS = (0, 1, 2, 5)
TOKENS_PER_RANK = {1: [40], 2: [27, 13], 4: [17, 0, 15, 8]}
LARGE_TOKENS_PER_RANK = [70_000, 5]  # EP = 2, past 65,535 tokens on rank 0


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN**0.5
    down = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE**0.5
    return gate_up, down


def _inputs(num_tokens: int, seed: int) -> tuple[torch.Tensor, TopKRouting]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    hot = torch.tensor(HOT_EXPERTS)
    choice = torch.rand(num_tokens, len(HOT_EXPERTS), generator=gen).argsort(dim=1)[:, :TOP_K]
    weights = torch.rand(num_tokens, TOP_K, generator=gen) + 0.1
    return hidden, TopKRouting(hot[choice], weights / weights.sum(dim=1, keepdim=True))


def _run_layer(
    rank: int, ep: int, group: dist.ProcessGroup, tokens_per_rank: list[int], seed: int, mxfp4: bool
) -> dict[str, object]:
    gate_up, down = _weights(seed)
    hidden, routing = _inputs(sum(tokens_per_rank), seed + 1)
    start = sum(tokens_per_rank[:rank])
    mine = slice(start, start + tokens_per_rank[rank])
    epr = NUM_EXPERTS // ep
    shard = slice(rank * epr, (rank + 1) * epr)
    if mxfp4:
        experts = LocalExperts(quantize_mxfp4(gate_up)[shard], quantize_mxfp4(down)[shard], compute_dtype=torch.float32)
    else:
        experts = LocalExperts(gate_up[shard], down[shard])
    exchange = AllToAllExchange(group, NUM_EXPERTS)
    layer = ExpertParallelMoE(torch.zeros(NUM_EXPERTS, HIDDEN), experts, exchange, TOP_K)
    local_routing = TopKRouting(routing.expert_ids[mine], routing.weights[mine])
    batch = exchange.dispatch(hidden[mine], local_routing)
    out = layer(hidden[mine], local_routing)
    again = layer(hidden[mine], local_routing)
    return {
        "out": out,
        "bitwise_repeatable": torch.equal(out, again),
        "received_pairs": int(batch.tokens.shape[0]),
        "tokens_per_expert": batch.tokens_per_expert.tolist(),
    }


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 4: dist.group.WORLD}
        results: dict[str, object] = {}
        for ep, group in groups.items():
            if rank < ep:
                for mxfp4 in (False, True):
                    results[f"ep{ep}_{'mxfp4' if mxfp4 else 'dense'}"] = _run_layer(
                        rank, ep, group, TOKENS_PER_RANK[ep], seed=11, mxfp4=mxfp4
                    )
            dist.barrier()
        if rank < 2:
            results["large"] = _run_layer(rank, 2, groups[2], LARGE_TOKENS_PER_RANK, seed=21, mxfp4=True)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, object]]]:
    out_dir = tmp_path_factory.mktemp("moe_ep")
    mp.spawn(_worker, args=(4, free_port(), str(out_dir)), nprocs=4, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(4)]


def _dense_expected(tokens_per_rank: list[int], seed: int, mxfp4: bool) -> torch.Tensor:
    gate_up, down = _weights(seed)
    if mxfp4:
        gate_up = dequantize_reference(quantize_mxfp4(gate_up), torch.float32)
        down = dequantize_reference(quantize_mxfp4(down), torch.float32)
    hidden, routing = _inputs(sum(tokens_per_rank), seed + 1)
    return dense_moe_reference(hidden, routing, gate_up, down)


@pytest.mark.distributed
@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("kind", ["dense", "mxfp4"])
def test_expert_parallel_equals_dense_moe(ep_results: list[dict], ep: int, kind: str) -> None:
    key = f"ep{ep}_{kind}"
    outs = [ep_results[r][key]["out"] for r in range(ep)]
    expected = _dense_expected(TOKENS_PER_RANK[ep], seed=11, mxfp4=kind == "mxfp4")
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-5, atol=1e-5)
    assert all(ep_results[r][key]["bitwise_repeatable"] for r in range(ep))


@pytest.mark.distributed
def test_skewed_routing_left_ranks_and_experts_empty(ep_results: list[dict]) -> None:
    # The routing must really exercise the edge cases the equality test claims to cover.
    per_rank = [ep_results[r]["ep4_dense"] for r in range(4)]
    assert per_rank[3]["received_pairs"] == 0 and per_rank[3]["tokens_per_expert"] == [0, 0]
    assert per_rank[1]["tokens_per_expert"][0] > 0 and per_rank[1]["tokens_per_expert"][1] == 0
    assert per_rank[2]["tokens_per_expert"][0] == 0 and per_rank[2]["tokens_per_expert"][1] > 0
    assert per_rank[1]["out"].shape == (0, HIDDEN)


@pytest.mark.distributed
def test_more_than_65535_tokens_through_mxfp4_experts(ep_results: list[dict]) -> None:
    outs = [ep_results[r]["large"]["out"] for r in range(2)]
    assert outs[0].shape == (LARGE_TOKENS_PER_RANK[0], HIDDEN)
    expected = _dense_expected(LARGE_TOKENS_PER_RANK, seed=21, mxfp4=True)
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-5, atol=1e-5)
    assert ep_results[0]["large"]["received_pairs"] > 65_535
