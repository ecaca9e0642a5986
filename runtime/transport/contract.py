"""The data-plane contract (DESIGN sections 3 and 4): keys, fields, the g mapping, and the two
small APIs through which capture and trainer reach the store. Nobody else touches Mooncake.

Torch is imported only for type checking, so this module is cheap to import anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

TENSOR_FIELDS: tuple[str, ...] = ("ids", "mask", "hs", "lhs")
"""Tensor fields of one sample, in the order they are written; ``meta`` follows them, last."""
META_FIELD = "meta"
"""The commit marker: a sample exists only once its ``meta`` does."""


def sample_key(store_id: str, g: int, field_name: str) -> str:
    """Store key of one field of sample ``g``: ``{store_id}/s/{g:012d}/{field}``."""
    return f"{store_id}/s/{g:012d}/{field_name}"


def cursor_key(store_id: str) -> str:
    """Store key of the trainer's cursor (first g not consumed by a committed step)."""
    return f"{store_id}/cursor"


def heartbeat_key(store_id: str) -> str:
    """Store key of the producer's heartbeat object."""
    return f"{store_id}/heartbeat"


def global_sample_index(
    step: int,
    micro_step: int,
    rank: int,
    index_in_micro_batch: int,
    world_size: int,
    micro_batch_size: int,
    accumulation_steps: int,
) -> int:
    """The fixed map from (optimizer step, micro-step, rank, position in the micro-batch) to g.

    ``g = s*G + (m*world + r)*micro_batch + b`` with ``G = micro_batch * accumulation * world``:
    step ``s`` consumes exactly ``[s*G, (s+1)*G)``, and within a step the samples are dealt to ranks
    round-robin micro-step by micro-step, so every rank's first micro-step is at the front of the
    window (what the producer captures first).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
    if not 0 <= micro_step < accumulation_steps:
        raise ValueError(f"micro_step {micro_step} outside 0..{accumulation_steps - 1}")
    if not 0 <= index_in_micro_batch < micro_batch_size:
        raise ValueError(f"index {index_in_micro_batch} outside 0..{micro_batch_size - 1}")
    global_batch = micro_batch_size * accumulation_steps * world_size
    return step * global_batch + (micro_step * world_size + rank) * micro_batch_size + index_in_micro_batch


@dataclass
class CapturedSample:
    """One sample as the trainer receives it (DESIGN section 4)."""

    g: int
    ids: torch.Tensor
    """int64 [T]"""
    mask: torch.Tensor
    """uint8 [T], 1 on assistant tokens"""
    hs: torch.Tensor
    """bf16 [T, n_aux * H]: aux layer outputs in ``aux_layer_ids`` order"""
    lhs: torch.Tensor
    """bf16 [T, H]: last hidden state after the final norm"""
    meta: dict[str, Any] = field(default_factory=dict)
    """g, epoch, row id, T, H, layer ids, dtypes, shapes, bytes, revision, engine, checksums"""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name, in write order."""
        return {"ids": self.ids, "mask": self.mask, "hs": self.hs, "lhs": self.lhs}


class SampleProducer(Protocol):
    """Producer side of the data plane (the capture component uses only this)."""

    def next_to_capture(self) -> int | None:
        """The next g the window needs, or None while paused (window or byte watermark reached)."""

    def commit(self, g: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Write every tensor field of sample g, then ``meta`` last (idempotent upsert)."""

    def heartbeat(self, stats: dict[str, Any]) -> None:
        """Upsert the producer heartbeat (time, window, rates, errors)."""


class SampleConsumer(Protocol):
    """Consumer side of the data plane (the trainer uses only this)."""

    def fetch(self, g: int) -> CapturedSample:
        """Wait for sample g (logging what it waits for) and return it; fails after idle_timeout_s."""

    def commit_step(self, step: int) -> None:
        """After optimizer step ``step`` committed: publish the cursor ``(step + 1) * G`` and delete
        the keys this rank consumed in that step."""

    def publish_cursor(self, cursor: int) -> None:
        """Publish the cursor explicitly (a restarted trainer republishes its checkpoint's cursor)."""


CONTRACT_DTYPES: dict[str, str] = {
    "ids": "torch.int64",
    "mask": "torch.uint8",
    "hs": "torch.bfloat16",
    "lhs": "torch.bfloat16",
}
"""Dtype of every tensor field (DESIGN section 4)."""
REQUIRED_META_KEYS: tuple[str, ...] = (
    "g",
    "epoch",
    "row_id",
    "num_tokens",
    "hidden_size",
    "aux_layer_ids",
    "target_revision",
    "engine",
    "fields",
)
"""Keys every sample's ``meta`` carries (the transport adds ``fields``: dtype, shape, bytes, checksums)."""


def contract_problems(sample: CapturedSample, aux_layer_ids: list[int], hidden_size: int, max_length: int) -> list[str]:
    """Every way ``sample`` breaks the capture contract (empty when it holds): field dtypes and
    shapes, T within ``max_length``, and the meta keys, layer ids and sizes the recipe expects."""
    problems: list[str] = []
    where = f"sample g={sample.g}"
    tokens = int(sample.ids.shape[0]) if sample.ids.ndim == 1 else -1
    expected_shapes = {
        "ids": (tokens,),
        "mask": (tokens,),
        "hs": (tokens, len(aux_layer_ids) * hidden_size),
        "lhs": (tokens, hidden_size),
    }
    for name, tensor in sample.tensors().items():
        if str(tensor.dtype) != CONTRACT_DTYPES[name]:
            problems.append(f"{where}: {name} is {tensor.dtype}, the contract says {CONTRACT_DTYPES[name]}")
        if tuple(tensor.shape) != expected_shapes[name]:
            problems.append(
                f"{where}: {name} has shape {tuple(tensor.shape)}, the contract says {expected_shapes[name]}"
            )
    if not 1 <= tokens <= max_length:
        problems.append(f"{where}: T={tokens} is outside 1..{max_length} (data.max_length)")
    missing = [key for key in REQUIRED_META_KEYS if key not in sample.meta]
    if missing:
        problems.append(f"{where}: meta lacks {missing}")
    if "aux_layer_ids" in sample.meta and list(sample.meta["aux_layer_ids"]) != list(aux_layer_ids):
        problems.append(
            f"{where}: meta aux_layer_ids {sample.meta['aux_layer_ids']} != capture.aux_layer_ids {aux_layer_ids}"
        )
    if "hidden_size" in sample.meta and sample.meta["hidden_size"] != hidden_size:
        problems.append(f"{where}: meta hidden_size {sample.meta['hidden_size']} != capture.hidden_size {hidden_size}")
    if "num_tokens" in sample.meta and sample.meta["num_tokens"] != tokens:
        problems.append(f"{where}: meta num_tokens {sample.meta['num_tokens']} != T={tokens}")
    return problems
