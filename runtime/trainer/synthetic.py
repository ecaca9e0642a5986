"""Synthetic inputs for trainer tests and benchmarks: a small target checkpoint holding the frozen
embedding and lm_head (sharded, with an index), and random samples that follow the capture
contract with awkward loss masks (short assistant spans, spans at the very end).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.shared.contracts import CapturedSample
from runtime.trainer.file_source import write_sample_file


def write_target_checkpoint(
    folder: str | Path,
    *,
    vocab_size: int,
    hidden_size: int,
    embed_name: str = "model.embed_tokens.weight",
    lm_head_name: str = "lm_head.weight",
    seed: int = 0,
    sharded: bool = True,
) -> Path:
    """A Hugging Face style checkpoint folder with the two frozen tensors plus a decoy layer tensor.

    ``sharded``: two shards and ``model.safetensors.index.json``; otherwise one ``model.safetensors``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    embed = torch.randn(vocab_size, hidden_size, generator=generator) * 0.5
    lm_head = torch.randn(vocab_size, hidden_size, generator=generator) * (1.0 / hidden_size**0.5)
    decoy = torch.randn(hidden_size, hidden_size, generator=generator)
    if not sharded:
        save_file(
            {embed_name: embed, lm_head_name: lm_head, "model.layers.0.mlp.weight": decoy},
            str(folder / "model.safetensors"),
        )
        return folder
    shards = {
        "model-00001-of-00002.safetensors": {embed_name: embed, "model.layers.0.mlp.weight": decoy},
        "model-00002-of-00002.safetensors": {lm_head_name: lm_head},
    }
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(folder / file))
        weight_map.update({name: file for name in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def assistant_mask(num_tokens: int, generator: torch.Generator) -> torch.Tensor:
    """uint8 [T]: a few assistant spans of awkward lengths (1-token spans, a span ending at T-1)."""
    mask = torch.zeros(num_tokens, dtype=torch.uint8)
    position = int(torch.randint(1, max(2, num_tokens // 4), (1,), generator=generator))
    while position < num_tokens:
        length = int(torch.randint(1, max(2, num_tokens // 3), (1,), generator=generator))
        mask[position : position + length] = 1
        position += length + int(torch.randint(1, max(2, num_tokens // 6), (1,), generator=generator))
    mask[-3:] = 1  # anchors near the end: their later slots fall off the sequence
    return mask


def synthetic_sample(
    g: int,
    *,
    num_tokens: int,
    vocab_size: int,
    hidden_size: int,
    num_aux_layers: int,
    seed: int = 0,
    feature_dtype: torch.dtype = torch.bfloat16,
) -> CapturedSample:
    """One random sample ``g`` (deterministic in ``seed`` and ``g``)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + g)
    ids = torch.randint(0, vocab_size, (num_tokens,), generator=generator, dtype=torch.int64)
    mask = assistant_mask(num_tokens, generator)
    hs = torch.randn(num_tokens, num_aux_layers * hidden_size, generator=generator).to(feature_dtype)
    lhs = torch.randn(num_tokens, hidden_size, generator=generator).to(feature_dtype)
    meta = {"g": g, "epoch": 0, "row_id": f"synthetic-{g}", "T": num_tokens, "engine": "synthetic"}
    return CapturedSample(g=g, ids=ids, mask=mask, hs=hs, lhs=lhs, meta=meta)


def write_synthetic_samples(
    folder: str | Path,
    count: int,
    *,
    min_tokens: int,
    max_tokens: int,
    vocab_size: int,
    hidden_size: int,
    num_aux_layers: int,
    seed: int = 0,
) -> Path:
    """Write samples ``g = 0..count-1`` with lengths between ``min_tokens`` and ``max_tokens``."""
    folder = Path(folder)
    for g in range(count):
        span = max_tokens - min_tokens + 1
        length = min_tokens + (g * 7919 + seed) % span
        write_sample_file(
            folder,
            synthetic_sample(
                g,
                num_tokens=length,
                vocab_size=vocab_size,
                hidden_size=hidden_size,
                num_aux_layers=num_aux_layers,
                seed=seed,
            ),
        )
    return folder
