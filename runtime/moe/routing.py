"""Router top-k: which experts each token goes to, with which weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class TopKRouting:
    """Routing of T tokens to k experts each."""

    expert_ids: torch.Tensor
    """int64 ``[T, k]``: global expert id per slot (-1: slot unused)."""
    weights: torch.Tensor
    """fp32 ``[T, k]``: combine weight per slot."""

    def __post_init__(self) -> None:
        if self.expert_ids.shape != self.weights.shape or self.expert_ids.dim() != 2:
            raise ValueError(
                f"routing expert_ids {tuple(self.expert_ids.shape)} and weights {tuple(self.weights.shape)} "
                "must both be [T, k]"
            )

    @property
    def num_tokens(self) -> int:
        """T."""
        return int(self.expert_ids.shape[0])

    @property
    def top_k(self) -> int:
        """k."""
        return int(self.expert_ids.shape[1])


def route_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: Literal["softmax", "sigmoid"] = "softmax",
    renormalize: bool = True,
    selection_bias: torch.Tensor | None = None,
    scaling_factor: float = 1.0,
) -> TopKRouting:
    """Top-k routing from ``router_logits`` ``[T, E]``, in fp32.

    ``softmax`` + ``renormalize`` is Qwen3-MoE's router; ``sigmoid`` with a ``selection_bias``
    (added for choosing experts only, not to the weights) is the DeepSeek-V3 / Kimi style.
    ``scaling_factor`` multiplies the final weights (``routed_scaling_factor``).
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts} (number of experts), got {top_k}")
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if selection_bias is None else scores + selection_bias.float()
    _, expert_ids = torch.topk(choice, top_k, dim=-1)
    weights = scores.gather(1, expert_ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    if scaling_factor != 1.0:
        weights = weights * scaling_factor
    return TopKRouting(expert_ids=expert_ids.to(torch.int64), weights=weights)
