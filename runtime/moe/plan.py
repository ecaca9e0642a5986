"""Pure index arithmetic of the MoE exchange: who sends which rows where, and in which order
partial results are summed. No communication here, so every piece is testable on one process.

Conventions (all indices int64, so 64K-token prefills with top-16 never overflow):

- Experts are sharded contiguously: rank r holds global experts
  ``[r * experts_per_rank, (r + 1) * experts_per_rank)``.
- A token goes to a rank once, however many of its top-k experts live there (top-k with repeated
  ranks costs one row, not several). The send buffer is ordered by destination rank, then by
  token index, which is the order ``all_to_all_single`` wants.
- Sums are formed in a fixed order (slot 0..k-1 on the expert side, rank 0..W-1 on the source
  side) with gathers and elementwise adds only: no atomics, so results are bitwise reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.moe.routing import TopKRouting

DEFAULT_SUM_CHUNK_ROWS = 32_768
"""Rows per step of :func:`gather_sum` (bounds its fp32 temporaries)."""


@dataclass(frozen=True)
class DispatchPlan:
    """What one rank sends in the dispatch and how it sums what comes back."""

    send_token_index: torch.Tensor
    """int64 ``[S]``: source token of each send row (rank-major, then token order)."""
    send_counts: list[int]
    """Rows sent to each rank, ``[W]``."""
    send_local_ids: torch.Tensor
    """int32 ``[S, k]``: the slot's expert id local to the destination rank, -1 when the slot's
    expert lives elsewhere."""
    send_weights: torch.Tensor
    """fp32 ``[S, k]``: the slot's weight where ``send_local_ids >= 0``, else 0."""
    token_rank_row: torch.Tensor
    """int64 ``[T, W]``: send row of (token, rank), -1 where the token does not go to the rank."""


def plan_dispatch(routing: TopKRouting, experts_per_rank: int, world_size: int) -> DispatchPlan:
    """The dispatch plan of ``routing`` over ``world_size`` ranks of ``experts_per_rank`` experts."""
    ids = routing.expert_ids
    num_tokens, top_k = ids.shape
    num_experts = experts_per_rank * world_size
    if top_k == 0:
        raise ValueError("routing has top_k 0")
    if num_tokens and (int(ids.max()) >= num_experts or int(ids.min()) < -1):
        raise ValueError(
            f"routing names expert ids in [{int(ids.min())}, {int(ids.max())}], outside -1..{num_experts - 1} "
            f"({world_size} ranks x {experts_per_rank} experts)"
        )
    valid = ids >= 0
    dest = torch.where(valid, ids // experts_per_rank, torch.full_like(ids, world_size))
    # [T, W + 1] membership; the extra column swallows unused slots.
    member = torch.zeros((num_tokens, world_size + 1), dtype=torch.bool, device=ids.device)
    member.scatter_(1, dest, True)
    member = member[:, :world_size]
    rank_token = member.t().nonzero()  # row-major over [W, T]: rank-major, then token order
    send_rank = rank_token[:, 0]
    send_token = rank_token[:, 1]
    send_counts = member.sum(dim=0).tolist()
    token_rank_row = torch.full((num_tokens, world_size), -1, dtype=torch.int64, device=ids.device)
    token_rank_row[send_token, send_rank] = torch.arange(send_token.numel(), device=ids.device)
    row_ids = ids.index_select(0, send_token)
    on_dest = (row_ids >= 0) & (row_ids // experts_per_rank == send_rank.unsqueeze(1))
    local_ids = torch.where(on_dest, row_ids - send_rank.unsqueeze(1) * experts_per_rank, torch.full_like(row_ids, -1))
    weights = torch.where(on_dest, routing.weights.index_select(0, send_token).float(), 0.0)
    return DispatchPlan(
        send_token_index=send_token,
        send_counts=[int(c) for c in send_counts],
        send_local_ids=local_ids.to(torch.int32),
        send_weights=weights,
        token_rank_row=token_rank_row,
    )


@dataclass(frozen=True)
class ExpertMajorOrder:
    """Received rows expanded to (row, slot) pairs grouped by local expert."""

    pair_row: torch.Tensor
    """int64 ``[P]``: received row of each pair; pairs ordered by expert, then row, then slot."""
    tokens_per_expert: torch.Tensor
    """int64 ``[E_local]``: pairs per local expert (zeros allowed)."""
    slot_pair: torch.Tensor
    """int64 ``[R, k]``: pair index of each (row, slot), -1 where the slot is not local."""


def expert_major_order(local_ids: torch.Tensor, num_local_experts: int) -> ExpertMajorOrder:
    """Group the local slots of received rows (``local_ids`` ``[R, k]``, -1 = not here) by expert."""
    num_rows, top_k = local_ids.shape
    ids = local_ids.to(torch.int64)
    valid = ids >= 0
    if bool((ids >= num_local_experts).any()):
        raise ValueError(f"received local expert ids up to {int(ids.max())}, but this rank holds {num_local_experts}")
    key = torch.where(valid, ids, torch.full_like(ids, num_local_experts)).reshape(-1)
    order = torch.sort(key, stable=True).indices  # stable: row, then slot order within an expert
    num_pairs = int(valid.sum())
    pair_index = order[:num_pairs]
    tokens_per_expert = torch.bincount(key[pair_index], minlength=num_local_experts)[:num_local_experts]
    slot_pair = torch.full((num_rows * top_k,), -1, dtype=torch.int64, device=ids.device)
    slot_pair[pair_index] = torch.arange(num_pairs, device=ids.device)
    return ExpertMajorOrder(
        pair_row=torch.div(pair_index, top_k, rounding_mode="floor"),
        tokens_per_expert=tokens_per_expert,
        slot_pair=slot_pair.reshape(num_rows, top_k),
    )


def gather_sum(
    values: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    chunk_rows: int = DEFAULT_SUM_CHUNK_ROWS,
) -> torch.Tensor:
    """``out[r] = sum_j weights[r, j] * values[index[r, j]]`` for j = 0, 1, ... in that order.

    ``values``: ``[N, H]``; ``index``: int64 ``[R, m]`` with -1 for "nothing"; ``weights``:
    ``[R, m]`` or None for all ones. Accumulates in fp32 and returns ``out_dtype`` (default
    ``values.dtype``). Deterministic: a fixed summation order and no atomics.
    """
    num_rows, width = index.shape[0], values.shape[1]
    out_dtype = out_dtype or values.dtype
    out = torch.zeros((num_rows, width), dtype=torch.float32, device=values.device)
    if values.shape[0] == 0 or num_rows == 0:
        return out.to(out_dtype)
    for start in range(0, num_rows, chunk_rows):
        stop = min(start + chunk_rows, num_rows)
        acc = out[start:stop]
        for j in range(index.shape[1]):
            rows = index[start:stop, j]
            valid = rows >= 0
            term = values.index_select(0, rows.clamp(min=0)).float()
            if weights is not None:
                term.mul_(weights[start:stop, j].float().unsqueeze(1))
            # masked_fill rather than a zero weight: 0 * inf would poison the sum.
            term.masked_fill_(~valid.unsqueeze(1), 0.0)
            acc.add_(term)
    return out.to(out_dtype)
