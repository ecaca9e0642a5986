"""MXFP4 (OCP microscaling FP4) weights: E2M1 values packed two per byte, one E8M0 scale per 32.

Layout used throughout this package, for a weight of logical shape ``[..., K]`` (K the contraction
dimension, a multiple of 32):

- ``blocks``: uint8 ``[..., K // 2]``; element ``2j`` is the low nibble of byte ``j``, element
  ``2j + 1`` the high nibble. A nibble is ``sign << 3 | code`` with code 0..7 meaning the
  magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
- ``scales``: uint8 ``[..., K // 32]``; byte ``s`` means ``2 ** (s - 127)`` and 255 means NaN.

This module is the CPU reference: quantization (round to nearest, ties to even, saturating at 6
after scaling), packing and dequantization in plain torch. The GPU kernel lives in
:mod:`runtime.moe.mxfp4_triton` and must agree with :func:`dequantize_reference` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MXFP4_GROUP_SIZE = 32
"""Elements that share one E8M0 scale."""
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitude of each 3-bit E2M1 code."""
E2M1_MAX = 6.0
E2M1_MAX_EXPONENT = 2
"""floor(log2(E2M1_MAX)): the OCP rule puts the group's largest value in [4, 8) after scaling."""
E8M0_BIAS = 127
E8M0_NAN = 255

# Midpoints between consecutive magnitudes: a scaled value is rounded to the code whose interval
# contains it; a value exactly on a midpoint goes to the even code (ties to even).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclass(frozen=True)
class MXFP4Tensor:
    """A weight held in MXFP4: packed E2M1 ``blocks`` and E8M0 ``scales`` (see the module docs)."""

    blocks: torch.Tensor
    """uint8 ``[..., K // 2]``."""
    scales: torch.Tensor
    """uint8 ``[..., K // 32]``."""

    def __post_init__(self) -> None:
        if self.blocks.dtype != torch.uint8 or self.scales.dtype != torch.uint8:
            raise TypeError(
                f"MXFP4Tensor wants uint8 blocks and scales, got {self.blocks.dtype} and {self.scales.dtype}"
            )
        if self.blocks.shape[:-1] != self.scales.shape[:-1] or self.blocks.shape[-1] != 16 * self.scales.shape[-1]:
            raise ValueError(
                f"MXFP4Tensor blocks {tuple(self.blocks.shape)} and scales {tuple(self.scales.shape)} do not "
                f"match: blocks' last dim must be 16 x scales' last dim (32 values per scale, 2 per byte)"
            )

    @property
    def shape(self) -> torch.Size:
        """Logical (dequantized) shape ``[..., K]``."""
        return torch.Size((*self.blocks.shape[:-1], 2 * self.blocks.shape[-1]))

    @property
    def device(self) -> torch.device:
        """Device of the packed data."""
        return self.blocks.device

    @property
    def nbytes(self) -> int:
        """Bytes held (blocks + scales): about 0.53 bytes per weight."""
        return self.blocks.numel() + self.scales.numel()

    def __getitem__(self, index: int | slice) -> MXFP4Tensor:
        """Select along the leading dimension (e.g. one expert or a shard of experts)."""
        return MXFP4Tensor(self.blocks[index], self.scales[index])

    def to(self, device: torch.device | str) -> MXFP4Tensor:
        """The same tensor on ``device``."""
        return MXFP4Tensor(self.blocks.to(device), self.scales.to(device))

    def contiguous(self) -> MXFP4Tensor:
        """Contiguous copies of blocks and scales (the kernel needs flat addressing)."""
        return MXFP4Tensor(self.blocks.contiguous(), self.scales.contiguous())


def quantize_mxfp4(weight: torch.Tensor) -> MXFP4Tensor:
    """Quantize ``weight`` (``[..., K]``, K a multiple of 32) to MXFP4 along its last dimension.

    Each group of 32 gets the shared exponent ``floor(log2(amax)) - 2`` (the OCP MX rule), clamped
    to the E8M0 range; scaled values are rounded to the nearest E2M1 value (ties to even) and
    saturate at +-6. An all-zero group gets the smallest scale.
    """
    k = weight.shape[-1]
    if k % MXFP4_GROUP_SIZE:
        raise ValueError(f"MXFP4 needs the last dimension to be a multiple of 32, got shape {tuple(weight.shape)}")
    groups = weight.detach().to(torch.float32).reshape(*weight.shape[:-1], k // MXFP4_GROUP_SIZE, MXFP4_GROUP_SIZE)
    amax = groups.abs().amax(dim=-1)
    exponent = torch.zeros_like(amax, dtype=torch.int32)
    nonzero = amax > 0
    # frexp gives amax = mantissa * 2**e with mantissa in [0.5, 1): floor(log2(amax)) = e - 1, exact
    # (a float log2 can round 2**n - tiny up to n).
    _, e = torch.frexp(amax)
    exponent[nonzero] = (e[nonzero] - 1 - E2M1_MAX_EXPONENT).to(torch.int32)
    exponent[~nonzero] = -E8M0_BIAS
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    scale = torch.ldexp(torch.ones_like(amax), exponent)
    scaled = groups / scale.unsqueeze(-1)
    codes = _round_to_e2m1(scaled)
    blocks = pack_e2m1(codes.reshape(*weight.shape[:-1], k))
    scales = (exponent + E8M0_BIAS).to(torch.uint8)
    return MXFP4Tensor(blocks, scales)


def _round_to_e2m1(values: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (sign in bit 3) of fp32 ``values`` already divided by their scale."""
    magnitude = values.abs().clamp(max=E2M1_MAX)
    midpoints = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=values.device)
    down = torch.bucketize(magnitude, midpoints, right=False)  # a tie goes to the lower code
    up = torch.bucketize(magnitude, midpoints, right=True)  # a tie goes to the upper code
    code = torch.where(down == up, down, torch.where(down % 2 == 0, down, up))
    sign = (values < 0) & (code > 0)  # no negative zero: keeps round trips canonical
    return (code | (sign.to(code.dtype) << 3)).to(torch.uint8)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes (uint8 ``[..., K]``, K even) two per byte: element 2j low, 2j+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1 needs an even last dimension, got {tuple(codes.shape)}")
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(blocks: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: uint8 ``[..., K // 2]`` -> 4-bit codes uint8 ``[..., K]``."""
    low = blocks & 0x0F
    high = blocks >> 4
    return torch.stack((low, high), dim=-1).reshape(*blocks.shape[:-1], 2 * blocks.shape[-1])


def e2m1_lookup_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 value of each of the 16 E2M1 codes."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat((magnitudes, -magnitudes))


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """fp32 value ``2 ** (s - 127)`` of E8M0 bytes (NaN for 255), exact including 2**-127."""
    exponent = scales.to(torch.int32) - E8M0_BIAS
    value = torch.ldexp(torch.ones(scales.shape, dtype=torch.float32, device=scales.device), exponent)
    return torch.where(scales == E8M0_NAN, torch.full_like(value, float("nan")), value)


def dequantize_reference(
    tensor: MXFP4Tensor, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Dequantize ``tensor`` with plain torch (the CPU path and the GPU kernel's reference).

    Values are formed in fp32 (exact: at most 2 significant bits times a power of two) and
    rounded once to ``dtype``. With ``out`` the result is written there and returned.
    """
    values = e2m1_lookup_table(tensor.device)[unpack_e2m1(tensor.blocks).long()]
    grouped = values.reshape(*tensor.scales.shape, MXFP4_GROUP_SIZE) * e8m0_to_float(tensor.scales).unsqueeze(-1)
    result = grouped.reshape(tensor.shape)
    if out is None:
        return result.to(dtype)
    if out.shape != tensor.shape:
        raise ValueError(f"dequantize out has shape {tuple(out.shape)}, expected {tuple(tensor.shape)}")
    out.copy_(result)
    return out


def dequantize_reference_chunked(
    tensor: MXFP4Tensor,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    rows_per_chunk: int = 4096,
) -> torch.Tensor:
    """:func:`dequantize_reference` over the leading rows in chunks, bounding fp32 temporaries.

    The fp32 intermediate of a whole K3 expert shard is tens of GiB; chunking keeps it at
    ``rows_per_chunk`` rows of the flattened ``[rows, K]`` view.
    """
    shape = tensor.shape
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=tensor.device)
    flat_blocks = tensor.blocks.reshape(-1, tensor.blocks.shape[-1])
    flat_scales = tensor.scales.reshape(-1, tensor.scales.shape[-1])
    flat_out = out.view(-1, shape[-1])
    for start in range(0, flat_blocks.shape[0], rows_per_chunk):
        stop = min(start + rows_per_chunk, flat_blocks.shape[0])
        dequantize_reference(
            MXFP4Tensor(flat_blocks[start:stop], flat_scales[start:stop]), dtype, out=flat_out[start:stop]
        )
    return out
