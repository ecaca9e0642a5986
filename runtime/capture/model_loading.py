"""How the embedded capture engine loads its target: the plain Hugging Face loader, or the
expert-parallel one (``capture.expert_parallel > 1``) built on runtime/moe.

The engine (runtime/capture/engine_embedded.py) runs one replica per device as threads of one
process and takes a ``model_loader(settings, device)``. The expert-parallel loader loads the target
with the plain Hugging Face loader, then shards its routed experts: replica ``i`` is rank ``i % EP`` of
expert-parallel group ``i // EP`` and keeps ``num_experts / EP`` experts; attention, norms and
router stay whole on every replica (attention data parallel). The replicas of a group exchange
tokens through :mod:`runtime.moe.exchange_threads`.

The engine must keep the replicas of a group in step: every capture step, a replica that gets
no samples calls :meth:`ExpertParallelLoader.idle_step` while the others run their forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from runtime.capture.embedded_settings import EmbeddedSettings, EngineError
from runtime.moe.exchange import ExchangeUnavailableError
from runtime.moe.exchange_threads import DEFAULT_RENDEZVOUS_TIMEOUT_S, ThreadGroupExchange, ThreadRendezvous
from runtime.moe.hf_adapter import ExpertParallelModel, is_hf_moe_block, shard_moe_experts

ModelLoader = Callable[[EmbeddedSettings, str], torch.nn.Module]
"""``(settings, device) -> base decoder model`` in eval mode on ``device``. The default loads a
local Hugging Face checkpoint; the expert-parallel loader below can replace it."""


def load_hf_decoder(settings: EmbeddedSettings, device: str) -> torch.nn.Module:
    """The target's base decoder (no lm_head) from a local Hugging Face folder."""
    from transformers import AutoModel

    if settings.expert_parallel > 1:
        raise EngineError(
            f"capture.expert_parallel is {settings.expert_parallel}, but this engine was started with the plain "
            "Hugging Face loader; an expert-parallel target needs the runtime/moe loader. Fix: set "
            "capture.expert_parallel: 1, or pass the expert-parallel model_loader to EmbeddedEngine"
        )
    if not (settings.target_path / "config.json").is_file():
        raise EngineError(
            f"capture.target_path {settings.target_path} has no config.json (not a Hugging Face checkpoint folder); "
            "fix: point it at the target checkpoint (for recipes/tiny.yaml run tools/make_tiny_target first)"
        )
    from transformers.utils import logging as hf_logging

    # Per-tensor progress bars are noise in a job log, and so is the load report: the engine loads
    # the base model without its lm_head on purpose, which transformers reports as
    # "lm_head.weight | UNEXPECTED" at warning level. Errors still show.
    hf_logging.disable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModel.from_pretrained(settings.target_path, dtype=settings.torch_dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.to(device).eval()


def default_loader(settings: EmbeddedSettings) -> ModelLoader:
    """The plain Hugging Face loader, or the expert-parallel one when ``expert_parallel > 1``."""
    if settings.expert_parallel <= 1:
        return load_hf_decoder
    return ExpertParallelLoader.for_settings(settings, settings.moe_exchange)


BaseLoader = Callable[[Any, str], nn.Module]


class ExpertParallelLoader:
    """``model_loader`` for ``EmbeddedEngine`` that shards experts over groups of replicas."""

    def __init__(
        self,
        expert_parallel: int,
        num_replicas: int,
        exchange_name: str = "nccl",
        base_loader: BaseLoader | None = None,
        rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S,
    ) -> None:
        if exchange_name != "nccl":
            raise ExchangeUnavailableError(
                f"MoE exchange '{exchange_name}' (capture.moe_exchange or --k3-moe-exchange) needs one process per "
                "GPU, but the embedded engine runs its expert-parallel replicas as threads of one process; fix: use "
                "--k3-moe-exchange nccl (capture.moe_exchange: nccl), which runs as in-process device-to-device copies here"
            )
        if expert_parallel < 1 or num_replicas % expert_parallel:
            raise ValueError(
                f"capture.expert_parallel {expert_parallel} must divide the number of capture replicas "
                f"({num_replicas}: one per GPU, or capture.engines_per_node); fix: set capture.expert_parallel to a "
                f"divisor of {num_replicas} or change capture.engines_per_node"
            )
        self.expert_parallel = expert_parallel
        self.base_loader = base_loader
        self.groups = [
            ThreadRendezvous(expert_parallel, rendezvous_timeout_s) for _ in range(num_replicas // expert_parallel)
        ]
        self.models: list[ExpertParallelModel] = []

    @classmethod
    def for_settings(cls, settings: Any, exchange_name: str = "nccl") -> ExpertParallelLoader:
        """The loader for an ``EmbeddedSettings`` (its ``expert_parallel`` and ``devices``)."""
        return cls(settings.expert_parallel, len(settings.devices), exchange_name)

    def __call__(self, settings: Any, device: str) -> nn.Module:
        """Load replica ``len(self.models)`` on ``device`` and shard its experts."""
        base_loader = self.base_loader
        if base_loader is None:
            base_loader = load_hf_decoder
        index = len(self.models)
        group, rank = divmod(index, self.expert_parallel)
        if group >= len(self.groups):
            raise ValueError(
                f"replica {index} is beyond the {len(self.groups) * self.expert_parallel} this loader was built for"
            )
        model = base_loader(dataclasses.replace(settings, expert_parallel=1), device)
        blocks = [m for m in model.modules() if is_hf_moe_block(m)]
        if not blocks:
            raise ValueError(
                f"capture.expert_parallel is {self.expert_parallel}, but the target at {settings.target_path} has no "
                "MoE block (top-k router + fused gate_up_proj/down_proj experts); fix: set capture.expert_parallel: 1"
            )
        exchange = ThreadGroupExchange(self.groups[group], rank, int(blocks[0].gate.weight.shape[0]))
        self.models.append(shard_moe_experts(model, None, exchange=exchange))
        return model

    def idle_step(self, replica_index: int, device: torch.device | str, dtype: torch.dtype) -> None:
        """Replica ``replica_index`` takes part in one forward's MoE exchanges with no tokens."""
        self.models[replica_index].idle_step(torch.device(device), dtype)

    def abort(self) -> None:
        """A replica failed: release the replicas waiting for it at an exchange (they raise)."""
        for group in self.groups:
            group.abort()
