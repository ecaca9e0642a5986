"""MoE benchmarks: MXFP4 experts vs bf16 experts, and the cost of the expert-parallel exchange.

Modes (each prints a ratio against a baseline timed in the same run):

- ``experts`` (default on a GPU): one EP8 rank of Kimi K3 (112 local experts, width 3,584,
  intermediate 3,072, top-16 of 896 experts), 1K..64K tokens per rank: MXFP4 dequantize + grouped
  GEMM vs the same grouped GEMM on resident bf16 weights. TFLOP/s of both and the ratio.
- ``exchange-local``: the single-GPU part of the exchange per token (planning, counts, packing
  the send buffer, expert-major permutation, the two fixed-order weighted sums), vs copying the
  same token bytes once.
- ``exchange-multi``: run under torchrun with N GPUs (NCCL): dispatch and combine latency and
  bandwidth at 128 and 4,096 tokens per rank vs a plain ``all_to_all_single`` of the same bytes.
- ``--quick``: all single-process modes at tiny shapes on CPU (fp32), to prove the tool runs.

Examples::

    python3 -m tools.bench.moe --quick
    python3 -m tools.bench.moe --mode experts --mode exchange-local
    torchrun --nproc-per-node 2 -m tools.bench.moe --mode exchange-multi
    torchrun --nproc-per-node 2 -m tools.bench.moe --quick --mode exchange-multi   # CPU, gloo
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.moe.exchange_nccl import AllToAllExchange
from runtime.moe.experts import DequantWorkspace, LocalExperts
from runtime.moe.mxfp4 import quantize_mxfp4
from runtime.moe.plan import expert_major_order, gather_sum, plan_dispatch
from runtime.moe.routing import TopKRouting


@dataclass(frozen=True)
class Shapes:
    """Expert shapes of one EP rank."""

    hidden: int
    intermediate: int
    local_experts: int
    num_experts: int
    top_k: int
    ep: int


K3 = Shapes(hidden=3584, intermediate=3072, local_experts=112, num_experts=896, top_k=16, ep=8)
QUICK = Shapes(hidden=256, intermediate=128, local_experts=8, num_experts=64, top_k=4, ep=8)


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def random_routing(tokens: int, shapes: Shapes, device: torch.device, seed: int = 0) -> TopKRouting:
    """Uniform top-k routing over all experts (distinct per token), normalized weights."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.empty((tokens, shapes.top_k), dtype=torch.int64)
    step = 8192  # argsort of [tokens, 896] in slices keeps host memory small
    for start in range(0, tokens, step):
        stop = min(start + step, tokens)
        ids[start:stop] = torch.rand(stop - start, shapes.num_experts, generator=gen).argsort(dim=1)[:, : shapes.top_k]
    weights = torch.rand(tokens, shapes.top_k, generator=gen) + 0.1
    return TopKRouting(ids.to(device), (weights / weights.sum(dim=1, keepdim=True)).to(device))


def local_pair_counts(tokens: int, shapes: Shapes, seed: int = 0) -> torch.Tensor:
    """Pairs per local expert when every EP rank brings ``tokens`` tokens routed uniformly: each
    rank receives ``tokens * top_k`` pairs in expectation, spread over its experts."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    owner = torch.randint(0, shapes.local_experts, (tokens * shapes.top_k,), generator=gen)
    return torch.bincount(owner, minlength=shapes.local_experts)


def bench_experts(
    shapes: Shapes, token_counts: list[int], device: torch.device, dtype: torch.dtype, repeats: int
) -> None:
    """MXFP4 dequant + grouped GEMM vs the same GEMM on resident dense weights (bf16 on GPU), per
    tokens-per-rank."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    e, h, i = shapes.local_experts, shapes.hidden, shapes.intermediate
    # Build the MXFP4 weights expert by expert so the fp32 temporaries stay small.
    gate_up_q, down_q = [], []
    for _ in range(e):
        gate_up_q.append(quantize_mxfp4((torch.randn(2 * i, h, generator=gen) / h**0.5).to(device)))
        down_q.append(quantize_mxfp4((torch.randn(h, i, generator=gen) / i**0.5).to(device)))
    from runtime.moe.mxfp4 import MXFP4Tensor

    gate_up = MXFP4Tensor(torch.stack([q.blocks for q in gate_up_q]), torch.stack([q.scales for q in gate_up_q]))
    down = MXFP4Tensor(torch.stack([q.blocks for q in down_q]), torch.stack([q.scales for q in down_q]))
    del gate_up_q, down_q
    workspace = DequantWorkspace()
    mxfp4 = LocalExperts(gate_up, down, compute_dtype=dtype, workspace=workspace)
    dense_gate_up, dense_down = (w.clone() for w in mxfp4.dense_weights())
    dense = LocalExperts(dense_gate_up, dense_down, compute_dtype=dtype)
    print(
        f"experts: {e} local experts, hidden {h}, intermediate {i}, top-{shapes.top_k} of {shapes.num_experts}, "
        f"{dtype}, {device}; resident MXFP4 {mxfp4.resident_bytes / 2**30:.2f} GiB vs dense "
        f"{dense.resident_bytes / 2**30:.2f} GiB (dequant buffer {workspace.nbytes / 2**30:.2f} GiB)"
    )
    dequant_s = timed(lambda: mxfp4.dense_weights(), device, repeats)
    weight_elems = e * 3 * h * i
    print(
        f"  dequantize all {e} experts: {dequant_s * 1e3:.2f} ms ({weight_elems * 2.53 / dequant_s / 1e9:.0f} GB/s moved)"
    )
    print(
        f"  {'tokens/rank':>11} {'pairs':>9} {'dense ms':>9} {'dense TF/s':>10} {'mxfp4 ms':>9} {'mxfp4 TF/s':>10} "
        f"{'dense/mxfp4':>11}  (time ratio: below 1 means MXFP4 is slower)"
    )
    for tokens in token_counts:
        counts = local_pair_counts(tokens, shapes)
        pairs = int(counts.sum())
        rows = torch.randn(pairs, h, device=device, dtype=dtype)
        counts_dev = counts.to(device)
        flops = 2.0 * pairs * (h * 2 * i + i * h)
        dense_s = timed(lambda rows=rows, c=counts_dev: dense(rows, c), device, repeats)
        mx_s = timed(lambda rows=rows, c=counts_dev: mxfp4(rows, c), device, repeats)
        print(
            f"  {tokens:>11,} {pairs:>9,} {dense_s * 1e3:>9.2f} {flops / dense_s / 1e12:>10.1f} "
            f"{mx_s * 1e3:>9.2f} {flops / mx_s / 1e12:>10.1f} {dense_s / mx_s:>11.3f}"
        )
        del rows


def exchange_local_step(hidden: torch.Tensor, routing: TopKRouting, shapes: Shapes) -> torch.Tensor:
    """Everything the exchange does on one GPU for one layer, with the network taken out: plan for
    ``shapes.ep`` ranks, pack the send rows, order the pairs by expert on the receiving side
    (as if this rank's rows came back to it), both weighted sums."""
    plan = plan_dispatch(routing, shapes.local_experts, shapes.ep)
    sent = hidden.index_select(0, plan.send_token_index)
    order = expert_major_order(plan.send_local_ids, shapes.local_experts)
    pairs = sent.index_select(0, order.pair_row)
    partial = gather_sum(pairs, order.slot_pair, plan.send_weights, out_dtype=hidden.dtype)
    return gather_sum(partial, plan.token_rank_row, None, out_dtype=hidden.dtype)


def bench_exchange_local(
    shapes: Shapes, token_counts: list[int], device: torch.device, dtype: torch.dtype, repeats: int
) -> None:
    """Per-token cost of the exchange's local work vs one copy of the same token bytes."""
    print(
        f"exchange-local: EP{shapes.ep}, top-{shapes.top_k} of {shapes.num_experts}, hidden {shapes.hidden}, {dtype}, {device}"
    )
    print(f"  {'tokens':>8} {'rows sent':>10} {'exchange ms':>11} {'ns/token':>9} {'copy ms':>8} {'exchange/copy':>13}")
    for tokens in token_counts:
        hidden = torch.randn(tokens, shapes.hidden, device=device, dtype=dtype)
        routing = random_routing(tokens, shapes, device)
        rows = sum(plan_dispatch(routing, shapes.local_experts, shapes.ep).send_counts)
        step_s = timed(lambda h=hidden, r=routing: exchange_local_step(h, r, shapes), device, repeats)
        copy_s = timed(lambda h=hidden: h.clone(), device, repeats)
        print(
            f"  {tokens:>8,} {rows:>10,} {step_s * 1e3:>11.2f} {step_s / tokens * 1e9:>9.0f} "
            f"{copy_s * 1e3:>8.3f} {step_s / copy_s:>13.1f}"
        )


def bench_exchange_multi(shapes: Shapes, token_counts: list[int], repeats: int, on_cpu: bool = False) -> None:
    """Dispatch/combine vs a plain all_to_all_single of the same bytes, under torchrun: NCCL on
    GPUs, or gloo on CPU (``on_cpu``, the --quick form that proves the mode runs)."""
    if on_cpu:
        device, dtype = torch.device("cpu"), torch.float32
        dist.init_process_group("gloo")
    else:
        device, dtype = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))), torch.bfloat16
        torch.cuda.set_device(device)  # before the NCCL group, so it binds this rank's GPU
        dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    multi = Shapes(
        shapes.hidden, shapes.intermediate, shapes.num_experts // world, shapes.num_experts, shapes.top_k, world
    )
    exchange = AllToAllExchange(dist.group.WORLD, multi.num_experts)
    if rank == 0:
        print(
            f"exchange-multi: {world} ranks ({dist.get_backend()}), top-{multi.top_k} of {multi.num_experts}, "
            f"hidden {multi.hidden}, {dtype}"
        )
        print(
            f"  {'tokens/rank':>11} {'rows sent':>9} {'dispatch ms':>11} {'combine ms':>10} {'GB/s':>7} "
            f"{'a2a ms':>7} {'a2a GB/s':>8} {'(d+c)/(2 a2a)':>13}"
        )
    for tokens in token_counts:
        hidden = torch.randn(tokens, multi.hidden, device=device, dtype=dtype)
        routing = random_routing(tokens, multi, device, seed=rank)
        batch = exchange.dispatch(hidden, routing)
        expert_out = batch.tokens.clone()
        dispatch_s = timed(lambda h=hidden, r=routing: exchange.dispatch(h, r), device, repeats, warmup=2)
        combine_s = timed(lambda b=batch, y=expert_out: exchange.combine(y, b), device, repeats, warmup=2)
        rows_sent = sum(batch.state.plan.send_counts)
        payload = rows_sent * multi.hidden * hidden.element_size()
        # Baseline: the same number of bytes in one even all_to_all_single; its splits must match
        # on every rank, so all use the largest rank's row count.
        largest = torch.tensor([rows_sent], dtype=torch.int64, device=device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        per_peer = -(-int(largest.item()) // world)
        flat = torch.randn(per_peer * world, multi.hidden, device=device, dtype=dtype)
        out = torch.empty_like(flat)
        a2a_s = timed(lambda o=out, f=flat: dist.all_to_all_single(o, f), device, repeats, warmup=2)
        stats = torch.tensor(
            [dispatch_s, combine_s, a2a_s, float(payload), float(rows_sent)], dtype=torch.float64, device=device
        )
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank sets the layer's pace
        d, c, a, nbytes, rows = stats.tolist()
        if rank == 0:
            print(
                f"  {tokens:>11,} {int(rows):>9,} {d * 1e3:>11.3f} {c * 1e3:>10.3f} {nbytes / d / 1e9:>7.1f} "
                f"{a * 1e3:>7.3f} {nbytes / a / 1e9:>8.1f} {(d + c) / (2 * a):>13.2f}"
            )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and run the chosen benchmarks."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", action="append", choices=["experts", "exchange-local", "exchange-multi"])
    parser.add_argument("--quick", action="store_true", help="tiny shapes on CPU (fp32): proves the tool runs")
    parser.add_argument("--tokens", type=int, nargs="+", help="tokens per rank (defaults depend on the mode)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per point (median reported)")
    args = parser.parse_args(argv)
    if args.quick:
        device, dtype = torch.device("cpu"), torch.float32
        modes = args.mode or ["experts", "exchange-local"]
        tokens = args.tokens or [256, 1024]
        if "exchange-multi" in modes:  # torchrun on CPU over gloo
            bench_exchange_multi(QUICK, tokens, args.repeats, on_cpu=True)
            return 0
        if "experts" in modes:
            bench_experts(QUICK, tokens, device, dtype, args.repeats)
        if "exchange-local" in modes:
            bench_exchange_local(QUICK, tokens, device, dtype, args.repeats)
        return 0
    modes = args.mode or ["experts", "exchange-local"]
    if "exchange-multi" in modes:
        bench_exchange_multi(K3, args.tokens or [128, 4096], args.repeats)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA GPU here: use --quick for the CPU form", file=sys.stderr)
        return 2
    device, dtype = torch.device("cuda"), torch.bfloat16
    if "experts" in modes:
        bench_experts(K3, args.tokens or [1024, 4096, 16384, 65536], device, dtype, args.repeats)
    if "exchange-local" in modes:
        bench_exchange_local(K3, args.tokens or [1024, 8192, 65536], device, dtype, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
