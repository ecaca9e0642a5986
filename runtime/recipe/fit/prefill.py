"""One capture prefill of ``data.max_length`` tokens, timed per accelerator and split into what
takes the time: the routed experts, the dense rest of the active parameters, and attention (causal
full attention, whose FLOPs grow with the square of the length, and linear attention).

- experts: 2 FLOPs per active routed-expert parameter and token (the experts' MXFP4 bytes over
  4.25 bits, times top-k over the expert count) at ``plan.expert_compute_tflops``;
- dense: 2 FLOPs per other active parameter and token (``capture.target_active_params`` less the
  routed experts': projections, shared experts, norms) at ``plan.capture_efficiency`` of the peak;
- attention, from ``capture.target_attention`` (the target config's fields): the layer mix as
  SGLang 0.5.23 reads it (0-based layer i is KDA when ``i + 1`` is in
  ``linear_attn_config.kda_layers``, every other layer full MLA attention); full attention
  counts the causal half of QK^T and PV (``2 x heads x (d_qk + d_v) x T (T + 1) / 2`` per layer) at
  ``plan.attention_tflops``; KDA counts the chunked delta rule per token and head
  (``2 x (3 d_k d_v + C (d_k + d_v))``: state read, state update and the in-chunk correction, and
  the causal in-chunk attention over C = 64 tokens) at ``plan.linear_attention_tflops``.

The work is shared evenly by the ``gpus`` that serve the prefill (tensor parallel). The streamed
experts' PCIe copies overlap this compute (prefetched) and are not part of it: the throughput
model takes the larger of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.recipe.fit.expert_routing import K3_ROUTED_EXPERTS, K3_TOP_K, MXFP4_BITS_PER_WEIGHT
from runtime.recipe.schema import Recipe

KDA_CHUNK_TOKENS = 64
"""Tokens per chunk of the chunked KDA kernels (the flash-linear-attention chunk size)."""


@dataclass(frozen=True)
class LayerMix:
    """How many decoder layers use full attention and how many linear attention."""

    full_layers: int
    linear_layers: int


def layer_mix(recipe: Recipe) -> LayerMix | None:
    """The target's layer mix (None without ``capture.target_attention``), read as SGLang 0.5.23's
    ``KimiLinearConfig.is_kda_layer`` does: 0-based layer i is linear when ``i + 1`` is in
    ``kda_layers``; every other layer is full attention."""
    attention = recipe.capture.target_attention
    if attention is None:
        return None
    layers = recipe.capture.num_target_layers
    if attention.linear_attn_config is None:
        return LayerMix(layers, 0)
    kda = set(attention.linear_attn_config.kda_layers)
    linear = sum(1 for i in range(layers) if i + 1 in kda)
    return LayerMix(layers - linear, linear)


def full_attention_flops_per_layer(recipe: Recipe) -> float:
    """FLOPs of one full-attention layer's QK^T and PV over a causal prefill of ``data.max_length``
    tokens, all heads (0 without ``capture.target_attention``)."""
    attention = recipe.capture.target_attention
    if attention is None:
        return 0.0
    t = recipe.data.max_length
    head_dims = attention.qk_nope_head_dim + attention.qk_rope_head_dim + attention.v_head_dim
    return 2.0 * attention.num_attention_heads * head_dims * t * (t + 1) / 2


def linear_attention_flops_per_layer(recipe: Recipe) -> float:
    """FLOPs of one KDA layer's chunked delta rule over ``data.max_length`` tokens, all heads (0
    without a ``linear_attn_config``)."""
    attention = recipe.capture.target_attention
    if attention is None or attention.linear_attn_config is None:
        return 0.0
    linear = attention.linear_attn_config
    d = linear.head_dim
    per_token_head = 2.0 * (3 * d * d + KDA_CHUNK_TOKENS * (d + d))
    return per_token_head * recipe.data.max_length * linear.num_heads


def routed_expert_active_params(recipe: Recipe) -> float:
    """Routed-expert parameters one token activates (0 when the recipe does not state the experts'
    bytes): the MXFP4 bytes over 4.25 bits, times top-k over the expert count."""
    expert_bytes = recipe.capture.routed_expert_weight_bytes or 0
    return expert_bytes * 8 / MXFP4_BITS_PER_WEIGHT * K3_TOP_K / K3_ROUTED_EXPERTS


@dataclass(frozen=True)
class PrefillSplit:
    """One prefill's FLOPs and seconds per accelerator, by part."""

    gpus: int
    expert_flops: float
    expert_seconds: float
    dense_flops: float
    dense_seconds: float
    mix: LayerMix | None
    """None: attention is not counted (no ``capture.target_attention``)."""
    full_attention_flops: float
    linear_attention_flops: float
    attention_seconds: float

    @property
    def seconds(self) -> float:
        """The whole prefill's compute: experts + dense + attention."""
        return self.expert_seconds + self.dense_seconds + self.attention_seconds


def prefill_split(recipe: Recipe, gpus: int) -> PrefillSplit:
    """The compute of one ``data.max_length`` prefill on each of ``gpus`` accelerators (needs
    ``capture.target_active_params``)."""
    hw, t = recipe.plan, recipe.data.max_length
    active = recipe.capture.target_active_params or 0.0
    routed = min(routed_expert_active_params(recipe), active)
    expert_flops = 2.0 * t * routed / gpus
    dense_flops = 2.0 * t * (active - routed) / gpus
    mix = layer_mix(recipe)
    full = linear = 0.0
    if mix is not None:
        full = mix.full_layers * full_attention_flops_per_layer(recipe) / gpus
        linear = mix.linear_layers * linear_attention_flops_per_layer(recipe) / gpus
    return PrefillSplit(
        gpus=gpus,
        expert_flops=expert_flops,
        expert_seconds=expert_flops / (hw.expert_compute_tflops * 1e12),
        dense_flops=dense_flops,
        dense_seconds=dense_flops / (hw.accelerator_peak_tflops * 1e12 * hw.capture_efficiency),
        mix=mix,
        full_attention_flops=full,
        linear_attention_flops=linear,
        attention_seconds=full / (hw.attention_tflops * 1e12) + linear / (hw.linear_attention_tflops * 1e12),
    )


def prefill_seconds(recipe: Recipe, gpus: int) -> float:
    """Seconds of one ``data.max_length`` prefill's compute on ``gpus`` accelerators."""
    return prefill_split(recipe, gpus).seconds
