"""Run settings the trainer derives once from the resolved recipe and the process environment.

The environment is read here and nowhere else in the trainer: the launcher's contract
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``DSPARK_JOB_DIR``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.recipe.loader import ResolvedRecipe
from runtime.shared.contracts import ENV_BIND_ADDRESS, ENV_JOB_DIR
from runtime.shared.data_files import resolve_expected_sha256
from runtime.user_errors import UserError

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


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


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise TrainerSetupError(
                f"environment variable {name} is not set; the launcher sets RANK, LOCAL_RANK, WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT for every trainer rank (python3 -m launcher ...)"
            )
        return default
    try:
        return int(value)
    except ValueError:
        raise TrainerSetupError(f"environment variable {name}={value!r} is not an integer") from None


def _count_rows(path: Path) -> int:
    with open(path, "rb") as handle:
        return sum(1 for _ in handle)


def derive_settings(resolved: ResolvedRecipe, env: Mapping[str, str] | None = None) -> RunSettings:
    """Check the environment against the recipe and derive the run settings."""
    env = os.environ if env is None else env
    recipe = resolved.recipe
    trainer = recipe.trainer
    source = str(resolved.path)
    world_size = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK", 0)
    local_rank = _env_int(env, "LOCAL_RANK", rank)
    if world_size != recipe.trainer_world_size:
        raise TrainerSetupError(
            f"{source}: WORLD_SIZE is {world_size}, but the recipe's trainer has {recipe.trainer_world_size} "
            f"ranks (job.trainer.nodes {recipe.job.trainer.nodes} x job.trainer.tasks_per_node "
            f"{recipe.job.trainer.tasks_per_node}); fix: start one trainer process per rank of the recipe"
        )

    wants = trainer.device
    if wants == "auto":
        wants = "cuda" if torch.cuda.is_available() else "cpu"
    if wants == "cuda":
        if not torch.cuda.is_available():
            raise TrainerSetupError(
                f"{source}: trainer.device is 'cuda' but this process sees no CUDA device; fix: run on a GPU "
                "node or set trainer.device: cpu"
            )
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    backend = trainer.attention_backend
    if backend == "auto":
        backend = "flex" if device.type == "cuda" else "sdpa"
    if backend == "flex" and device.type != "cuda":
        raise TrainerSetupError(
            f"{source}: trainer.attention_backend is 'flex' on a CPU trainer; flex_attention has no CPU backward; "
            "fix: set trainer.attention_backend: sdpa (or auto)"
        )

    if recipe.data.num_rows is not None:
        num_rows = recipe.data.num_rows
    else:
        train_path = resolved.resolve_path(recipe.data.train_path)
        if not train_path.is_file():
            raise TrainerSetupError(
                f"{source}: data.num_rows is not set and data.train_path {train_path} is not readable here; "
                "fix: set data.num_rows"
            )
        num_rows = _count_rows(train_path)
    samples = trainer.epochs * num_rows
    steps_in_data = samples // trainer.global_batch_size
    if steps_in_data < 1:
        raise TrainerSetupError(
            f"{source}: trainer.epochs {trainer.epochs} x data rows {num_rows} = {samples} samples, fewer than "
            f"one global batch (trainer.global_batch_size {trainer.global_batch_size}); fix: more epochs or rows"
        )
    total_steps = min(trainer.max_steps, steps_in_data) if trainer.max_steps else steps_in_data

    job_dir = Path(env.get(ENV_JOB_DIR) or resolved.job_dir)
    checkpoint_dir = resolved.checkpoint_dir(job_dir)
    data_digest = resolve_expected_sha256(resolved.resolve_path(recipe.data.train_path), recipe.data.expected_sha256)
    return RunSettings(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        device=device,
        param_dtype=_DTYPES[trainer.param_dtype],
        reduce_dtype=_DTYPES[trainer.reduce_dtype],
        attention_backend=backend,
        num_rows=num_rows,
        total_steps=total_steps,
        chunk_rows=trainer.loss.objective_chunk_blocks * trainer.draft.block_size,
        job_dir=job_dir,
        checkpoint_dir=checkpoint_dir,
        data_digest=data_digest,
        smoke=resolved.smoke,
        compile_regions=trainer.compile_regions == "on"
        or (trainer.compile_regions == "auto" and device.type == "cuda"),
        master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
        master_port=_env_int(env, "MASTER_PORT", recipe.job.master_port),
        bind_address=env.get(ENV_BIND_ADDRESS) or "127.0.0.1",
    )
