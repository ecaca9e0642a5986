"""DeepEP low-latency exchange (opt-in: ``capture.moe_exchange: deepep`` / ``--k3-moe-exchange deepep``).

Uses ``deep_ep.Buffer`` in low-latency mode with bf16 dispatch (no FP8 cast: captured hidden
states must not depend on the exchange). Chunking, layout conversion and the start-up shape
probe live in :class:`runtime.moe.exchange_low_latency.LowLatencyExchange`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from runtime.moe.exchange import import_backend_module
from runtime.moe.exchange_low_latency import LowLatencyExchange


class DeepEPExchange(LowLatencyExchange):
    """Expert-parallel dispatch/combine with DeepEP's low-latency kernels."""

    name = "deepep"

    def _make_buffer(self) -> Any:
        deep_ep = import_backend_module("deep_ep", self.name)
        shapes = self.shapes
        rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            self.max_tokens_per_rank, shapes.hidden_size, self.world_size, self.num_experts
        )
        # Low-latency mode wants one queue pair per local expert.
        return deep_ep.Buffer(
            self.group or dist.group.WORLD,
            num_nvl_bytes=0,
            num_rdma_bytes=rdma_bytes,
            low_latency_mode=True,
            num_qps_per_rank=self.experts_per_rank,
        )

    def _kernel_dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        recv_x, recv_count, handle, _event, _hook = self.buffer.low_latency_dispatch(
            x,
            expert_ids,
            self.max_tokens_per_rank,
            self.num_experts,
            use_fp8=False,
            async_finish=False,
            return_recv_hook=False,
        )
        return recv_x, recv_count, handle

    def _kernel_combine(
        self, expert_out: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, handle: Any
    ) -> torch.Tensor:
        combined, _event, _hook = self.buffer.low_latency_combine(expert_out, expert_ids, weights, handle)
        return combined
