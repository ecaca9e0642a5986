"""Causal attention at a long prefill, with MLA-like head sizes: the rate the plan's
``plan.attention_tflops`` stands for, against a bf16 matmul timed in the same run.

K3's full-attention layers are MLA: in a prefill each of the 96 heads attends with a 192-wide
query/key (128 without and 64 with rotary embedding) and a 128-wide value; at TP8 one GPU holds 12
heads. The benchmark times one layer's attention of one GPU over a causal prefill of T tokens:

- ``sdpa``: ``scaled_dot_product_attention(is_causal=True)`` with qk 192 / v 128 (whichever backend
  PyTorch picks for unequal head sizes);
- ``sdpa-padded``: the same with the value padded to 192 (equal head sizes allow the flash backend;
  the FLOPs counted stay those of v 128, so padding's waste lowers the rate);
- ``flex``: ``flex_attention`` with a causal block mask (compiled), qk 192 / v 128;
- ``matmul``: an 8192^3 bf16 matmul, the baseline.

FLOPs counted: the causal half of QK^T and PV, ``2 x heads x (d_qk + d_v) x T (T + 1) / 2`` (the
plan's formula, runtime/recipe/fit/prefill.py). It prints TFLOP/s of each and its share of the
matmul rate, and the line to put into the recipe. ``--quick`` runs tiny shapes on the CPU (fp32) to
prove the tool runs; its numbers mean nothing.

Examples::

    python3 -m tools.bench.attention                    # one GPU: T = 65536, 12 heads
    python3 -m tools.bench.attention --tokens 16384 65536 --heads 12
    python3 -m tools.bench.attention --quick
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from runtime.user_errors import exit_without_package

try:  # a stock python3 instead of the venv's: one line, not a traceback
    import torch
    import torch.nn.functional as F

    from tools.bench.moe import timed
except ModuleNotFoundError as _missing:
    exit_without_package(_missing, "tools.bench.attention")

QK_HEAD_DIM = 192
"""K3's MLA query/key width per head in a prefill: qk_nope_head_dim 128 + qk_rope_head_dim 64."""
V_HEAD_DIM = 128
"""K3's MLA value width per head."""
HEADS_PER_GPU = 12
"""K3's 96 attention heads at TP8."""


def causal_attention_flops(heads: int, tokens: int, qk_dim: int, v_dim: int) -> float:
    """FLOPs of QK^T and PV over the causal half of a ``tokens`` x ``tokens`` score matrix."""
    return 2.0 * heads * (qk_dim + v_dim) * tokens * (tokens + 1) / 2


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    """TFLOP/s of a ``size``^3 matmul: the baseline of this run."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = timed(lambda: a @ b, device, repeats, warmup=2)
    return 2.0 * size**3 / seconds / 1e12


def attention_variants(
    heads: int, tokens: int, device: torch.device, dtype: torch.dtype
) -> dict[str, Callable[[], object]]:
    """The timed callables of one shape (inputs made once)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, heads, tokens, QK_HEAD_DIM, generator=gen).to(device, dtype)
    k = torch.randn(1, heads, tokens, QK_HEAD_DIM, generator=gen).to(device, dtype)
    v = torch.randn(1, heads, tokens, V_HEAD_DIM, generator=gen).to(device, dtype)
    v_padded = F.pad(v, (0, QK_HEAD_DIM - V_HEAD_DIM))
    variants: dict[str, Callable[[], object]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa-padded": lambda: F.scaled_dot_product_attention(q, k, v_padded, is_causal=True),
    }
    flex = _flex_variant(q, k, v, tokens, device)
    if flex is not None:
        variants["flex"] = flex
    return variants


def _flex_variant(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: int, device: torch.device
) -> Callable[[], object] | None:
    """Compiled flex attention with a causal block mask (None where it cannot run: no compiler)."""
    if device.type != "cuda":
        return None
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, tokens, tokens, device=str(device))
    compiled = torch.compile(flex_attention)
    return lambda: compiled(q, k, v, block_mask=mask)


def run(args: argparse.Namespace) -> dict:
    """Time every variant at every length; print and return the results."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    repeats = 1 if args.quick else args.repeats
    tokens_list = [256] if args.quick else args.tokens
    heads = 2 if args.quick else args.heads
    baseline = matmul_tflops(device, dtype, 256 if args.quick else 8192, repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device {name}, {dtype}, torch {torch.__version__}; matmul baseline {baseline:,.1f} TFLOP/s")
    results: dict = {"device": name, "torch": torch.__version__, "matmul_tflops": baseline, "runs": []}
    for tokens in tokens_list:
        flops = causal_attention_flops(heads, tokens, QK_HEAD_DIM, V_HEAD_DIM)
        for variant, fn in attention_variants(heads, tokens, device, dtype).items():
            try:
                seconds = timed(fn, device, repeats, warmup=2)
            except (RuntimeError, NotImplementedError) as exc:  # a backend that refuses the shape
                print(f"  T={tokens:>6} {variant:<12} failed: {str(exc).splitlines()[0]}")
                continue
            tflops = flops / seconds / 1e12
            results["runs"].append({"tokens": tokens, "variant": variant, "seconds": seconds, "tflops": tflops})
            print(
                f"  T={tokens:>6} {variant:<12} {seconds * 1e3:9.2f} ms  {tflops:7.1f} TFLOP/s  "
                f"({tflops / baseline:.0%} of the matmul)  [{heads} heads, qk {QK_HEAD_DIM}, v {V_HEAD_DIM}, causal]"
            )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    longest = [r for r in results["runs"] if r["tokens"] == max(tokens_list)]
    if longest:
        best = max(longest, key=lambda r: r["tflops"])
        print(
            f"plan.attention_tflops: {best['tflops']:.0f}   # {best['variant']} at T={best['tokens']} on {name}; "
            f"matmul {baseline:.0f} TFLOP/s in the same run"
        )
    return results


def main(argv: list[str] | None = None) -> int:
    """Command line entry."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[65536], help="prefill lengths")
    parser.add_argument("--heads", type=int, default=HEADS_PER_GPU, help="heads on one GPU (K3 at TP8: 12)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: proves the tool runs")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    results = run(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
