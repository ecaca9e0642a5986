"""The expert-parallel MoE layer: router top-k -> dispatch -> local experts -> combine.

Attention runs data parallel, so every rank brings its own tokens (possibly none) and a full
copy of the router; each rank holds ``num_experts / EP`` routed experts. Also here: the
single-process dense MoE that the expert-parallel layer must reproduce.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.moe.exchange import MoEExchange
from runtime.moe.experts import LocalExperts
from runtime.moe.routing import TopKRouting, route_topk


class ExpertParallelMoE(nn.Module):
    """Routed experts of one MoE layer sharded over an exchange's process group."""

    def __init__(
        self,
        router_weight: torch.Tensor,
        experts: LocalExperts,
        exchange: MoEExchange,
        top_k: int,
        *,
        renormalize: bool = True,
    ) -> None:
        super().__init__()
        num_experts = router_weight.shape[0]
        if num_experts != exchange.num_experts:
            raise ValueError(f"router has {num_experts} experts but the exchange was built for {exchange.num_experts}")
        if experts.num_experts != exchange.experts_per_rank:
            raise ValueError(
                f"this rank holds {experts.num_experts} experts but the exchange expects {exchange.experts_per_rank} "
                f"({num_experts} experts over {exchange.world_size} ranks)"
            )
        self.register_buffer("router_weight", router_weight.detach(), persistent=False)
        self.experts = experts
        self.exchange = exchange
        self.top_k = top_k
        self.renormalize = renormalize

    def route(self, hidden: torch.Tensor) -> TopKRouting:
        """Top-k routing of ``hidden`` ``[T, H]`` (softmax router, as Qwen3-MoE)."""
        logits = F.linear(hidden, self.router_weight.to(hidden.dtype))
        return route_topk(logits, self.top_k, renormalize=self.renormalize)

    def forward(self, hidden: torch.Tensor, routing: TopKRouting | None = None) -> torch.Tensor:
        """MoE output ``[T, H]`` for this rank's tokens; ``routing`` overrides the router."""
        routing = routing if routing is not None else self.route(hidden)
        return self.exchange.run(hidden, routing, self.experts)


def dense_moe_reference(
    hidden: torch.Tensor,
    routing: TopKRouting,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> torch.Tensor:
    """Single-process MoE over all experts, the plain way: for every (token, slot) the expert's
    SwiGLU output times the slot weight, summed over slots 0..k-1. fp32 throughout."""
    x = hidden.float()
    num_tokens, top_k = routing.expert_ids.shape
    contributions = torch.zeros((num_tokens, top_k, x.shape[1]), dtype=torch.float32, device=x.device)
    for expert in range(gate_up.shape[0]):
        tokens, slots = torch.nonzero(routing.expert_ids == expert, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate, up = F.linear(x[tokens], gate_up[expert].float()).chunk(2, dim=-1)
        y = F.linear(activation(gate) * up, down[expert].float())
        contributions[tokens, slots] = y * routing.weights[tokens, slots].float().unsqueeze(1)
    return contributions.sum(dim=1)
