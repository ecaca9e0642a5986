"""The DSpark attention mask.

Keys are laid out as ``[context (ctx_len) ; draft slots (N * S)]``. A query in block ``i`` sees

- context key ``j`` when ``j < anchor_i`` (and block ``i`` is real), and
- every slot of its own block (bidirectional inside the block), nothing else.

A padded block sees only its own slots. DeepSpec masks padded blocks out entirely; with an explicit
SDPA mask a fully masked row is NaN (0/0), and its zero loss weight would not stop the NaN from
reaching the gradients, so padded rows keep their own block. Their outputs are never supervised.

``ctx_len`` may exceed T (flex_attention pads the context to a fixed length so it compiles once);
padded context keys sit at ``j >= T > anchor`` and are never visible.
"""

from __future__ import annotations

from typing import Any

import torch


def dense_block_mask(anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """bool [N*S, ctx_len + N*S]: True where a query may attend (for SDPA on CPU)."""
    num_blocks = int(anchors.shape[0])
    device = anchors.device
    q_len = num_blocks * block_size
    q_block = torch.arange(q_len, device=device, dtype=torch.int64) // block_size
    ctx_index = torch.arange(ctx_len, device=device, dtype=torch.int64)
    see_context = (ctx_index[None, :] < anchors[q_block][:, None]) & keep[q_block][:, None]
    kv_block = torch.arange(q_len, device=device, dtype=torch.int64) // block_size
    see_draft = q_block[:, None] == kv_block[None, :]
    return torch.cat([see_context, see_draft], dim=1)


def dspark_mask_mod(anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block_size: int) -> Any:
    """The same rule as :func:`dense_block_mask`, as a flex_attention ``mask_mod``."""

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        q_block = q_idx // block_size
        is_context = kv_idx < ctx_len
        see_context = is_context & (kv_idx < anchors[q_block]) & keep[q_block]
        kv_block = (kv_idx - ctx_len) // block_size
        see_draft = (~is_context) & (kv_block == q_block)
        return see_context | see_draft

    return mask_mod


def flex_block_mask(anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block_size: int) -> Any:
    """A flex_attention BlockMask for one sample (B=1, every head alike)."""
    from torch.nn.attention.flex_attention import create_block_mask

    q_len = int(anchors.shape[0]) * block_size
    return create_block_mask(
        dspark_mask_mod(anchors, keep, ctx_len, block_size),
        B=None,
        H=None,
        Q_LEN=q_len,
        KV_LEN=ctx_len + q_len,
        device=anchors.device,
    )


def padded_context_length(seq_len: int, max_length: int, multiple: int = 128) -> int:
    """Context length flex_attention runs at: ``max_length`` rounded up to ``multiple`` (one shape
    for every sample, so the compiled kernel is built once); never below ``seq_len``."""
    target = max(seq_len, max_length)
    return ((target + multiple - 1) // multiple) * multiple
