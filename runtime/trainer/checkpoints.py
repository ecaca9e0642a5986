"""Checkpoints (DESIGN section 6).

Layout of ``checkpoint_dir``::

    step_00000008/            one complete checkpoint
        dcp/                  torch.distributed.checkpoint: {"model": ..., "optim": ...}, sharded
        trainer_state.json    step, cursor, epoch, schedule, RNG, digests, world size, weights hash
    latest -> step_00000008   symlink to the newest complete checkpoint
    .tmp-step_00000016/       a save in progress (renamed when complete; stale ones are removed)

A checkpoint is complete once its folder has its final name, and it gets that name only after
every rank finished writing and ``trainer_state.json`` is in place: a crash mid-save leaves a
``.tmp-*`` folder and the previous checkpoints untouched. After each save the newest ``keep_last``
complete checkpoints are kept and older ones removed.

Starting (see :func:`plan_start`): ``resume_from`` (a path or ``auto``) restores everything;
``init_from`` restores the weights only. A trainer restarted inside the same job (Slurm requeue,
preemption) finds its own newest checkpoint in ``checkpoint_dir`` and resumes from it even when
the resolved recipe names neither.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from runtime.recipe.loader import atomic_write_text
from runtime.trainer.distributed import barrier

STATE_FORMAT = "dspark-trainer-state/1"
STATE_FILE = "trainer_state.json"
DCP_DIR = "dcp"
LATEST = "latest"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names both values and the fix."""


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint after ``step`` optimizer steps."""
    return f"{STEP_PREFIX}{step:08d}"


def is_complete(path: Path) -> bool:
    """A final-named folder with its trainer state (the last thing written before the rename)."""
    return path.is_dir() and path.name.startswith(STEP_PREFIX) and (path / STATE_FILE).is_file()


def complete_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Complete checkpoints in ``checkpoint_dir``, oldest first."""
    if not checkpoint_dir.is_dir():
        return []
    found = [p for p in checkpoint_dir.iterdir() if is_complete(p)]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX) :]))


def find_latest(checkpoint_dir: Path) -> Path | None:
    """The newest complete checkpoint (following ``latest`` when it is valid)."""
    link = checkpoint_dir / LATEST
    if link.is_symlink() or link.exists():
        target = (checkpoint_dir / os.readlink(link)) if link.is_symlink() else link
        if is_complete(target):
            newest = complete_checkpoints(checkpoint_dir)
            if newest and int(newest[-1].name[len(STEP_PREFIX) :]) > int(target.name[len(STEP_PREFIX) :]):
                return newest[-1]  # a crash between the rename and the link update
            return target
    found = complete_checkpoints(checkpoint_dir)
    return found[-1] if found else None


def resolve_checkpoint_path(value: str, checkpoint_dir: Path, field: str) -> Path:
    """A ``resume_from``/``init_from`` value as a complete checkpoint folder.

    Accepts ``auto`` (newest in ``checkpoint_dir``), a checkpoint folder, or a folder of checkpoints
    (its newest). Raises :class:`CheckpointError` naming ``field`` when nothing usable is there.
    """
    if value == "auto":
        found = find_latest(checkpoint_dir)
        if found is None:
            raise CheckpointError(f"{field} is 'auto' but {checkpoint_dir} holds no complete checkpoint")
        return found
    path = Path(os.path.expandvars(os.path.expanduser(value)))
    if is_complete(path):
        return path
    if path.is_dir():
        found = find_latest(path)
        if found is not None:
            return found
    raise CheckpointError(
        f"{field} is {value!r}: no complete checkpoint there (a folder named {STEP_PREFIX}NNNNNNNN with "
        f"{STATE_FILE}, or a folder holding such checkpoints); fix: point {field} at one"
    )


def read_state(path: Path) -> dict[str, Any]:
    """``trainer_state.json`` of a checkpoint."""
    state = json.loads((path / STATE_FILE).read_text())
    if state.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{path / STATE_FILE}: format {state.get('format')!r}, expected {STATE_FORMAT!r}")
    return state


# ----------------------------------------------------------------------------------------------
# RNG
# ----------------------------------------------------------------------------------------------


def rng_state() -> dict[str, str | None]:
    """This rank's torch RNG states, base64."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "cuda": base64.b64encode(cuda.numpy().tobytes()).decode() if cuda is not None else None,
    }


def restore_rng(state: dict[str, str | None]) -> None:
    """Restore what :func:`rng_state` recorded."""
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"] or "")), dtype=torch.uint8))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"] or "")), dtype=torch.uint8))


# ----------------------------------------------------------------------------------------------
# hashing
# ----------------------------------------------------------------------------------------------


def state_dict_sha256(state_dict: dict[str, Any]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes of full tensors, in name order. Collective when the
    tensors are DTensors (every rank must call it): rank 0 hashes, every rank returns its digest."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    hashing = not distributed or dist.get_rank() == 0
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name]
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()  # every rank takes part in the gather
        if not hashing:
            continue
        tensor = tensor.detach().contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    result = [digest.hexdigest() if hashing else ""]
    if distributed:
        dist.broadcast_object_list(result, src=0)
    return str(result[0])


def model_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of the model's (fp32 master) weights."""
    return state_dict_sha256(get_model_state_dict(model))


# ----------------------------------------------------------------------------------------------
# save / load
# ----------------------------------------------------------------------------------------------


@dataclass
class SavedCheckpoint:
    """What :func:`save_checkpoint` wrote."""

    path: Path
    weights_sha256: str


def save_checkpoint(
    checkpoint_dir: Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    rng_states: list[dict[str, Any]],
    keep_last: int,
    is_main: bool,
) -> SavedCheckpoint:
    """Write checkpoint ``step`` (collective: every rank calls it). ``state`` is the trainer state
    (without RNG and hash, which this adds); ``rng_states`` holds every rank's, gathered."""
    final = checkpoint_dir / step_dir_name(step)
    tmp = checkpoint_dir / f"{TMP_PREFIX}{step_dir_name(step)}"
    if is_main:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        for stale in checkpoint_dir.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / DCP_DIR))
    weights_hash = state_dict_sha256(model_state)
    barrier()
    if is_main:
        payload = {
            "format": STATE_FORMAT,
            **state,
            "rng": rng_states,
            "weights_sha256": weights_hash,
            "saved_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "torch_version": torch.__version__,
        }
        atomic_write_text(tmp / STATE_FILE, json.dumps(payload, indent=2) + "\n")
        if final.exists():  # the same step saved again after a restart: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _point_latest(checkpoint_dir, final.name)
        _prune(checkpoint_dir, keep_last)
    barrier()
    return SavedCheckpoint(path=final, weights_sha256=weights_hash)


def _point_latest(checkpoint_dir: Path, name: str) -> None:
    link = checkpoint_dir / LATEST
    tmp = checkpoint_dir / f"{TMP_PREFIX}{LATEST}{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(name, tmp)
    os.replace(tmp, link)


def _prune(checkpoint_dir: Path, keep_last: int) -> None:
    for old in complete_checkpoints(checkpoint_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load_full(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore model and optimizer from checkpoint ``path`` (collective)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    bundle = {"model": model_state, "optim": optim_state}
    dcp.load(bundle, checkpoint_id=str(path / DCP_DIR))
    set_state_dict(model, optimizer, model_state_dict=bundle["model"], optim_state_dict=bundle["optim"])


def load_weights(path: Path, model: torch.nn.Module) -> None:
    """Restore the model's weights only, from one of our checkpoints or from an exported
    safetensors draft (collective)."""
    if is_complete(path):
        model_state = get_model_state_dict(model)
        bundle = {"model": model_state}
        dcp.load(bundle, checkpoint_id=str(path / DCP_DIR))
        set_model_state_dict(model, bundle["model"])
        return
    from runtime.trainer.export import read_exported_weights

    full = read_exported_weights(path, expected=set(get_model_state_dict(model)))
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))


def loaded_weights_sha256(path: Path, model: torch.nn.Module) -> str:
    """Hash of the weights stored in checkpoint ``path``, read back into fresh zeroed tensors laid out
    like ``model``'s (collective; the live model is not touched)."""
    template = get_model_state_dict(model)
    fresh = {name: torch.zeros_like(tensor) for name, tensor in template.items()}
    bundle = {"model": fresh}
    dcp.load(bundle, checkpoint_id=str(path / DCP_DIR))
    return state_dict_sha256(bundle["model"])
