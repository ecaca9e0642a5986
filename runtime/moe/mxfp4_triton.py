"""Triton kernel that dequantizes MXFP4 weights into a preallocated bf16/fp16/fp32 buffer.

One program writes ``BLOCK`` consecutive output elements of the flattened tensor. Offsets are
int64 from the first multiplication on (one K3 expert shard's gate/up weight alone has about
2.5e9 elements, past int32), and the launch is split into chunks of at most
``MAX_PROGRAMS_PER_LAUNCH`` programs, each told its first element, so no grid dimension ever
exceeds 65,535 whatever the tensor size.

Triton is optional: without it (or without CUDA) :func:`triton_available` is False and callers
use :func:`runtime.moe.mxfp4.dequantize_reference`. With ``TRITON_INTERPRET=1`` set before this
module is imported the same kernel runs on CPU tensors (slowly), which the CPU tests use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from runtime.moe.mxfp4 import MXFP4Tensor

try:  # Triton ships with CUDA builds of torch; CPU machines may lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None

MAX_PROGRAMS_PER_LAUNCH = 65_535
"""Upper bound of every grid dimension of every launch."""
DEFAULT_BLOCK_ELEMENTS = 4096
"""Output elements per program (a power of two; 128 groups of 32)."""

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def triton_available() -> bool:
    """True when the kernel can run here: Triton imports and either CUDA is present or the
    Triton interpreter is on (``TRITON_INTERPRET=1``)."""
    if triton is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class LaunchChunk:
    """One kernel launch: ``num_programs`` programs starting at element ``first_element``."""

    first_element: int
    num_programs: int


def plan_launches(
    numel: int, block_elements: int = DEFAULT_BLOCK_ELEMENTS, max_programs: int = MAX_PROGRAMS_PER_LAUNCH
) -> list[LaunchChunk]:
    """Launches covering ``numel`` output elements with no grid larger than ``max_programs``."""
    if block_elements <= 0 or block_elements & (block_elements - 1):
        raise ValueError(f"block_elements must be a positive power of two, got {block_elements}")
    if not 1 <= max_programs <= MAX_PROGRAMS_PER_LAUNCH:
        raise ValueError(f"max_programs must be in 1..{MAX_PROGRAMS_PER_LAUNCH}, got {max_programs}")
    total_programs = -(-numel // block_elements)
    chunks = []
    for first_program in range(0, total_programs, max_programs):
        count = min(max_programs, total_programs - first_program)
        chunks.append(LaunchChunk(first_element=first_program * block_elements, num_programs=count))
    return chunks


if triton is not None:

    @triton.jit
    def _mxfp4_dequant_kernel(
        blocks_ptr,
        scales_ptr,
        out_ptr,
        numel,
        first_element,
        BLOCK: tl.constexpr,
    ):
        # Every offset is int64: program_id * BLOCK alone overflows int32 past 2**31 elements.
        pid = tl.program_id(0).to(tl.int64)
        offsets = pid * BLOCK + first_element + tl.arange(0, BLOCK).to(tl.int64)
        mask = offsets < numel
        # Each output element loads its own byte and scale; neighbours hit the same cache lines,
        # and the stores stay fully coalesced.
        byte = tl.load(blocks_ptr + (offsets >> 1), mask=mask, other=0).to(tl.int32)
        nibble = (byte >> ((offsets & 1).to(tl.int32) * 4)) & 0xF
        scale_bits = tl.load(scales_ptr + (offsets >> 5), mask=mask, other=127).to(tl.int32)
        code = nibble & 7
        exponent = code >> 1
        half_mantissa = (code & 1).to(tl.float32) * 0.5
        # E2M1: exponent 0 is subnormal (0 or 0.5); otherwise 2**(e-1) * (1 + m/2). Built from an
        # integer shift so every value is exact.
        power = (1 << tl.maximum(exponent - 1, 0)).to(tl.float32)
        magnitude = tl.where(exponent == 0, half_mantissa, power * (1.0 + half_mantissa))
        value = tl.where(nibble >= 8, -magnitude, magnitude)
        # E8M0 -> fp32 by placing the byte in the exponent field; byte 0 is 2**-127, a subnormal
        # whose bit pattern is 1 << 22.
        scale = tl.where(scale_bits == 0, 1 << 22, scale_bits << 23).to(tl.float32, bitcast=True)
        result = value * scale
        result = tl.where(scale_bits == 255, float("nan"), result)
        tl.store(out_ptr + offsets, result.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_triton(
    tensor: MXFP4Tensor,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    block_elements: int = DEFAULT_BLOCK_ELEMENTS,
    max_programs: int = MAX_PROGRAMS_PER_LAUNCH,
) -> torch.Tensor:
    """Dequantize ``tensor`` with the Triton kernel, into ``out`` when given (reused buffers).

    ``max_programs`` lowers the per-launch grid (tests use it to exercise chunking on small
    tensors); it never exceeds 65,535.
    """
    if triton is None:
        raise RuntimeError("dequantize_triton needs the triton package; use runtime.moe.mxfp4.dequantize_reference")
    shape = tensor.shape
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=tensor.device)
    if out.shape != shape or out.dtype not in _OUT_DTYPES or not out.is_contiguous():
        raise ValueError(
            f"dequantize_triton out must be a contiguous {shape} tensor of one of {_OUT_DTYPES}, "
            f"got {tuple(out.shape)} {out.dtype} contiguous={out.is_contiguous()}"
        )
    if out.device != tensor.device:
        raise ValueError(f"dequantize_triton out is on {out.device}, the weights on {tensor.device}")
    blocks = tensor.blocks.contiguous()
    scales = tensor.scales.contiguous()
    numel = out.numel()
    for chunk in plan_launches(numel, block_elements, max_programs):
        _mxfp4_dequant_kernel[(chunk.num_programs,)](
            blocks, scales, out, numel, chunk.first_element, BLOCK=block_elements
        )
    return out
