"""Grouped GEMM over local experts: rows grouped by expert times one weight matrix per expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_INT32_MAX = 2**31 - 1


def _grouped_mm_op():
    """torch's grouped GEMM (public ``F.grouped_mm`` on newer torch, ``torch._grouped_mm`` before)."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_usable(rows: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether torch's fused grouped GEMM can take these operands: bf16 on a CUDA GPU of compute
    capability 9.0 or newer, 16-byte aligned rows, offsets that fit int32."""
    if _grouped_mm_op() is None or not rows.is_cuda or rows.dtype != torch.bfloat16 or weights.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(rows.device) < (9, 0):
        return False
    k, n = weights.shape[-1], weights.shape[-2]
    return (k * 2) % 16 == 0 and (n * 2) % 16 == 0 and rows.shape[0] <= _INT32_MAX


def grouped_linear(
    rows: torch.Tensor,
    weights: torch.Tensor,
    rows_per_group: torch.Tensor,
    rows_per_group_list: list[int] | None = None,
) -> torch.Tensor:
    """``out[r] = rows[r] @ weights[g(r)].T`` where rows are grouped by ``g`` in order.

    ``rows``: ``[P, K]``; ``weights``: ``[G, N, K]`` (nn.Linear layout per group);
    ``rows_per_group``: int64 ``[G]`` summing to P (groups may be empty). Uses torch's grouped
    GEMM on H100/H200-class GPUs in bf16 and a loop of plain matmuls elsewhere (CPU, fp32).
    ``rows_per_group_list`` saves a device-to-host copy when the caller already has the counts.
    """
    if weights.dim() != 3 or rows.dim() != 2 or rows.shape[1] != weights.shape[2]:
        raise ValueError(f"grouped_linear shapes do not fit: rows {tuple(rows.shape)}, weights {tuple(weights.shape)}")
    num_groups, n, _ = weights.shape
    if rows_per_group.shape != (num_groups,):
        raise ValueError(f"rows_per_group has shape {tuple(rows_per_group.shape)}, expected ({num_groups},)")
    if grouped_mm_usable(rows, weights):
        offsets = torch.cumsum(rows_per_group.to(device=rows.device), 0).to(torch.int32)
        # weights.transpose(-2, -1) is the column-major [G, K, N] view the kernel prefers.
        return _grouped_mm_op()(rows, weights.transpose(-2, -1), offs=offsets)
    counts = rows_per_group_list if rows_per_group_list is not None else rows_per_group.tolist()
    out = rows.new_empty((rows.shape[0], n))
    start = 0
    for group, count in enumerate(counts):
        if count:
            torch.matmul(rows[start : start + count], weights[group].t(), out=out[start : start + count])
        start += count
    return out
