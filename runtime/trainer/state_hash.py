"""SHA-256 of a state dict's full tensors: the ``weights_sha256`` and ``optimizer_sha256`` a
checkpoint records, checked again after every load.

Two schemes, named in the checkpoint's ``hash_scheme``:

- :data:`HASH_SCHEME` (every checkpoint written now): one SHA-256 over each tensor's name, dtype,
  shape and the SHA-256 of its bytes, in name order. The tensors are hashed on
  :data:`HASH_THREADS` threads.
- :data:`SEQUENTIAL_HASH_SCHEME` (checkpoints that record none): one SHA-256 over every tensor's
  name, dtype, shape and bytes, in name order, on one thread.

Why it matters: a stop (``scancel``, preemption) must finish its checkpoint before Slurm's SIGKILL.
For the K3 draft's 25 GiB of fp32 weights and AdamW moments, one sequential SHA-256 took 53 s on an
H200 host. Hashed per tensor on 8 threads, the time still went to copying each gathered CUDA tensor
into fresh pageable host memory (about 1.2 GB/s). Copied into a few reused pinned buffers
(:data:`STAGING_BUFFERS`) while earlier tensors are hashed, both hashes took 5.3 s
(``tools/bench/trainer.py --section checkpoint``).
"""

from __future__ import annotations

import hashlib
import queue
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from runtime.shared.checkpoint_folders import SEQUENTIAL_HASH_SCHEME
from runtime.user_errors import UserError

HASH_THREADS = 8
"""Tensors (or checkpoint files) hashed at once."""
HASH_SCHEME = "sha256-per-tensor/1"
"""The ``hash_scheme`` of every checkpoint written now (see the module docstring)."""
KNOWN_HASH_SCHEMES = (HASH_SCHEME, SEQUENTIAL_HASH_SCHEME)
STAGING_BUFFERS = 4
"""Pinned host buffers that CUDA tensors are copied into for hashing, each the size of the largest
tensor (about 0.4 GB for the K3 draft). The copies run at pinned speed, and host memory holds this
many tensors at a time."""


class UnknownHashSchemeError(UserError, ValueError):
    """A checkpoint names a hash scheme this trainer does not know."""


def state_dict_sha256(state_dict: dict[str, Any], scheme: str = HASH_SCHEME) -> str:
    """SHA-256 of full tensors in name order, by ``scheme``; the same digest at any world size.
    Collective when the tensors are DTensors (every rank must call it), and every rank returns the
    digest.

    The per-tensor scheme shares the work: tensor i (in name order) is hashed by rank
    ``i % world_size``, and the records are gathered and folded in name order. The sequential scheme
    (checked on loads of old checkpoints only) is hashed by rank 0. While the hashing threads work on
    the tensors before it, this thread gathers the next one and copies it to the host.
    """
    if scheme not in KNOWN_HASH_SCHEMES:
        raise UnknownHashSchemeError(
            f"unknown hash_scheme {scheme!r} (this trainer knows {', '.join(KNOWN_HASH_SCHEMES)})"
        )
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    sequential = scheme == SEQUENTIAL_HASH_SCHEME
    if sequential:
        return _sequential_sha256(state_dict, distributed)
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    names = sorted(state_dict)
    mine = {name for index, name in enumerate(names) if index % world == rank}
    staging = _Staging({name: state_dict[name] for name in mine})
    records: list[tuple[int, bytes]] = []
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        waiting: deque[tuple[int, Future[bytes | None]]] = deque()
        for index, name in enumerate(names):
            tensor = state_dict[name]
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()  # every rank takes part in the gather
            if name not in mine:
                continue
            host, release = staging.host_copy(tensor.detach())
            if len(waiting) >= HASH_THREADS:
                done_index, done = waiting.popleft()
                records.append((done_index, done.result() or b""))
            waiting.append((index, pool.submit(_released, release, _tensor_record, name, host)))
        while waiting:
            done_index, done = waiting.popleft()
            records.append((done_index, done.result() or b""))
    if distributed:
        every: list[Any] = [None] * world
        dist.all_gather_object(every, records)
        records = [record for part in every for record in part]
    digest = hashlib.sha256()
    for _, record in sorted(records):
        digest.update(record)
    return digest.hexdigest()


def _sequential_sha256(state_dict: dict[str, Any], distributed: bool) -> str:
    """The sequential scheme: rank 0 feeds one digest every tensor's header and bytes in name order."""
    hashing = not distributed or dist.get_rank() == 0
    digest = hashlib.sha256()
    staging = _Staging(state_dict) if hashing else None
    with ThreadPoolExecutor(max_workers=1) as pool:
        waiting: deque[Future[bytes | None]] = deque()
        for name in sorted(state_dict):
            tensor = state_dict[name]
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()  # every rank takes part in the gather
            if staging is None:
                continue
            host, release = staging.host_copy(tensor.detach())
            if waiting:
                _fold(digest, waiting.popleft())
            waiting.append(pool.submit(_released, release, _hash_into, digest, name, host))
        while waiting:
            _fold(digest, waiting.popleft())
    result = [digest.hexdigest() if hashing else ""]
    if distributed:
        dist.broadcast_object_list(result, src=0)
    return str(result[0])


class _Staging:
    """Host copies of a state dict's tensors for hashing. A CUDA tensor goes into one of
    :data:`STAGING_BUFFERS` reused pinned buffers, waiting for a free one. A host tensor is used as it is."""

    def __init__(self, state_dict: dict[str, Any]) -> None:
        cuda = [t for t in state_dict.values() if isinstance(t, torch.Tensor) and t.is_cuda]
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        if cuda:
            size = max(t.numel() * t.element_size() for t in cuda)
            for _ in range(STAGING_BUFFERS):
                self._free.put(torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=True))

    def host_copy(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """``tensor`` on the host and the call that frees its buffer once it has been hashed."""
        if not tensor.is_cuda:
            return tensor.contiguous(), _nothing
        buffer = self._free.get()
        nbytes = tensor.numel() * tensor.element_size()
        host = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        host.copy_(tensor)  # synchronous: the bytes are there when it returns
        return host, lambda: self._free.put(buffer)


def _nothing() -> None:
    return None


def _released(release: Callable[[], None], fn: Callable[..., bytes | None], *args: Any) -> bytes | None:
    try:
        return fn(*args)
    finally:
        release()


def _fold(digest: Any, done: Future[bytes | None]) -> None:
    record = done.result()
    if record is not None:
        digest.update(record)


def _header(name: str, tensor: torch.Tensor) -> bytes:
    return f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode()


def _tensor_bytes(tensor: torch.Tensor) -> Any:
    """The host tensor's own buffer, for hashlib (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _hash_into(digest: Any, name: str, tensor: torch.Tensor) -> None:
    """The sequential scheme: feed ``digest`` the tensor's name, dtype, shape and bytes."""
    digest.update(_header(name, tensor))
    if tensor.numel():
        digest.update(_tensor_bytes(tensor))


def _tensor_record(name: str, tensor: torch.Tensor) -> bytes:
    """The per-tensor scheme: the tensor's name, dtype and shape, then the SHA-256 of its bytes."""
    own = hashlib.sha256(_tensor_bytes(tensor)) if tensor.numel() else hashlib.sha256()
    return _header(name, tensor) + own.digest()
