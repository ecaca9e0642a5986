"""Common part of the DeepEP and Mooncake EP low-latency exchanges.

Both kernels dispatch at most ``max_tokens_per_rank`` tokens per call into an expert-major padded
layout ``[E_local, max_tokens_per_rank * W, H]`` with a per-expert count, and combine (weighted
sum on the source rank) from the same layout. This base turns that into the package's
interface:

- prefill-sized inputs are cut into chunks of ``max_tokens_per_rank`` tokens; the ranks first
  agree on the number of chunks (a rank with fewer tokens dispatches empty chunks), because
  every dispatch is collective;
- the padded layout is compacted to rows grouped by expert for the grouped GEMM and scattered
  back for the combine;
- MXFP4 experts are dequantized once per layer call, not once per chunk;
- at start, shapes outside the stock limits are tried once on the real kernels with a
  known answer, and a failure becomes one clear :class:`ExchangeShapeError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from runtime.moe.exchange import ExpertBatch, experts_per_rank_for, group_rank_and_size
from runtime.moe.exchange_limits import (
    STOCK_LIMITS,
    ExchangeShapes,
    beyond_limits,
    hard_problems,
    shape_error,
)
from runtime.moe.experts import LocalExperts
from runtime.moe.routing import TopKRouting

PROBE_TOKENS_PER_RANK = 4
"""Tokens each rank sends through the start-up probe."""


def padded_to_packed(recv_x: torch.Tensor, recv_count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compact ``[E, cap, H]`` with ``recv_count`` ``[E]`` valid rows each into rows grouped by
    expert: (rows ``[P, H]``, int64 counts ``[E]``, boolean mask ``[E, cap]`` of valid slots)."""
    counts = recv_count.to(torch.int64)
    valid = torch.arange(recv_x.shape[1], device=recv_x.device).unsqueeze(0) < counts.unsqueeze(1)
    return recv_x[valid], counts, valid


def packed_to_padded(rows: torch.Tensor, valid: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`padded_to_packed`: rows back into a zeroed tensor shaped like ``like``."""
    out = torch.zeros_like(like)
    out[valid] = rows.to(like.dtype)
    return out


@dataclass
class _LowLatencyState:
    valid: torch.Tensor
    recv_x: torch.Tensor
    expert_ids: torch.Tensor
    weights: torch.Tensor
    handle: Any


class LowLatencyExchange:
    """Base of the low-latency backends; subclasses provide the buffer and the two kernel calls."""

    name = "low-latency"
    wire_dtype = torch.bfloat16

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_experts: int,
        hidden_size: int,
        top_k: int,
        max_tokens_per_rank: int = 128,
    ) -> None:
        self.group = group
        self.rank, self.world_size = group_rank_and_size(group)
        self.num_experts = num_experts
        self.shapes = ExchangeShapes(hidden_size, top_k, num_experts, self.world_size, max_tokens_per_rank)
        limits = STOCK_LIMITS[self.name]
        hard = hard_problems(self.shapes, limits)
        if hard:
            raise shape_error(
                self.name,
                self.shapes,
                hard,
                fix="change the value named above (capture.expert_parallel, tokens per dispatch)",
            )
        self.experts_per_rank = experts_per_rank_for(num_experts, self.world_size)
        self.max_tokens_per_rank = max_tokens_per_rank
        self.buffer = self._make_buffer()
        beyond = beyond_limits(self.shapes, limits)
        self.accepted_beyond_stock_limits = False
        if beyond:
            self._probe(beyond)
            self.accepted_beyond_stock_limits = True

    # --- the backend's own calls --------------------------------------------------------------

    def _make_buffer(self) -> Any:
        raise NotImplementedError

    def _kernel_dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(recv_x ``[E_local, cap, H]``, recv_count ``[E_local]``, handle)."""
        raise NotImplementedError

    def _kernel_combine(
        self, expert_out: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, handle: Any
    ) -> torch.Tensor:
        """Weighted sum ``[T, H]`` on the source rank."""
        raise NotImplementedError

    # --- the MoEExchange interface ------------------------------------------------------------

    def dispatch(self, hidden: torch.Tensor, routing: TopKRouting) -> ExpertBatch:
        """One kernel dispatch; at most ``max_tokens_per_rank`` tokens (:meth:`run` chunks)."""
        if routing.num_tokens > self.max_tokens_per_rank:
            raise ValueError(
                f"{self.name} dispatch takes at most {self.max_tokens_per_rank} tokens per call, got "
                f"{routing.num_tokens}; use run(), which chunks"
            )
        x = hidden.to(self.wire_dtype).contiguous()
        ids = routing.expert_ids.to(torch.int64).contiguous()
        recv_x, recv_count, handle = self._kernel_dispatch(x, ids)
        tokens, counts, valid = padded_to_packed(recv_x, recv_count)
        state = _LowLatencyState(valid, recv_x, ids, routing.weights.float().contiguous(), handle)
        return ExpertBatch(tokens=tokens, tokens_per_expert=counts, state=state)

    def combine(self, expert_output: torch.Tensor, batch: ExpertBatch) -> torch.Tensor:
        """Weighted sum per source token, formed by the kernel."""
        state: _LowLatencyState = batch.state
        padded = packed_to_padded(expert_output, state.valid, state.recv_x)
        return self._kernel_combine(padded, state.expert_ids, state.weights, state.handle)

    def num_chunks(self, num_tokens: int, device: torch.device) -> int:
        """Dispatch calls every rank makes for this layer (the largest rank's need)."""
        local = torch.tensor([-(-num_tokens // self.max_tokens_per_rank)], dtype=torch.int64, device=device)
        if self.world_size > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
        return int(local.item())

    def run(self, hidden: torch.Tensor, routing: TopKRouting, experts: LocalExperts) -> torch.Tensor:
        """See :meth:`runtime.moe.exchange.MoEExchange.run`: chunks of ``max_tokens_per_rank``."""
        weights = experts.dense_weights()
        out = torch.empty_like(hidden)
        step = self.max_tokens_per_rank
        for chunk in range(self.num_chunks(routing.num_tokens, hidden.device)):
            part = slice(min(chunk * step, routing.num_tokens), min((chunk + 1) * step, routing.num_tokens))
            sub = TopKRouting(routing.expert_ids[part], routing.weights[part])
            batch = self.dispatch(hidden[part], sub)
            expert_output = experts(batch.tokens, batch.tokens_per_expert, weights=weights)
            out[part] = self.combine(expert_output, batch).to(hidden.dtype)
        return out

    # --- start-up probe -----------------------------------------------------------------------

    def _probe(self, beyond: list[str]) -> None:
        """Send a few tokens with a known answer through the real kernels at the real shapes.

        With identity experts the combine must return each token itself (its weights sum to 1).
        Every rank runs it, so all ranks fail or pass together.
        """
        device = torch.device("cuda", torch.cuda.current_device())
        gen = torch.Generator(device="cpu").manual_seed(1000 + self.rank)
        tokens = min(PROBE_TOKENS_PER_RANK, self.max_tokens_per_rank)
        x = torch.randn(tokens, self.shapes.hidden_size, generator=gen).to(device, self.wire_dtype)
        ids = torch.rand(tokens, self.num_experts, generator=gen).argsort(dim=1)[:, : self.shapes.top_k].to(device)
        w = torch.rand(tokens, self.shapes.top_k, generator=gen) + 0.1
        routing = TopKRouting(ids, (w / w.sum(dim=1, keepdim=True)).to(device))
        try:
            batch = self.dispatch(x, routing)
            got = self.combine(batch.tokens, batch)
            torch.cuda.synchronize(device)
        except Exception as exc:  # the extension raises its own exception types
            raise shape_error(self.name, self.shapes, beyond, f"{type(exc).__name__}: {exc}") from exc
        error = (got.float() - x.float()).abs().max().item()
        passed = torch.tensor([int(error <= 0.05 * max(1.0, x.float().abs().max().item()))], device=device)
        # A rank whose answer was wrong must not leave the others waiting in the next collective.
        if self.world_size > 1:
            dist.all_reduce(passed, op=dist.ReduceOp.MIN, group=self.group)
        if not int(passed.item()):
            raise shape_error(
                self.name, self.shapes, beyond, f"the probe ran but returned wrong values (max error here {error:.3g})"
            )
