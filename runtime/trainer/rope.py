"""Rotary position embeddings for the draft: plain, linear, dynamic NTK and YaRN.

The draft is served by SGLang, so these follow its rotary definitions (neox layout: the head is
split in two halves that rotate together). YaRN, as in SGLang and transformers: frequencies blend
between extrapolation and ``1 / factor`` interpolation over a ramp between the correction dims of
``beta_fast`` and ``beta_slow`` rotations at ``original_max_position_embeddings``, and cos/sin are
scaled by ``0.1 * ln(factor) + 1``.
"""

from __future__ import annotations

import math

import torch

from runtime.recipe.schema import RopeScaling


def _plain_inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return 1.0 / (theta**exponents)


def _yarn_correction_dim(rotations: float, head_dim: int, theta: float, original_positions: int) -> float:
    return (head_dim * math.log(original_positions / (rotations * 2 * math.pi))) / (2 * math.log(theta))


def yarn_inverse_frequencies(
    head_dim: int, theta: float, factor: float, original_positions: int, beta_fast: float, beta_slow: float
) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies [head_dim / 2] and the cos/sin magnitude scale."""
    extrapolation = _plain_inverse_frequencies(head_dim, theta)
    interpolation = extrapolation / factor
    low = math.floor(_yarn_correction_dim(beta_fast, head_dim, theta, original_positions))
    high = math.ceil(_yarn_correction_dim(beta_slow, head_dim, theta, original_positions))
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_extrapolated = 1.0 - ramp
    inverse = interpolation * (1 - keep_extrapolated) + extrapolation * keep_extrapolated
    scale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    return inverse, scale


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, max_positions: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies fp32 [head_dim / 2] and the cos/sin scale for the recipe's RoPE."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    if scaling is None:
        return _plain_inverse_frequencies(head_dim, theta), 1.0
    if scaling.type == "linear":
        return _plain_inverse_frequencies(head_dim, theta) / scaling.factor, 1.0
    if scaling.type == "dynamic":
        # NTK-aware base stretched once for the longest context (SGLang's dynamic scaling cache).
        factor = scaling.factor
        stretched = theta * (factor * factor - factor + 1) ** (head_dim / (head_dim - 2))
        return _plain_inverse_frequencies(head_dim, stretched), 1.0
    return yarn_inverse_frequencies(
        head_dim,
        theta,
        scaling.factor,
        scaling.original_max_position_embeddings,
        scaling.beta_fast,
        scaling.beta_slow,
    )


def cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., head_dim] for int64 ``positions`` (angles in fp32, cast to ``dtype``)."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., L, heads, head_dim]`` by per-position ``cos``/``sin [L, head_dim]`` (neox)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
