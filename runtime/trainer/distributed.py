"""Process group and FSDP2 setup: gloo on CPU, NCCL on GPU; one ``fully_shard`` unit per decoder layer."""

from __future__ import annotations

import datetime as dt
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from runtime.trainer.model import DSparkDraft
from runtime.trainer.settings import RunSettings

COLLECTIVE_MARGIN_S = 600.0
"""Collective timeout on top of ``transport.idle_timeout_s``: a rank can sit in an all-reduce while
another waits that long for its sample, and the waiting rank should be the one that fails, with
the useful message."""


def init_process_group(settings: RunSettings, idle_timeout_s: float) -> None:
    """``env://`` rendezvous (MASTER_ADDR/MASTER_PORT from the launcher)."""
    if dist.is_initialized():
        return
    backend = "nccl" if settings.device.type == "cuda" else "gloo"
    if settings.device.type == "cuda":
        torch.cuda.set_device(settings.device)
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=settings.rank,
        world_size=settings.world_size,
        timeout=dt.timedelta(seconds=idle_timeout_s + COLLECTIVE_MARGIN_S),
        device_id=settings.device if settings.device.type == "cuda" else None,
    )


def shard_model(model: DSparkDraft, settings: RunSettings) -> Any:
    """Apply FSDP2: compute in ``param_dtype``, reduce gradients in ``reduce_dtype``, fp32 master
    weights (the sharded parameters keep the dtype they were built in, fp32)."""
    mesh = init_device_mesh(settings.device.type, (settings.world_size,))
    policy = MixedPrecisionPolicy(
        param_dtype=settings.param_dtype, reduce_dtype=settings.reduce_dtype, cast_forward_inputs=False
    )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum over all ranks (a no-op without a process group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier() -> None:
    """Wait for every rank (a no-op without a process group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def gather_objects(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj`` in rank order (collective; a one-rank run needs no process group)."""
    if world_size == 1:
        return [obj]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, obj)
    return gathered
