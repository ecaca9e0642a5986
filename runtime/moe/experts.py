"""The routed experts one expert-parallel rank holds, dense or resident in MXFP4.

Weights follow the Hugging Face fused layout (``Qwen3MoeExperts``): ``gate_up`` is
``[E, 2 * I, H]`` with the gate rows first, ``down`` is ``[E, H, I]``; an expert computes
``down @ (silu(gate @ x) * (up @ x))``.

MXFP4 experts stay packed in memory (about 0.53 bytes per weight). Each forward dequantizes the
experts that received tokens once, into a :class:`DequantWorkspace` buffer that every MoE layer
of the model shares (layers run one after another, so one buffer per weight shape is enough),
then runs the grouped GEMMs in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.moe.grouped_gemm import grouped_linear
from runtime.moe.mxfp4 import MXFP4Tensor, dequantize_reference_chunked
from runtime.moe.mxfp4_triton import dequantize_triton, triton_available

ExpertWeight = torch.Tensor | MXFP4Tensor


class DequantWorkspace:
    """Reusable dequantization buffers, keyed by role, shape, dtype and device."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = {}

    def buffer(self, role: str, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The buffer for ``role`` (allocated on first use, then the same storage every time)."""
        key = (role, tuple(shape), dtype, torch.device(device))
        found = self._buffers.get(key)
        if found is None:
            found = torch.empty(shape, dtype=dtype, device=device)
            self._buffers[key] = found
        return found

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def dequantize_into(tensor: MXFP4Tensor, out: torch.Tensor) -> torch.Tensor:
    """Dequantize ``tensor`` into ``out``: the Triton kernel on CUDA, the torch reference on CPU."""
    if out.is_cuda and triton_available():
        return dequantize_triton(tensor, out.dtype, out=out)
    return dequantize_reference_chunked(tensor, out.dtype, out=out)


class LocalExperts(nn.Module):
    """SwiGLU experts ``[first_expert, first_expert + num_experts)`` of one EP rank."""

    def __init__(
        self,
        gate_up: ExpertWeight,
        down: ExpertWeight,
        *,
        compute_dtype: torch.dtype | None = None,
        workspace: DequantWorkspace | None = None,
        activation: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    ) -> None:
        super().__init__()
        if gate_up.shape[0] != down.shape[0]:
            raise ValueError(f"gate_up has {gate_up.shape[0]} experts but down has {down.shape[0]}")
        num_experts, two_i, hidden = gate_up.shape
        if two_i % 2 or tuple(down.shape[1:]) != (hidden, two_i // 2):
            raise ValueError(
                f"expert weights do not fit: gate_up {tuple(gate_up.shape)} must be [E, 2I, H] and down "
                f"{tuple(down.shape)} must be [E, H, I]"
            )
        self.num_experts = int(num_experts)
        self.hidden_size = int(hidden)
        self.intermediate_size = int(two_i // 2)
        self.activation = activation
        self.quantized = isinstance(gate_up, MXFP4Tensor)
        if isinstance(down, MXFP4Tensor) != self.quantized:
            raise ValueError("gate_up and down must both be MXFP4 or both dense")
        if self.quantized:
            self.compute_dtype = compute_dtype or torch.bfloat16
            self.workspace = workspace or DequantWorkspace()
            self.register_buffer("gate_up_blocks", gate_up.blocks, persistent=False)
            self.register_buffer("gate_up_scales", gate_up.scales, persistent=False)
            self.register_buffer("down_blocks", down.blocks, persistent=False)
            self.register_buffer("down_scales", down.scales, persistent=False)
        else:
            self.compute_dtype = compute_dtype or gate_up.dtype
            self.workspace = workspace
            self.register_buffer("gate_up", gate_up.detach().to(self.compute_dtype), persistent=False)
            self.register_buffer("down", down.detach().to(self.compute_dtype), persistent=False)

    @property
    def resident_bytes(self) -> int:
        """Bytes of expert weights held resident."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def dense_weights(self, tokens_per_expert: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights in the compute dtype. MXFP4 experts are dequantized into the shared workspace;
        with ``tokens_per_expert`` only experts that received tokens are (the rest of the buffer
        holds stale values that the grouped GEMM never reads)."""
        if not self.quantized:
            return self.gate_up, self.down
        device = self.gate_up_blocks.device
        gate_up = MXFP4Tensor(self.gate_up_blocks, self.gate_up_scales)
        down = MXFP4Tensor(self.down_blocks, self.down_scales)
        gate_up_out = self.workspace.buffer("gate_up", gate_up.shape, self.compute_dtype, device)
        down_out = self.workspace.buffer("down", down.shape, self.compute_dtype, device)
        active = (
            list(range(self.num_experts))
            if tokens_per_expert is None
            else [e for e, n in enumerate(tokens_per_expert) if n > 0]
        )
        if len(active) == self.num_experts:
            dequantize_into(gate_up, gate_up_out)
            dequantize_into(down, down_out)
        else:
            for e in active:
                dequantize_into(gate_up[e], gate_up_out[e])
                dequantize_into(down[e], down_out[e])
        return gate_up_out, down_out

    def forward(
        self,
        tokens: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Expert outputs ``[P, H]`` for ``tokens`` ``[P, H]`` grouped by local expert
        (``tokens_per_expert`` int64 ``[E]``), unweighted; returned in ``tokens``' dtype.

        ``weights`` are the result of :meth:`dense_weights` when the caller runs several chunks
        of one layer and wants the MXFP4 experts dequantized once for all of them."""
        counts = tokens_per_expert.tolist()
        gate_up, down = weights if weights is not None else self.dense_weights(counts)
        x = tokens.to(self.compute_dtype)
        gate_and_up = grouped_linear(x, gate_up, tokens_per_expert, counts)
        gate, up = gate_and_up.chunk(2, dim=-1)
        hidden = self.activation(gate) * up
        return grouped_linear(hidden, down, tokens_per_expert, counts).to(tokens.dtype)
