"""The draft backbones beside the recipes' own, as ``--set`` lines: one place that the README, the plan's
tests and the trainer benchmark take them from.

``K3_MLA_DRAFT_SETS`` turns the K3 recipe's GQA16 draft into the five-layer latent-attention (MLA) draft of
the public K3 MLA DSpark drafters: 96 heads, query rank 1,536, key/value latent 512, 128 + 64 query/key
dimensions per head (the 64 rotary, interleaved), 128 value dimensions, a sigmoid output gate; hidden size,
MLP, block size and Markov rank stay the recipe's.
"""

from __future__ import annotations

K3_MLA_DRAFT_SETS: tuple[str, ...] = (
    "trainer.draft.attention=mla",
    "trainer.draft.num_attention_heads=96",
    "trainer.draft.mla={q_lora_rank: 1536, kv_lora_rank: 512, qk_nope_head_dim: 128, qk_rope_head_dim: 64, "
    "v_head_dim: 128, use_output_gate: true, rope_interleave: true}",
)
"""``--set`` lines for the K3 MLA draft (``python3 -m launcher kimi_k3_v1c --plan --set ...``)."""

TINY_MLA_DRAFT_SETS: tuple[str, ...] = (
    "trainer.draft.attention=mla",
    "trainer.draft.mla={q_lora_rank: 64, kv_lora_rank: 64, qk_nope_head_dim: 32, qk_rope_head_dim: 16, "
    "v_head_dim: 32, use_output_gate: true, rope_interleave: true}",
)
"""``--set`` lines for an MLA draft of the tiny recipe (4 heads of hidden 256)."""

K3_HYBRID_DRAFT_SETS: tuple[str, ...] = (
    *K3_MLA_DRAFT_SETS,
    "trainer.draft.layers=[kda, kda, mla, kda, kda]",
    "trainer.draft.kda={num_heads: 96, head_dim: 128, short_conv_kernel_size: 4, gate_lower_bound: -5.0, "
    "use_full_rank_gate: true}",
)
"""``--set`` lines for the K3 KDA+MLA hybrid (KDA, KDA, MLA, KDA, KDA; the MLA layer alone reads the
target's context; each KDA layer runs over one proposal block at a time, 96 heads of 128)."""

TINY_HYBRID_DRAFT_SETS: tuple[str, ...] = (
    *TINY_MLA_DRAFT_SETS,
    "trainer.draft.num_layers=3",
    "trainer.draft.layers=[kda, mla, kda]",
    "trainer.draft.kda={num_heads: 4, head_dim: 32}",
)
"""``--set`` lines for a KDA+MLA hybrid of the tiny recipe (three layers, the middle one MLA)."""

BACKBONE_SETS: dict[str, dict[str, tuple[str, ...]]] = {
    "gqa": {"kimi_k3_v1c": (), "tiny": ()},
    "mla": {"kimi_k3_v1c": K3_MLA_DRAFT_SETS, "tiny": TINY_MLA_DRAFT_SETS},
    "kda-mla": {"kimi_k3_v1c": K3_HYBRID_DRAFT_SETS, "tiny": TINY_HYBRID_DRAFT_SETS},
}
"""Per backbone and recipe, the ``--set`` lines that give that recipe's draft this backbone."""
