"""The one factory of the small random Qwen3-MoE targets the capture and MoE tests build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_MOE_FIELDS: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 3,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 64,
}
"""Every layer sparse, top-3 of 8 experts, hidden 64: small enough for 2 CPU cores."""


def tiny_moe_config(**changes: Any) -> Any:
    """A ``Qwen3MoeConfig`` of :data:`TINY_MOE_FIELDS` with ``changes`` applied."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**TINY_MOE_FIELDS, **changes})


def save_tiny_moe_target(path: Path, config: Any, seed: int = 0) -> Path:
    """Save a randomly initialised (``torch.manual_seed(seed)``) fp32 causal LM of ``config`` to ``path``."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(config).float().save_pretrained(path)
    return path


def tiny_moe_capture_settings(
    target: Path, aux_layer_ids: tuple[int, ...], devices: tuple[str, ...], expert_parallel: int, **changes: Any
) -> Any:
    """fp32 ``EmbeddedSettings`` (batch 2) capturing ``aux_layer_ids`` of a :func:`tiny_moe_config` target."""
    from runtime.capture.embedded_settings import EmbeddedSettings

    return EmbeddedSettings(
        target_path=target,
        aux_layer_ids=aux_layer_ids,
        hidden_size=TINY_MOE_FIELDS["hidden_size"],
        pad_id=0,
        compute_dtype="float32",
        devices=devices,
        batch_size=2,
        expert_parallel=expert_parallel,
        **changes,
    )


def tiny_moe_requests() -> list[Any]:
    """Four capture requests of 9, 5, 12 and 7 random tokens (seeded), every token in the loss mask."""
    import torch

    from runtime.capture.engine import CaptureRequest

    gen = torch.Generator().manual_seed(3)
    out = []
    for g, length in enumerate((9, 5, 12, 7)):
        ids = tuple(torch.randint(1, 128, (length,), generator=gen).tolist())
        out.append(CaptureRequest(g=g, epoch=0, row_index=g, row_id=f"r{g}", input_ids=ids, loss_mask=(1,) * length))
    return out
