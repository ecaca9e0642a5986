"""The interface every MoE exchange backend implements: dispatch tokens to the ranks holding their
experts, then combine the expert outputs back into each token's weighted sum."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.distributed as dist

from runtime.moe.experts import LocalExperts
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

    def run(self, hidden: torch.Tensor, routing: TopKRouting, experts: LocalExperts) -> torch.Tensor:
        """Dispatch, run ``experts``, combine: the whole routed-expert part of one MoE layer.
        Backends with a bounded dispatch size loop over token chunks here. Collective."""


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


class ExchangeUnavailableError(RuntimeError):
    """The chosen MoE exchange's package does not import on this machine."""


BACKEND_PACKAGES = {"deepep": "DeepEP (deep_ep)", "mooncake": "Mooncake built with EP support (mooncake.ep)"}


def import_backend_module(module: str, backend: str) -> ModuleType:
    """Import ``module`` for ``backend`` or fail with what to install and how to avoid it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        reason = " ".join(str(exc).split()).rstrip(".")  # one line, whatever the package printed
        raise ExchangeUnavailableError(
            f"MoE exchange '{backend}' (capture.moe_exchange or --k3-moe-exchange) needs "
            f"{BACKEND_PACKAGES.get(backend, module)}, but `import {module}` failed here: {reason}. "
            f"fix: install a {backend} build compiled for this model's shapes (Kimi K3: hidden 3,584, "
            "top-k 16), or use the default exchange: --k3-moe-exchange nccl (recipe: capture.moe_exchange: nccl)"
        ) from exc
