"""Run settings of one trainer process: what :func:`runtime.trainer.setup.derive_settings` derives
once from the resolved recipe and the launcher's environment contract (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``DSPARK_JOB_DIR``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.user_errors import UserError


class TrainerSetupError(UserError, ValueError):
    """The recipe or the environment cannot start a trainer; the message names the field and the fix."""


@dataclass(frozen=True)
class RunSettings:
    """Everything about this trainer process that is derived rather than read verbatim."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    attention_backend: str
    """``sdpa`` or ``flex``."""
    num_rows: int
    """Prompt rows N (``g = epoch * N + position``)."""
    total_steps: int
    """Optimizer steps of the run: ``max_steps`` or ``floor(epochs * N / G)``, whichever is smaller."""
    chunk_rows: int
    """Slots per chunk of the vocabulary terms (``objective_chunk_blocks * block_size``)."""
    job_dir: Path
    checkpoint_dir: Path
    data_digest: str
    """SHA-256 of the training data (the recipe's, or its manifest's)."""
    smoke: bool
    compile_regions: bool = False
    """torch.compile the model's regions (``trainer.compile_regions``; auto: on CUDA)."""
    master_addr: str = "127.0.0.1"
    """Rank 0's host (MASTER_ADDR): where the rendezvous store listens."""
    master_port: int = 29500
    bind_address: str = "127.0.0.1"
    """This node's address (DSPARK_BIND_ADDRESS): the rendezvous store and gloo listen only there."""

    @property
    def is_main(self) -> bool:
        """Rank 0 writes shared files (metrics, trainer_state.json, exports, the gate)."""
        return self.rank == 0
