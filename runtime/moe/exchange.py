"""The interface every MoE exchange backend implements: dispatch tokens to the ranks holding their
experts, then combine the expert outputs back into each token's weighted sum."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from runtime.moe.routing import TopKRouting


@dataclass
class ExpertBatch:
    """What the local experts compute on after a dispatch."""

    tokens: torch.Tensor
    """``[P, H]``: one row per (token, local expert) pair, grouped by local expert."""
    tokens_per_expert: torch.Tensor
    """int64 ``[E_local]``: rows per local expert, in expert order (zeros allowed)."""
    state: Any
    """Backend-specific bookkeeping that :meth:`MoEExchange.combine` needs."""


class MoEExchange(Protocol):
    """Expert-parallel dispatch/combine over one process group."""

    name: str
    """``nccl``, ``deepep`` or ``mooncake``."""
    rank: int
    world_size: int
    num_experts: int
    experts_per_rank: int

    def dispatch(self, hidden: torch.Tensor, routing: TopKRouting) -> ExpertBatch:
        """Send each token (``hidden`` ``[T, H]``) to the ranks of its routed experts; return
        the rows this rank's experts must process. Collective: every rank calls it, T may be 0."""

    def combine(self, expert_output: torch.Tensor, batch: ExpertBatch) -> torch.Tensor:
        """Return ``[T, H]``: for each token of this rank, the routing-weighted sum of its experts'
        outputs (``expert_output`` is ``[P, H]`` in ``batch.tokens``' row order). Collective."""


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) within ``group``; (0, 1) without torch.distributed (single process)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def experts_per_rank_for(num_experts: int, world_size: int) -> int:
    """Experts each rank holds; refuses a split that would leave ranks uneven."""
    if num_experts % world_size:
        raise ValueError(
            f"{num_experts} experts cannot be split evenly over {world_size} expert-parallel ranks; "
            f"set capture.expert_parallel to a divisor of {num_experts}"
        )
    return num_experts // world_size
