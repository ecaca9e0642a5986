"""Process group and FSDP2 setup: gloo on CPU, NCCL on GPU; one ``fully_shard`` unit per decoder layer."""

from __future__ import annotations

import datetime as dt
import errno
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

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


def exit_without_finalization(code: int) -> NoReturn:
    """Leave the process with ``code`` now (stdout and stderr flushed), skipping interpreter
    finalization. Call it once everything is written and the process group is destroyed: gloo worker
    threads can still hold tensors (a DTensor's gathers) whose late destruction aborts the process
    (SIGABRT, "terminate called without an active exception"), which would turn a finished rank into a
    failed task."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rendezvous_store(settings: RunSettings, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT. Rank 0 serves it from a socket bound to this
    node's bind address: torch's own TCPStore server listens on every interface (``::``). Under
    torchrun, whose agent may serve the store itself, rank 0 joins that one instead."""
    timeout = dt.timedelta(seconds=timeout_s)
    if settings.rank != 0:
        return dist.TCPStore(settings.master_addr, settings.master_port, settings.world_size, False, timeout=timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((settings.bind_address, settings.master_port))
    except OSError as exc:
        listener.close()
        # Under torchrun (benchmarks) the elastic agent may still serve its store at MASTER_PORT (torch
        # 2.11 does; 2.13 has closed it by now) and says so in this variable: then join it as a client.
        if exc.errno == errno.EADDRINUSE and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return dist.TCPStore(
                settings.master_addr, settings.master_port, settings.world_size, False, timeout=timeout
            )
        raise RuntimeError(
            f"trainer rank 0 cannot listen on {settings.bind_address}:{settings.master_port} for the rendezvous "
            f"({exc.strerror or exc}); another process holds the port: choose a free job.master_port in the recipe"
        ) from exc
    listener.listen(max(128, settings.world_size))
    # The store owns the descriptor from here on (detach: Python must not close it a second time).
    return dist.TCPStore(
        settings.master_addr,
        settings.master_port,
        settings.world_size,
        True,
        timeout=timeout,
        master_listen_fd=listener.detach(),
    )


_host_group: Any = None
"""The gloo group of :func:`all_reduce_host_sums` (made by :func:`init_process_group` when world > 1)."""


def init_process_group(settings: RunSettings, idle_timeout_s: float) -> None:
    """Rendezvous through :func:`rendezvous_store` (MASTER_ADDR/MASTER_PORT from the launcher); gloo's
    pair sockets bind this node's bind address too."""
    if dist.is_initialized():
        return
    backend = "nccl" if settings.device.type == "cuda" else "gloo"
    if settings.device.type == "cuda":
        torch.cuda.set_device(settings.device)
    timeout_s = idle_timeout_s + COLLECTIVE_MARGIN_S
    options = None
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=settings.bind_address)]
    dist.init_process_group(
        backend=backend,
        store=rendezvous_store(settings, timeout_s),
        rank=settings.rank,
        world_size=settings.world_size,
        timeout=dt.timedelta(seconds=timeout_s),
        device_id=settings.device if settings.device.type == "cuda" else None,
        pg_options=options,
    )
    global _host_group
    _host_group = None
    if settings.world_size > 1:
        # Host numbers (a micro-step's slot weights) are summed over gloo: through NCCL they would
        # go to the GPU and back, and reading the result waits for all the compute queued before it.
        # Made on every backend so the CPU tests run the same path as the GPUs.
        host_options = dist.ProcessGroupGloo._Options()
        host_options._devices = [dist.ProcessGroupGloo.create_device(hostname=settings.bind_address)]
        _host_group = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=timeout_s), pg_options=host_options)


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


def all_reduce_host_sums(values: Sequence[float]) -> list[float]:
    """``values`` summed element-wise over all ranks, in float64, on the host, in one all-reduce
    (``values`` alone without a process group)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [float(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=_host_group)
    return tensor.tolist()


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


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (itself without a process group)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
