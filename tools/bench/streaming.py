"""Routed experts streamed from pinned host memory vs all resident, in the same run (``capture.expert_streaming``).

A random MoE stack in MXFP4 (by default 32 layers of one Kimi K3 EP8 rank's experts: 112 experts,
width 3,584, intermediate 3,072, 1.97 GB per layer, 62.9 GB in all) runs a prefill of T tokens:
per layer, RMS norm -> top-k router -> pairs sorted by expert -> dequant-once MXFP4 grouped GEMM
(runtime/moe LocalExperts) -> deterministic weighted combine -> residual add. Two stores of the
same weights (runtime/moe/streaming.py): all layers resident, and a GPU budget that keeps a
quarter of the layers resident and streams the rest from pinned host memory through
``prefetch_layers + 1`` reused device buffers on a copy stream.

Printed, per T (4K, 16K, 64K): the prefill time of both and the throughput ratio
streamed / resident (goal >= 0.9 at 16K and 64K); that the outputs are equal (bitwise);
the host-to-device bandwidth the store's copies achieved (copy-stream time from CUDA events) as a
ratio to a plain pinned copy of one layer timed in the same run (goal >= 0.8); and the per-layer
expert compute time against the per-layer copy time, which bounds what overlap can hide.

Examples::

    python3 -m tools.bench.streaming                     # H200: the K3-rank stack, 62.9 GB of experts
    python3 -m tools.bench.streaming --prefetch-layers 2 --tokens 16384,65536
    python3 -m tools.bench.streaming --quick             # CPU, tiny shapes: proves the tool runs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.moe.experts import DequantWorkspace, LocalExperts
from runtime.moe.mxfp4 import MXFP4Tensor
from runtime.moe.streaming import LayerWeights, StreamedExpertStore
from runtime.recipe.streaming_budget import split_layers
from tools.bench.moe import timed


@dataclass(frozen=True)
class StackShapes:
    """The random MoE stack."""

    layers: int
    experts: int
    hidden: int
    intermediate: int
    top_k: int


K3_RANK = StackShapes(layers=32, experts=112, hidden=3584, intermediate=3072, top_k=2)
"""One EP8 rank of K3 (112 of 896 experts; top-16 of 896 gives each rank 2 pairs per token)."""
QUICK = StackShapes(layers=5, experts=4, hidden=64, intermediate=32, top_k=2)


def random_mxfp4(shape: tuple[int, ...], device: torch.device, gen: torch.Generator) -> MXFP4Tensor:
    """Random packed E2M1 values with E8M0 scales 2^-8..2^-5 (weights of magnitude ~0.01-0.2)."""
    *lead, k = shape
    blocks = torch.randint(0, 256, (*lead, k // 2), dtype=torch.uint8, device=device, generator=gen)
    scales = torch.randint(119, 123, (*lead, k // 32), dtype=torch.uint8, device=device, generator=gen)
    return MXFP4Tensor(blocks, scales)


def build_layers(shapes: StackShapes, device: torch.device, seed: int) -> tuple[list[LayerWeights], list[torch.Tensor]]:
    """Expert weights (MXFP4 blocks + scales, the dequant-once kernel's format) and routers per layer."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shapes.experts, shapes.hidden, shapes.intermediate
    layers, routers = [], []
    started = time.monotonic()
    for index in range(shapes.layers):
        gate_up = random_mxfp4((e, 2 * i, h), device, gen)
        down = random_mxfp4((e, h, i), device, gen)
        layers.append(
            {
                "gate_up_blocks": gate_up.blocks,
                "gate_up_scales": gate_up.scales,
                "down_blocks": down.blocks,
                "down_scales": down.scales,
            }
        )
        routers.append(torch.randn(e, h, device=device, generator=gen) / h**0.5)
        if (index + 1) % 8 == 0 or index + 1 == shapes.layers:
            rate = (index + 1) / max(time.monotonic() - started, 1e-9)
            print(
                f"  built {index + 1}/{shapes.layers} layers ({rate:.1f} layers/s, "
                f"ETA {(shapes.layers - index - 1) / rate:.0f} s)",
                flush=True,
            )
    return layers, routers


def layer_bytes(weights: LayerWeights) -> int:
    """Bytes of one layer's expert weights."""
    return sum(t.numel() * t.element_size() for t in weights.values())


class Stack:
    """The MoE stack's prefill over a store (resident or streamed: the same code)."""

    def __init__(self, store: StreamedExpertStore, routers: list[torch.Tensor], shapes: StackShapes, dtype) -> None:
        self.store = store
        self.routers = [r.to(dtype) for r in routers]
        self.shapes = shapes
        self.dtype = dtype
        self.workspace = DequantWorkspace()

    def layer(self, index: int, x: torch.Tensor) -> torch.Tensor:
        k = self.shapes.top_k
        normed = F.rms_norm(x, (x.shape[-1],))
        probs = torch.softmax(F.linear(normed, self.routers[index]).float(), dim=-1)
        weights, ids = probs.topk(k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.shapes.experts)
        rows = normed.index_select(0, order // k)
        with self.store.layer(index) as w:
            experts = LocalExperts(
                MXFP4Tensor(w["gate_up_blocks"], w["gate_up_scales"]),
                MXFP4Tensor(w["down_blocks"], w["down_scales"]),
                compute_dtype=self.dtype,
                workspace=self.workspace,
            )
            out_pairs = experts(rows, counts)
        unsorted = torch.empty_like(out_pairs)
        unsorted[order] = out_pairs  # every index once: deterministic
        combined = (unsorted.view(x.shape[0], k, -1).float() * weights.unsqueeze(-1)).sum(dim=1)
        return x + combined.to(x.dtype)

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        for index in range(self.shapes.layers):
            x = self.layer(index, x)
        return x


def plain_pinned_copy_bytes_per_s(weights: LayerWeights, device: torch.device, repeats: int) -> float:
    """Bandwidth of copying one layer's tensors from pinned host memory to the device, nothing else
    running (the baseline of the achieved-bandwidth ratio)."""
    pinned = device.type == "cuda"
    host = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned).copy_(t) for n, t in weights.items()}
    target = {n: torch.empty_like(t, device=device) for n, t in host.items()}

    def copy() -> None:
        for name, tensor in host.items():
            target[name].copy_(tensor, non_blocking=pinned)

    copy()
    seconds = timed(copy, device, repeats, warmup=0)
    return layer_bytes(weights) / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (fp32): proves the tool runs")
    parser.add_argument("--tokens", default=None, help="comma-separated prefill lengths (default 4096,16384,65536)")
    parser.add_argument("--layers", type=int, default=None, help="MoE layers (default 32: 62.9 GB of experts)")
    parser.add_argument("--resident-fraction", type=float, default=0.25, help="share of layers kept resident")
    parser.add_argument("--prefetch-layers", type=int, default=1, help="streamed layers the copy stream runs ahead")
    parser.add_argument("--repeats", type=int, default=3, help="timed prefills per length and mode (median)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    if args.quick:
        device, dtype, shapes = torch.device("cpu"), torch.float32, QUICK
        tokens = [16, 48]
    else:
        if not torch.cuda.is_available():
            print("tools.bench.streaming needs a CUDA GPU (use --quick on a CPU)", file=sys.stderr)
            return 2
        device, dtype, shapes = torch.device("cuda"), torch.bfloat16, K3_RANK
        tokens = [4096, 16384, 65536]
    if args.layers:
        shapes = StackShapes(args.layers, shapes.experts, shapes.hidden, shapes.intermediate, shapes.top_k)
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]

    print(f"streaming bench: {shapes}, {dtype}, {device}; torch {torch.__version__}", flush=True)
    layers, routers = build_layers(shapes, device, seed=0)
    per_layer = layer_bytes(layers[0])
    total = per_layer * shapes.layers
    resident = StreamedExpertStore(layers, split_layers(shapes.layers, per_layer, resident_fraction=1.0), device)
    split = split_layers(
        shapes.layers, per_layer, prefetch_layers=args.prefetch_layers, resident_fraction=args.resident_fraction
    )
    started = time.monotonic()
    streamed = StreamedExpertStore(layers, split, device, pinned=True, time_copies=True)
    print(
        f"experts: {total / 1e9:.1f} GB in {shapes.layers} layers of {per_layer / 1e9:.3f} GB; streamed store: "
        f"{streamed.describe()} (host copies made in {time.monotonic() - started:.1f} s)",
        flush=True,
    )
    host_fraction = streamed.host_bytes / total
    baseline_bw = plain_pinned_copy_bytes_per_s(layers[split.resident.index(False)], device, repeats=5)
    print(f"plain pinned host-to-device copy of one layer: {baseline_bw / 1e9:.1f} GB/s", flush=True)

    resident_stack = Stack(resident, routers, shapes, dtype)
    streamed_stack = Stack(streamed, routers, shapes, dtype)
    results = []
    for t in tokens:
        gen = torch.Generator(device=device).manual_seed(t)
        x = torch.randn(t, shapes.hidden, device=device, dtype=dtype, generator=gen)
        with torch.no_grad():
            expected = resident_stack.prefill(x)  # warm-up + reference
            got = streamed_stack.prefill(x)  # warm-up (first forward: a cold miss) + check
            equal = bool(torch.equal(expected, got))
            resident_s = timed(lambda x=x: resident_stack.prefill(x), device, args.repeats, warmup=0)
            streamed.copy_seconds()  # drop the warm-up's copy timings
            copied_before = streamed.stats.copied_bytes
            streamed_s = timed(lambda x=x: streamed_stack.prefill(x), device, args.repeats, warmup=0)
            copy_s = streamed.copy_seconds()
        copied = streamed.stats.copied_bytes - copied_before
        achieved_bw = copied / copy_s if copy_s > 0 else float("nan")
        compute_per_layer = resident_s / shapes.layers
        copy_per_layer = per_layer / baseline_bw
        row = {
            "tokens": t,
            "resident_s": resident_s,
            "streamed_s": streamed_s,
            "throughput_ratio": resident_s / streamed_s,
            "outputs_equal": equal,
            "achieved_h2d_bytes_per_s": achieved_bw,
            "h2d_ratio_to_plain_copy": achieved_bw / baseline_bw,
            "expert_compute_s_per_layer": compute_per_layer,
            "copy_s_per_streamed_layer": copy_per_layer,
            "copy_bound_ratio": min(1.0, resident_s / (split.streamed_layers * copy_per_layer)),
        }
        results.append(row)
        print(
            f"  T={t:>6,}: resident {resident_s * 1e3:8.1f} ms ({t / resident_s:,.0f} tok/s), streamed "
            f"{streamed_s * 1e3:8.1f} ms ({t / streamed_s:,.0f} tok/s): ratio {row['throughput_ratio']:.3f}; "
            f"outputs equal: {equal}; H2D {achieved_bw / 1e9:.1f} GB/s = {row['h2d_ratio_to_plain_copy']:.2f} x plain"
            f"{' (no copy stream on a CPU)' if device.type == 'cpu' else ''}; "
            f"compute {compute_per_layer * 1e3:.2f} ms/layer vs copy {copy_per_layer * 1e3:.2f} ms/streamed layer "
            f"(copy-bound ceiling {row['copy_bound_ratio']:.3f})",
            flush=True,
        )
    summary = {
        "shapes": asdict(shapes),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "expert_bytes": total,
        "layer_bytes": per_layer,
        "resident_layers": split.resident_layers,
        "streamed_layers": split.streamed_layers,
        "host_fraction": host_fraction,
        "prefetch_layers": args.prefetch_layers,
        "num_buffers": split.num_buffers,
        "plain_pinned_copy_bytes_per_s": baseline_bw,
        "misses": streamed.stats.misses,
        "results": results,
    }
    print(
        f"summary: {total / 1e9:.1f} GB of experts, {host_fraction:.0%} on the host; "
        + ", ".join(f"T={r['tokens']}: {r['throughput_ratio']:.3f}" for r in results)
        + f"; all outputs equal: {all(r['outputs_equal'] for r in results)}",
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if all(r["outputs_equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
