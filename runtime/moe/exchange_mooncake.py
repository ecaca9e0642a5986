"""Mooncake EP low-latency exchange (opt-in: ``capture.moe_exchange: mooncake``).

Mooncake EP keeps DeepEP's low-latency API and adds an ``active_ranks`` tensor (a rank that stops
answering is marked 0 instead of hanging the others) and a timeout. It needs Mooncake built with
EP support (the native ``mooncake.ep`` module); the PyPI wheels ship the Python wrapper without
it, which is reported at start-up. Chunking, layout conversion and the start-up shape probe live
in :class:`runtime.moe.exchange_low_latency.LowLatencyExchange`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from runtime.moe.exchange import import_backend_module
from runtime.moe.exchange_low_latency import LowLatencyExchange

STEADY_TIMEOUT_US = 10_000_000
"""Kernel timeout after the first call (the first one may wait for peers to finish loading)."""


class MooncakeEPExchange(LowLatencyExchange):
    """Expert-parallel dispatch/combine with Mooncake EP's low-latency kernels."""

    name = "mooncake"

    def _make_buffer(self) -> Any:
        import_backend_module("mooncake.ep", self.name)  # the native part; fails on builds without EP
        ep_buffer = import_backend_module("mooncake.mooncake_ep_buffer", self.name)
        self.active_ranks = torch.ones((self.world_size,), dtype=torch.int32, device="cuda")
        self._timeout_us = -1
        size = ep_buffer.Buffer.get_ep_buffer_size_hint(
            self.max_tokens_per_rank, self.shapes.hidden_size, self.world_size, self.num_experts
        )
        return ep_buffer.Buffer(self.group or dist.group.WORLD, size)

    def _check_ranks(self) -> None:
        if not bool(self.active_ranks.all()):
            lost = (self.active_ranks == 0).nonzero().flatten().tolist()
            raise RuntimeError(f"Mooncake EP marked expert-parallel ranks {lost} inactive (timed out or failed)")

    def _kernel_dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        recv_x, recv_count, handle, _event, _hook = self.buffer.dispatch(
            x,
            expert_ids,
            self.active_ranks,
            self.max_tokens_per_rank,
            self.num_experts,
            self._timeout_us,
            use_fp8=False,
            async_finish=False,
            return_recv_hook=False,
        )
        self._check_ranks()
        return recv_x, recv_count, handle

    def _kernel_combine(
        self, expert_out: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, handle: Any
    ) -> torch.Tensor:
        combined, _event, _hook = self.buffer.combine(
            expert_out,
            expert_ids,
            weights,
            self.active_ranks,
            self._timeout_us,
            handle,
            async_finish=False,
            return_recv_hook=False,
        )
        self._check_ranks()
        self._timeout_us = STEADY_TIMEOUT_US
        return combined
