"""A toy target (a small random Qwen3 causal LM, in memory) and a toy DSpark draft over it, for the
speculative decoder's unit and statistical tests: real transformers and real draft code, shapes
small enough that thousands of decodes take seconds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.evaluate.draft import DraftProposer
from runtime.evaluate.target import TargetDecoder
from runtime.recipe.schema import DraftConfig
from runtime.trainer.model import DSparkDraft

AUX_LAYER_IDS = (0, 1)


@dataclass
class ToyPair:
    """A toy target and a draft over it."""

    target: TargetDecoder
    proposer: DraftProposer
    model: torch.nn.Module
    """The target's causal LM (for exact distributions by enumeration)."""


def toy_pair(vocab_size: int, block_size: int, seed: int, logit_scale: float = 1.0) -> ToyPair:
    """A random 3-layer Qwen3 target with ``vocab_size`` tokens and a random 1-layer draft reading
    its layers 0 and 1. ``logit_scale`` multiplies the target's lm_head (larger: more peaked)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    cfg = DraftConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        max_position_embeddings=128,
        block_size=block_size,
        mask_token_id=vocab_size - 1,
        markov_rank=8,
    )
    draft = DSparkDraft(
        cfg, vocab_size=vocab_size, num_aux_layers=len(AUX_LAYER_IDS), attention_backend="sdpa", max_length=64
    )
    draft.attach_frozen_vocab(model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach())
    return ToyPair(TargetDecoder(model, AUX_LAYER_IDS), DraftProposer(draft.eval()), model)
