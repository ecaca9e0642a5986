"""Read single tensors (the frozen embedding and lm_head) from a target checkpoint by name.

The target is a Hugging Face folder: sharded safetensors with ``model.safetensors.index.json``, or a
single ``model.safetensors``. Only the shard holding each tensor is opened, and only that tensor is
read (safetensors maps the file; a 1.5 TB K3 checkpoint costs two tensor reads).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class FrozenVocabSource:
    """Where the draft's frozen embedding and lm_head come from: the target's tensors by name."""

    target_dir: Path
    """``capture.target_path``, resolved."""
    embed_tensor_name: str
    """``trainer.embed_tensor_name``."""
    lm_head_tensor_name: str
    """``trainer.lm_head_tensor_name``."""


class TargetTensorError(LookupError):
    """A tensor the trainer needs is missing from the target checkpoint (or cannot be read)."""


def _tensor_files(target_dir: Path) -> tuple[Path, dict[str, str] | None]:
    """The index file and its weight map, or the single safetensors file and None."""
    index = target_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise TargetTensorError(f"{index}: not a safetensors index (no 'weight_map'): {exc}") from exc
        return index, weight_map
    single = target_dir / SINGLE_FILE
    if single.is_file():
        return single, None
    raise TargetTensorError(
        f"target checkpoint folder {target_dir} has neither {INDEX_FILE} nor {SINGLE_FILE}; "
        "fix: point capture.target_path at the Hugging Face checkpoint folder"
    )


def read_target_tensor(target_dir: str | Path, name: str, *, recipe_field: str) -> torch.Tensor:
    """Tensor ``name`` from the checkpoint in ``target_dir``, without loading anything else.

    ``recipe_field`` (e.g. ``trainer.embed_tensor_name``) is named in the error when ``name`` is absent.
    """
    target_dir = Path(target_dir)
    source, weight_map = _tensor_files(target_dir)
    if weight_map is not None:
        names = list(weight_map)
        shard = weight_map.get(name)
        path = target_dir / shard if shard else None
    else:
        with safe_open(str(source), framework="pt") as handle:
            names = list(handle.keys())
        path = source if name in names else None
    if path is None:
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        hint = f"; close names: {', '.join(close)}" if close else ""
        raise TargetTensorError(
            f"{source}: the target checkpoint has no tensor '{name}' ({recipe_field}){hint}; "
            f"fix: set {recipe_field} to the tensor's name in this checkpoint"
        )
    if not path.is_file():
        raise TargetTensorError(f"{source} maps '{name}' to {path.name}, which does not exist in {target_dir}")
    with safe_open(str(path), framework="pt") as handle:
        if name not in set(handle.keys()):
            raise TargetTensorError(f"{path}: the index lists '{name}' in this shard, but the shard lacks it")
        return handle.get_tensor(name)


def load_frozen_vocab(
    target_dir: str | Path,
    *,
    embed_tensor_name: str,
    lm_head_tensor_name: str,
    vocab_size: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and lm_head as ``[vocab, hidden]`` tensors in ``dtype`` on ``device``."""
    out = []
    for name, field in (
        (embed_tensor_name, "trainer.embed_tensor_name"),
        (lm_head_tensor_name, "trainer.lm_head_tensor_name"),
    ):
        tensor = read_target_tensor(target_dir, name, recipe_field=field)
        if tuple(tensor.shape) != (vocab_size, hidden_size):
            raise TargetTensorError(
                f"{target_dir}: tensor '{name}' ({field}) has shape {tuple(tensor.shape)}, but the recipe "
                f"says [capture.vocab_size {vocab_size}, capture.hidden_size {hidden_size}]; "
                "fix: correct those recipe fields or the tensor name"
            )
        out.append(tensor.to(device=device, dtype=dtype))
    return out[0], out[1]
