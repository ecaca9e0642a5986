"""Shape limits of the low-latency MoE kernels (DeepEP, Mooncake EP) and the start-up check.

Those kernels are compiled for a fixed list of hidden sizes and a maximum top-k; a shape outside
them fails deep inside a CUDA extension (or worse). Kimi K3 dispatches at the latent expert width
3,584 with top-16, which stock builds lack, so the check runs before the first
layer and names the shapes, the build's limits and the fix.

The limits are compile-time constants that the packages do not export, so the check uses the
stock limits below; shapes beyond them are then tried once on the real kernels by the backend
(a patched build may accept them, see :func:`runtime.moe.exchange_low_latency.LowLatencyExchange`),
and only a failure of that probe is an error.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

STOCK_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
"""Hidden sizes the stock low-latency kernels are compiled for (no 3,584)."""
STOCK_MAX_TOP_K = 11
"""Largest top-k the stock low-latency kernels accept."""
HIDDEN_ALIGNMENT = 128
"""Both kernels move tokens in 128-element groups (the FP8 scale granularity)."""


@dataclass(frozen=True)
class KernelLimits:
    """What one build of a low-latency kernel accepts."""

    hidden_sizes: tuple[int, ...]
    max_top_k: int
    max_tokens_per_rank: int | None
    """Largest ``num_max_dispatch_tokens_per_rank`` (None: bounded only by memory)."""
    description: str


STOCK_LIMITS = {
    "deepep": KernelLimits(STOCK_HIDDEN_SIZES, STOCK_MAX_TOP_K, None, "stock DeepEP low-latency kernels"),
    # Mooncake EP counts tokens per rank against a 1,024 tag in its dispatch.
    "mooncake": KernelLimits(STOCK_HIDDEN_SIZES, STOCK_MAX_TOP_K, 1024, "stock Mooncake EP low-latency kernels"),
}

DISTRIBUTIONS = {
    "deepep": ("deep_ep", "deep-ep"),
    "mooncake": ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"),
}


@dataclass(frozen=True)
class ExchangeShapes:
    """The shapes one MoE layer will push through the exchange."""

    hidden_size: int
    top_k: int
    num_experts: int
    world_size: int
    max_tokens_per_rank: int


class ExchangeShapeError(ValueError):
    """The chosen MoE exchange cannot take this model's shapes."""


def installed_version(backend: str) -> str:
    """Version of the installed package behind ``backend`` ('unknown version' if not found)."""
    for name in DISTRIBUTIONS.get(backend, ()):
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"{backend} (unknown version)"


def hard_problems(shapes: ExchangeShapes, limits: KernelLimits) -> list[str]:
    """Problems no build can get around (layout rules of the kernels themselves)."""
    out = []
    if shapes.num_experts % shapes.world_size:
        out.append(f"{shapes.num_experts} experts do not split evenly over {shapes.world_size} ranks")
    if shapes.hidden_size % HIDDEN_ALIGNMENT:
        out.append(f"hidden {shapes.hidden_size} is not a multiple of {HIDDEN_ALIGNMENT}")
    if limits.max_tokens_per_rank is not None and shapes.max_tokens_per_rank > limits.max_tokens_per_rank:
        out.append(
            f"max tokens per rank per dispatch {shapes.max_tokens_per_rank} is above the kernel's "
            f"{limits.max_tokens_per_rank}"
        )
    if shapes.max_tokens_per_rank < 1:
        out.append(f"max tokens per rank per dispatch must be >= 1, got {shapes.max_tokens_per_rank}")
    return out


def beyond_limits(shapes: ExchangeShapes, limits: KernelLimits) -> list[str]:
    """Shapes outside what ``limits`` were compiled for (a patched build may still take them)."""
    out = []
    if shapes.hidden_size not in limits.hidden_sizes:
        out.append(f"hidden {shapes.hidden_size} is not one of the compiled hidden sizes {list(limits.hidden_sizes)}")
    if shapes.top_k > limits.max_top_k:
        out.append(f"top-k {shapes.top_k} is above the compiled maximum {limits.max_top_k}")
    return out


def shape_error(
    backend: str, shapes: ExchangeShapes, problems: list[str], detail: str = "", fix: str | None = None
) -> ExchangeShapeError:
    """One clear error: which backend, which build, which shapes, what is wrong, how to fix it."""
    lines = [
        f"MoE exchange '{backend}' (capture.moe_exchange or --k3-moe-exchange) cannot run this model: "
        f"the installed {installed_version(backend)} was asked for hidden {shapes.hidden_size}, "
        f"top-k {shapes.top_k}, {shapes.num_experts} experts over {shapes.world_size} ranks, "
        f"up to {shapes.max_tokens_per_rank} tokens per rank per dispatch.",
        *[f"  - {p}" for p in problems],
    ]
    if detail:
        lines.append(f"  - the kernels said: {detail}")
    fix = fix or (
        f"install a {backend} build compiled for hidden {shapes.hidden_size} and top-k {shapes.top_k} "
        "(Kimi K3 needs 3,584 and 16)"
    )
    lines.append(
        f"  fix: {fix}, or use the default exchange: --k3-moe-exchange nccl (recipe: capture.moe_exchange: nccl)"
    )
    return ExchangeShapeError("\n".join(lines))
