"""The DSpark draft's parameter counts and the estimated bytes per trainer rank (FSDP2, fp32 master
weights + AdamW), at ``data.max_length``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.recipe.fit.report import Finding, FitReport
from runtime.recipe.fit.store_budget import largest_sample
from runtime.recipe.schema import DraftConfig, Recipe
from runtime.recipe.units import format_bytes

TRAINER_MEMORY_HEADROOM = 0.9
"""Share of one accelerator's memory a trainer rank may plan to use (the rest: allocator, NCCL, ...)."""


@dataclass(frozen=True)
class AttentionShape:
    """What one draft layer's attention costs, whatever its kind (``trainer.draft.attention``)."""

    params: int
    """Parameters of the layer's attention (projections, norms, gate)."""
    context_params: int
    """Parameters applied to every context token in the layer (its keys and values, both sources)."""
    key_width: int
    """Per context token and layer: the key and value elements the layer keeps (activations)."""
    heads: int
    score_dim: int
    """Per head: the query/key dimension of a score."""
    value_dim: int
    """Per head: the value dimension."""
    recurrent_flops_per_slot: int = 0
    """A recurrence's forward FLOPs per slot (``kda``: decay, prediction, update and readout of each
    head's ``d x d`` state); it attends no context."""

    @property
    def attends_context(self) -> bool:
        """Whether the layer's queries attend the context (every kind but the recurrence)."""
        return self.recurrent_flops_per_slot == 0


def attention_shape(draft: DraftConfig, kind: str | None = None) -> AttentionShape:
    """The shape of one layer's attention (``kind``, default the draft's ``attention``): grouped-query
    (``gqa``), latent (``mla``) or the delta-rule recurrence (``kda``)."""
    h, heads = draft.hidden_size, draft.num_attention_heads
    kind = kind or draft.attention
    if kind == "kda" and draft.kda is not None:
        k = draft.kda
        width = k.num_heads * k.head_dim
        gate = h * width if k.use_full_rank_gate else h * k.head_dim + k.head_dim * width
        params = (
            3 * h * width  # q, k, v
            + 3 * width * k.short_conv_kernel_size  # their short convolutions
            + k.num_heads  # A_log
            + h * k.head_dim
            + k.head_dim * width
            + width  # f_a, f_b, dt_bias
            + h * k.num_heads  # b_proj
            + gate
            + k.head_dim  # o_norm
            + width * h  # o_proj
        )
        return AttentionShape(params, 0, 0, k.num_heads, k.head_dim, k.head_dim, 8 * k.num_heads * k.head_dim**2)
    if kind == "mla" and draft.mla is not None:
        m = draft.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        lora = m.q_lora_rank
        query = (h * lora + lora + lora * heads * qk) if lora else h * heads * qk
        latent = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        expand = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        gate = h * heads * m.v_head_dim if m.use_output_gate else 0
        return AttentionShape(
            params=query + latent + expand + heads * m.v_head_dim * h + gate,
            context_params=latent + expand,
            key_width=m.kv_lora_rank + m.qk_rope_head_dim + heads * (qk + m.v_head_dim),
            heads=heads,
            score_dim=qk,
            value_dim=m.v_head_dim,
        )
    kv, hd = draft.num_key_value_heads, draft.head_dim
    params = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd  # q, k, v, o, q/k norms
    if draft.attention_bias:
        params += heads * hd + 2 * kv * hd + h
    return AttentionShape(params, 2 * h * kv * hd, 3 * kv * hd, heads, hd, hd)


def layer_shapes(draft: DraftConfig) -> list[AttentionShape]:
    """The attention shape of every layer, in order (``trainer.draft.layers`` or ``attention``)."""
    return [attention_shape(draft, kind) for kind in draft.layer_attentions]


def draft_parameter_counts(draft: DraftConfig, num_aux_layers: int, vocab_size: int) -> dict[str, int]:
    """Trainable and frozen parameter counts of the DSpark draft, by part."""
    h, inter = draft.hidden_size, draft.intermediate_size
    layers = [shape.params + 3 * h * inter + 2 * h for shape in layer_shapes(draft)]
    markov = 2 * vocab_size * draft.markov_rank
    confidence = (h + draft.markov_rank + 1) if draft.confidence_head else 0
    counts = {
        "decoder_layers": sum(layers),
        "largest_layer": max(layers),
        "fc_context": num_aux_layers * h * h + h,
        "final_norm": h,
        "markov_head": markov,
        "confidence_head": confidence,
        "frozen_embedding_and_lm_head": 2 * vocab_size * h,
    }
    counts["trainable"] = sum(
        counts[k] for k in ("decoder_layers", "fc_context", "final_norm", "markov_head", "confidence_head")
    )
    return counts


def trainer_memory_per_rank(recipe: Recipe) -> dict[str, int]:
    """Estimated bytes per trainer rank at ``data.max_length`` (FSDP2, fp32 master + AdamW)."""
    d = recipe.trainer.draft
    world = recipe.trainer_world_size
    t = recipe.data.max_length
    h, v = d.hidden_size, recipe.capture.vocab_size
    counts = draft_parameter_counts(d, recipe.num_aux_layers, v)
    p = counts["trainable"]
    compute_bytes = 2 if recipe.trainer.param_dtype == "bfloat16" else 4
    slots = recipe.trainer.loss.num_anchors * d.block_size
    chunk_slots = min(recipe.trainer.loss.objective_chunk_blocks, recipe.trainer.loss.num_anchors) * d.block_size
    sample = largest_sample(recipe)
    kv_width = sum(shape.key_width for shape in layer_shapes(d))
    return {
        "fp32 master params (sharded)": math.ceil(4 * p / world),
        "AdamW moments (sharded)": math.ceil(8 * p / world),
        "fp32 gradients (sharded)": math.ceil(4 * p / world),
        "gathered compute params (2 units)": 2 * compute_bytes * max(counts["largest_layer"], counts["fc_context"]),
        "frozen embedding + lm_head": compute_bytes * counts["frozen_embedding_and_lm_head"],
        "input sample (hs, lhs, ids, mask)": sample.total_bytes,
        "context projection activations": 3 * t * h * compute_bytes,
        "context keys/values (all layers)": t * kv_width * compute_bytes,
        "draft slot activations": d.num_layers * slots * (10 * h + 4 * d.intermediate_size) * compute_bytes,
        "loss chunk (fp32 logits/softmax)": 5 * chunk_slots * v * 4,
    }


def trainer_memory_fit(recipe: Recipe) -> FitReport:
    """The plan's trainer memory section: the bytes per rank by use, and (on GPUs) whether they fit
    one accelerator."""
    memory = trainer_memory_per_rank(recipe)
    total_memory = sum(memory.values())
    counts = draft_parameter_counts(recipe.trainer.draft, recipe.num_aux_layers, recipe.capture.vocab_size)
    report = FitReport(f"trainer memory per rank ({recipe.trainer_world_size} ranks)")
    report.numbers.update(trainer_memory_per_rank=total_memory, draft_trainable_params=counts["trainable"])
    report.rows.append(("trainable draft parameters", f"{counts['trainable']:,}"))
    report.rows += [(label, format_bytes(value)) for label, value in memory.items()]
    report.rows.append(("total per rank (estimate)", format_bytes(total_memory)))
    if recipe.job.trainer.gpus_per_node:
        hw = recipe.plan
        capacity = hw.accelerator_memory_bytes
        report.findings.append(
            Finding(
                "ok" if total_memory < TRAINER_MEMORY_HEADROOM * capacity else "blocker",
                f"trainer rank needs about {format_bytes(total_memory)} of "
                f"{format_bytes(capacity)} on one {hw.accelerator}",
            )
        )
    return report
