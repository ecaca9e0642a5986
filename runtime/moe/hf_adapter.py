"""Expert parallelism for Hugging Face MoE models inside the embedded capture engine.

:func:`shard_moe_experts` swaps every sparse MoE block of a loaded model (Qwen3-MoE layout:
``block.gate`` a top-k router with ``weight [E, H]``, ``top_k``, ``norm_topk_prob``;
``block.experts`` with fused ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``) for an
:class:`~runtime.moe.layer.ExpertParallelMoE` that keeps only this rank's ``E / EP`` experts.
Everything else (attention, norms, embeddings, router) stays replicated: attention runs data
parallel, each rank on its own samples.

The MoE layers are collective. Every rank of the expert-parallel group must run the same number
of forwards; a rank without a sample for a step calls :meth:`ExpertParallelModel.idle_step`,
which walks the MoE layers in model order with zero tokens while the others run their forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from runtime.moe.exchange import MoEExchange
from runtime.moe.experts import DequantWorkspace, LocalExperts
from runtime.moe.layer import ExpertParallelMoE
from runtime.moe.routing import TopKRouting
from runtime.moe.selection import DEFAULT_MAX_TOKENS_PER_DISPATCH, make_exchange


def is_hf_moe_block(module: nn.Module) -> bool:
    """Whether ``module`` is a sparse MoE block in the fused-experts layout this adapter knows."""
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return (
        gate is not None
        and experts is not None
        and isinstance(getattr(gate, "weight", None), torch.Tensor)
        and hasattr(gate, "top_k")
        and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(experts, "down_proj", None), torch.Tensor)
    )


class HFExpertParallelBlock(nn.Module):
    """Drop-in replacement of one HF sparse MoE block: ``[B, S, H] -> [B, S, H]``."""

    def __init__(self, moe: ExpertParallelMoE, hidden_size: int) -> None:
        super().__init__()
        self.moe = moe
        self.hidden_size = hidden_size

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Route, exchange, compute this rank's experts, combine."""
        flat = hidden_states.reshape(-1, self.hidden_size)
        return self.moe(flat).reshape(hidden_states.shape)

    def idle(self, device: torch.device, dtype: torch.dtype) -> None:
        """Take part in the layer's collectives with zero tokens."""
        empty = torch.empty((0, self.hidden_size), device=device, dtype=dtype)
        routing = TopKRouting(
            torch.empty((0, self.moe.top_k), dtype=torch.int64, device=device),
            torch.empty((0, self.moe.top_k), dtype=torch.float32, device=device),
        )
        self.moe(empty, routing)


@dataclass
class ExpertParallelModel:
    """A model whose MoE blocks were sharded, and what the capture engine needs to drive it."""

    blocks: list[HFExpertParallelBlock]
    """The replaced blocks in model (= forward) order."""
    exchange: MoEExchange
    rank: int
    world_size: int
    experts_per_rank: int

    def idle_step(self, device: torch.device, dtype: torch.dtype) -> None:
        """One forward's worth of MoE collectives with no tokens (a rank without a sample)."""
        for block in self.blocks:
            block.idle(device, dtype)


def shard_moe_experts(
    model: nn.Module,
    group: dist.ProcessGroup | None,
    exchange_name: str = "nccl",
    *,
    max_tokens_per_dispatch: int = DEFAULT_MAX_TOKENS_PER_DISPATCH,
    exchange: MoEExchange | None = None,
    workspace: DequantWorkspace | None = None,
) -> ExpertParallelModel:
    """Replace every MoE block of ``model`` by an expert-parallel one over ``group`` (in place).

    Each rank keeps experts ``[rank * E / EP, (rank + 1) * E / EP)``; the other experts' weights
    are released. All blocks share one exchange (the low-latency backends allocate large
    communication buffers) and one dequantization workspace. A ready ``exchange`` (for example
    the in-process one of :mod:`runtime.moe.exchange_threads`) replaces ``group`` and
    ``exchange_name``.
    """
    found = [(name, module) for name, module in model.named_modules() if is_hf_moe_block(module)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no MoE block with a top-k router and fused gate_up_proj/down_proj "
            "experts; capture.expert_parallel > 1 needs a MoE target in that layout (for example Qwen3-MoE)"
        )
    first = found[0][1]
    num_experts, hidden = first.gate.weight.shape
    if exchange is None:
        exchange = make_exchange(
            exchange_name,
            group,
            num_experts=int(num_experts),
            hidden_size=int(hidden),
            top_k=int(first.gate.top_k),
            max_tokens_per_dispatch=max_tokens_per_dispatch,
        )
    rank, world = exchange.rank, exchange.world_size
    per_rank = exchange.experts_per_rank
    shard = slice(rank * per_rank, (rank + 1) * per_rank)
    workspace = workspace or DequantWorkspace()
    blocks = []
    for name, module in found:
        act = getattr(module.experts, "act_fn", None)
        experts = LocalExperts(
            module.experts.gate_up_proj.detach()[shard].clone(),
            module.experts.down_proj.detach()[shard].clone(),
            workspace=workspace,
            **({"activation": act} if act is not None else {}),
        )
        moe = ExpertParallelMoE(
            module.gate.weight.detach(),
            experts,
            exchange,
            int(module.gate.top_k),
            renormalize=bool(getattr(module.gate, "norm_topk_prob", True)),
        )
        block = HFExpertParallelBlock(moe, int(hidden))
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, block)
        blocks.append(block)
    return ExpertParallelModel(blocks, exchange, rank, world, per_rank)
