"""The embedded capture engine's settings (built from the recipe by runtime/capture/setup.py), its replica
devices and its error type."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

COMPUTE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class EngineError(RuntimeError):
    """The engine cannot start or serve; the message names the recipe field and the fix."""


@dataclass(frozen=True)
class StreamedExperts:
    """Routed experts streamed from host memory (``capture.expert_streaming`` when enabled)."""

    gpu_budget_bytes: int | None = None
    """Device bytes the streamed store may hold; None: from ``resident_fraction``."""
    resident_fraction: float | None = None
    """Share of the MoE layers whose experts stay on the device."""
    prefetch_layers: int = 1
    """Layers copied ahead of the one running."""
    pinned: bool = True
    """Host copies in pinned memory."""


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
    expert_streaming: StreamedExperts | None = None
    """Routed experts streamed from host memory (``capture.expert_streaming`` when enabled)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        """The forward's dtype."""
        return COMPUTE_DTYPES[self.compute_dtype]


@dataclass(frozen=True)
class EmbeddedPlan:
    """The embedded engine's settings before its replica devices are picked: the capture's setup
    builds it from the recipe; :meth:`settings` picks the devices when the engine starts (a missing
    GPU is then the engine's refusal, inside the smoke gate's engine stage)."""

    base: EmbeddedSettings
    """Every setting but ``devices`` (empty) and ``commit_staging_slots``."""
    device: str
    """``capture.device``: cuda or cpu."""
    engines_per_node: int | None
    """Replicas on this node; None: one per visible GPU."""
    commit_staging_slots: int | None
    """``capture.commit_staging_slots``; None: one batch of every replica."""

    def settings(self, moe_exchange: str | None = None) -> EmbeddedSettings:
        """The engine's settings with its devices picked; ``moe_exchange`` overrides the recipe's."""
        devices = tuple(pick_devices(self.device, self.engines_per_node, self.base.compute_dtype))
        slots = self.commit_staging_slots
        if slots is None:
            slots = self.base.batch_size * max(1, len(devices))
        return dataclasses.replace(
            self.base,
            devices=devices,
            commit_staging_slots=slots,
            moe_exchange=moe_exchange or self.base.moe_exchange,
        )


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
