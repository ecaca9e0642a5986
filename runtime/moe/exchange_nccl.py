"""The default MoE exchange: variable-split ``all_to_all_single`` (NCCL on GPUs, gloo on CPU).

Dispatch, per layer call:
1. plan locally (:func:`runtime.moe.plan.plan_dispatch`): one send row per (token, destination
   rank), with the slot ids local to that rank and the slot weights;
2. exchange the per-rank row counts (a tiny all-to-all), so every rank can size its receive
   buffers;
3. exchange the token rows, then the slot metadata (ids and fp32 weights bit-packed into one
   int32 tensor, one collective instead of two);
4. expand received rows to (row, local expert) pairs grouped by expert for the grouped GEMM.

Combine reverses it: each received row's local expert outputs are weighted and summed in slot
order, the per-row partial sums go back by the reverse all-to-all, and each token sums its
partials in rank order. Fixed orders and no atomics: the result is bitwise reproducible run to
run, and equals the dense MoE up to floating-point reassociation. Sums accumulate in fp32; the
partials travel in the hidden states' dtype (bf16 in production, half the bytes of fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.moe.exchange import ExpertBatch, experts_per_rank_for, group_rank_and_size
from runtime.moe.experts import LocalExperts
from runtime.moe.plan import (
    DEFAULT_SUM_CHUNK_ROWS,
    DispatchPlan,
    ExpertMajorOrder,
    expert_major_order,
    gather_sum,
    plan_dispatch,
)
from runtime.moe.routing import TopKRouting


@dataclass
class _AllToAllState:
    plan: DispatchPlan
    recv_counts: list[int]
    order: ExpertMajorOrder
    recv_weights: torch.Tensor
    num_tokens: int
    dtype: torch.dtype


class AllToAllExchange:
    """Expert-parallel dispatch/combine with ``torch.distributed.all_to_all_single``."""

    name = "nccl"

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_experts: int,
        *,
        sum_chunk_rows: int = DEFAULT_SUM_CHUNK_ROWS,
    ) -> None:
        self.group = group
        self.rank, self.world_size = group_rank_and_size(group)
        self.num_experts = num_experts
        self.experts_per_rank = experts_per_rank_for(num_experts, self.world_size)
        self.sum_chunk_rows = sum_chunk_rows

    def _all_to_all(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        if self.world_size == 1:
            return rows
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        dist.all_to_all_single(
            out, rows.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts, group=self.group
        )
        return out

    def exchange_counts(self, send_counts: list[int], device: torch.device) -> list[int]:
        """Rows this rank will receive from each rank, given what it sends to each."""
        if self.world_size == 1:
            return list(send_counts)
        send = torch.tensor(send_counts, dtype=torch.int64, device=device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return [int(c) for c in recv.tolist()]

    def dispatch(self, hidden: torch.Tensor, routing: TopKRouting) -> ExpertBatch:
        """See :meth:`runtime.moe.exchange.MoEExchange.dispatch`."""
        if hidden.shape[0] != routing.num_tokens:
            raise ValueError(f"hidden has {hidden.shape[0]} tokens but routing has {routing.num_tokens}")
        top_k = routing.top_k
        plan = plan_dispatch(routing, self.experts_per_rank, self.world_size)
        recv_counts = self.exchange_counts(plan.send_counts, hidden.device)
        recv_rows = self._all_to_all(hidden.index_select(0, plan.send_token_index), plan.send_counts, recv_counts)
        meta = torch.cat((plan.send_local_ids, plan.send_weights.view(torch.int32)), dim=1)
        recv_meta = self._all_to_all(meta, plan.send_counts, recv_counts)
        recv_local_ids = recv_meta[:, :top_k]
        recv_weights = recv_meta[:, top_k:].contiguous().view(torch.float32)
        order = expert_major_order(recv_local_ids, self.experts_per_rank)
        state = _AllToAllState(
            plan=plan,
            recv_counts=recv_counts,
            order=order,
            recv_weights=recv_weights,
            num_tokens=routing.num_tokens,
            dtype=hidden.dtype,
        )
        return ExpertBatch(
            tokens=recv_rows.index_select(0, order.pair_row),
            tokens_per_expert=order.tokens_per_expert,
            state=state,
        )

    def combine(self, expert_output: torch.Tensor, batch: ExpertBatch) -> torch.Tensor:
        """See :meth:`runtime.moe.exchange.MoEExchange.combine`."""
        state: _AllToAllState = batch.state
        partial = gather_sum(
            expert_output,
            state.order.slot_pair,
            state.recv_weights,
            out_dtype=state.dtype,
            chunk_rows=self.sum_chunk_rows,
        )
        returned = self._all_to_all(partial, state.recv_counts, state.plan.send_counts)
        return gather_sum(
            returned, state.plan.token_rank_row, None, out_dtype=state.dtype, chunk_rows=self.sum_chunk_rows
        )

    def run(self, hidden: torch.Tensor, routing: TopKRouting, experts: LocalExperts) -> torch.Tensor:
        """See :meth:`runtime.moe.exchange.MoEExchange.run`: one dispatch for all tokens."""
        batch = self.dispatch(hidden, routing)
        return self.combine(experts(batch.tokens, batch.tokens_per_expert), batch)
