"""The embedded capture engine's settings from the recipe, its replica devices and its error type."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.recipe.loader import ResolvedRecipe

COMPUTE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class EngineError(RuntimeError):
    """The engine cannot start or serve; the message names the recipe field and the fix."""


@dataclass(frozen=True)
class EmbeddedSettings:
    """Everything the embedded engine needs from the recipe."""

    target_path: Path
    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    pad_id: int
    compute_dtype: str
    devices: tuple[str, ...]
    """One entry per replica: ``cpu`` or ``cuda:N``."""
    batch_size: int
    """Samples per forward of one replica."""
    target_revision: str | None = None
    expert_parallel: int = 1
    moe_exchange: str = "nccl"
    commit_staging_slots: int = 0
    """Samples staged or being committed at once while the next forward runs; 0: commit every
    sample before :meth:`EmbeddedEngine.capture` returns (no pipeline)."""
    staging_slot_bytes: int = 0
    """Size each staging slot is pinned at on first use (the largest sample of the recipe), so
    the slots are not re-pinned as longer samples come; 0: grow to the largest sample seen."""

    @classmethod
    def from_recipe(cls, resolved: ResolvedRecipe) -> EmbeddedSettings:
        """Settings of the resolved recipe's ``capture`` section (devices picked here)."""
        c = resolved.recipe.capture
        devices = tuple(pick_devices(c.device, c.engines_per_node, c.compute_dtype))
        return cls(
            target_path=resolved.resolve_path(c.target_path),
            aux_layer_ids=tuple(c.aux_layer_ids),
            hidden_size=c.hidden_size,
            pad_id=c.special_tokens.pad_id,
            compute_dtype=c.compute_dtype,
            devices=devices,
            batch_size=c.batch_size,
            target_revision=c.target_revision,
            expert_parallel=c.expert_parallel,
            moe_exchange=c.moe_exchange,
            commit_staging_slots=c.effective_commit_staging_slots(len(devices)),
            staging_slot_bytes=max_sample_feature_bytes(resolved),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The forward's dtype."""
        return COMPUTE_DTYPES[self.compute_dtype]


def max_sample_feature_bytes(resolved: ResolvedRecipe) -> int:
    """Bytes of the ``hs`` + ``lhs`` fields of the recipe's longest sample (bf16)."""
    c = resolved.recipe.capture
    return resolved.recipe.data.max_length * (len(c.aux_layer_ids) + 1) * c.hidden_size * 2 + 2 * 64


def pick_devices(device: str, engines_per_node: int | None, compute_dtype: str = "bfloat16") -> list[str]:
    """Replica devices: one per visible GPU (or ``engines_per_node`` of them), or the CPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus == 0:
        raise EngineError(
            "capture.device is 'cuda' but no CUDA GPU is visible to the capture process; fix: run on a GPU node "
            "(job.capture.gpus_per_node) or set capture.device: cpu"
        )
    if device == "cpu" or gpus == 0:
        return ["cpu"] * (engines_per_node or 1)
    count = engines_per_node or gpus
    if count > gpus:
        raise EngineError(
            f"capture.engines_per_node is {count} but only {gpus} GPUs are visible; fix: set it to at most {gpus} "
            "or null (one replica per GPU)"
        )
    return [f"cuda:{index}" for index in range(count)]
