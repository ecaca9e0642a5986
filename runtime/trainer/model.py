"""The DSpark draft: Qwen3-style decoder layers over dual-source keys/values.

- Context: ``H_ctx = hidden_norm(fc(concat(aux layers)))``, ``fc`` without bias.
- Queries are the block slots (anchor token, then mask tokens) embedded with the frozen target
  embedding. In every layer, keys/values are ``[k_proj(H_ctx); k_proj(x)]`` (same for v) with the
  layer's shared projections, ``k_norm`` on both, RoPE at context positions ``0..T-1`` and slot
  positions ``anchor + k``; the block mask of :mod:`runtime.trainer.attention_mask` decides who sees
  what. The context enters each layer as is (no ``input_layernorm``: it is normalised already).
- ``norm`` gives the post-norm draft hidden: the input of the frozen lm_head and of the confidence head.
- Markov head (``vanilla``: ``bias = W2(W1[prev])``; ``gated`` and ``rnn`` as SGLang runs them).
- Confidence head: ``Linear(H + r -> 1)`` on ``[post-norm hidden; W1[prev]]``.

Module and parameter names equal the tensor names of SGLang's DSpark draft loader (see
:mod:`runtime.trainer.export`), so export is a rename-free state dict.

The frozen embedding and lm_head are non-persistent buffers of the root module: FSDP2 does not
shard them, checkpoints and exports do not carry them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention
from torch.utils.checkpoint import checkpoint

from runtime.recipe.schema import DraftConfig
from runtime.trainer.attention_mask import dense_block_mask, flex_block_mask, padded_context_length
from runtime.trainer.compiled import compiled
from runtime.trainer.layout import BlockLayout
from runtime.trainer.objective import LossCoefficients, SampleTerms, sample_objective
from runtime.trainer.rope import apply_rotary, cos_sin, inverse_frequencies

INIT_STD = 0.02
"""Normal init std of linear and embedding weights (the Qwen3 ``initializer_range``)."""


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, weight applied in the input dtype (as Qwen3 does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension."""
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


@dataclass
class AttentionInputs:
    """What every layer's attention shares for one sample."""

    cos_ctx: torch.Tensor
    sin_ctx: torch.Tensor
    cos_draft: torch.Tensor
    sin_draft: torch.Tensor
    backend: str
    """``sdpa`` or ``flex``."""
    mask: Any
    """bool [Q, ctx_len + Q] for sdpa, a BlockMask for flex."""
    ctx_len: int
    """Context length the keys are laid out with (>= T; padded for flex)."""
    latent_rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """Latent attention's rotary tables (cos/sin of the context, then of the slots) at its rotary
    dimension; None for a draft without ``mla`` layers."""


class DraftAttention(nn.Module):
    """GQA attention of draft slots over ``[context; own block]`` keys."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """``x [Q, H]`` (after input_layernorm), ``context [T, H]`` -> ``[Q, H]``."""
        q_len, ctx_tokens = x.shape[0], context.shape[0]
        q = self.q_norm(self.q_proj(x).view(q_len, self.num_heads, self.head_dim))
        q = apply_rotary(q, inputs.cos_draft, inputs.sin_draft)
        k_ctx = self.k_norm(self.k_proj(context).view(ctx_tokens, self.num_kv_heads, self.head_dim))
        k_ctx = apply_rotary(k_ctx, inputs.cos_ctx, inputs.sin_ctx)
        k_draft = self.k_norm(self.k_proj(x).view(q_len, self.num_kv_heads, self.head_dim))
        k_draft = apply_rotary(k_draft, inputs.cos_draft, inputs.sin_draft)
        v_ctx = self.v_proj(context).view(ctx_tokens, self.num_kv_heads, self.head_dim)
        v_draft = self.v_proj(x).view(q_len, self.num_kv_heads, self.head_dim)
        if inputs.ctx_len > ctx_tokens:
            pad = inputs.ctx_len - ctx_tokens
            k_ctx = F.pad(k_ctx, (0, 0, 0, 0, 0, pad))
            v_ctx = F.pad(v_ctx, (0, 0, 0, 0, 0, pad))
        k = torch.cat([k_ctx, k_draft], dim=0).transpose(0, 1).unsqueeze(0)
        v = torch.cat([v_ctx, v_draft], dim=0).transpose(0, 1).unsqueeze(0)
        q = q.transpose(0, 1).unsqueeze(0)
        if inputs.backend == "flex":
            out = _flex_attention()(q, k, v, block_mask=inputs.mask, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=inputs.mask, enable_gqa=True)
        out = out.squeeze(0).transpose(0, 1).reshape(q_len, self.num_heads * self.head_dim)
        return self.o_proj(out)


WIDE_HEAD_FLEX_TILES: dict[str, int] = {
    "BLOCK_M": 32,
    "BLOCK_N": 32,
    "num_stages": 1,
    "num_warps": 4,
    "BLOCK_M1": 16,
    "BLOCK_N1": 32,
    "BLOCK_M2": 32,
    "BLOCK_N2": 16,
}
"""flex_attention tiles for heads wider than 256 (the absorbed latent attention)."""


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Channels ``(0, 1), (2, 3), ...`` regrouped as ``(0, 2, ...), (1, 3, ...)``: an interleaved rotary
    pair becomes a neox half pair, so :func:`apply_rotary` rotates it (queries and keys alike, so their
    dot products are those of the interleaved rotation)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs, scale: float | None
) -> torch.Tensor:
    """``q [Q, heads, d]`` over ``k [S, kv_heads, d]`` / ``v [S, kv_heads, dv]`` under the block mask:
    ``[Q, heads, dv]``."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if inputs.backend == "flex":
        # A latent head (K3: 512 + 64 = 576 wide) overflows the shared memory of flex's default tiles on a
        # Hopper GPU (416 KiB asked, 227 KiB there): smaller tiles, one pipeline stage, forward and backward.
        options = WIDE_HEAD_FLEX_TILES if q.shape[-1] > 256 and q.is_cuda else None
        out = _flex_attention()(q, k, v, block_mask=inputs.mask, scale=scale, enable_gqa=True, kernel_options=options)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=inputs.mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


class LatentAttention(nn.Module):
    """Multi-head latent attention of draft slots over ``[context; own block]`` (``trainer.draft.attention:
    mla``; the shape in ``trainer.draft.mla``). Each token, context or slot, gives one compressed latent
    ``c = kv_a_layernorm(kv_a_proj_with_mqa(t)[:rank])`` and one rotary key head shared by all heads; the
    heads' keys and values are ``kv_b_proj(c)`` (the expanded form). With :attr:`absorbed` the scores and
    values are computed in the latent space instead (``kv_b_proj`` folded into the query and the output),
    which gives the same result. Queries come from the slots through ``q_a_proj -> q_a_layernorm ->
    q_b_proj``; an output gate ``sigmoid(g_proj(x))`` multiplies each head's output before ``o_proj``.
    Module names are those of the public K3 MLA DSpark drafters."""

    default_absorbed = False
    """The form new modules take: expanded, whose keys and values are recomputed in the backward (K3 on
    an H100: 1.65 s a micro-step in 48.7 GiB; the absorbed form through flex's small wide-head tiles took
    29 s). The trainer benchmark times either (``--mla-form``)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        m = cfg.mla
        if m is None:
            raise ValueError("trainer.draft.mla is not set: a latent attention needs its shape")
        self.num_heads = cfg.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim, self.rank = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        )
        qk = self.nope_dim + self.rope_dim
        h = cfg.hidden_size
        self.q_lora = m.q_lora_rank is not None
        if m.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.num_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(h, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=False)
        self.g_proj = nn.Linear(h, self.num_heads * self.v_dim, bias=False) if m.use_output_gate else None
        self.interleave = m.rope_interleave
        self.scale = qk**-0.5
        self.absorbed = type(self).default_absorbed
        """Scores and values in the latent space: the same result as the expanded form (tested), without
        each head's keys and values of every context token (4 GiB per layer at K3's 64K context: the
        expanded form recomputes them in the backward instead of keeping them)."""

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(_deinterleave(x) if self.interleave else x, cos, sin)

    def _latent(self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's normalised latent ``[N, rank]`` and rotated shared key head ``[N, 1, rope]``."""
        compressed, key_rope = self.kv_a_proj_with_mqa(tokens).split([self.rank, self.rope_dim], dim=-1)
        return self.kv_a_layernorm(compressed), self._rotate(key_rope.unsqueeze(1), cos, sin)

    def _expanded(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        key_rope: torch.Tensor,
        inputs: AttentionInputs,
    ) -> torch.Tensor:
        """The expanded form: every head's keys and values from the latents, then plain attention."""
        keys_values = self.kv_b_proj(latent).view(latent.shape[0], self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = keys_values.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, key_rope.expand(-1, self.num_heads, -1)], dim=-1)
        return attend(torch.cat([q_nope, q_rope], dim=-1), k, v, inputs, self.scale)

    def forward(self, x: torch.Tensor, context: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """``x [Q, H]`` (after input_layernorm), ``context [T, H]`` -> ``[Q, H]``."""
        if inputs.latent_rope is None:
            raise RuntimeError("the attention inputs carry no latent rotary tables (an mla draft builds them)")
        cos_ctx, sin_ctx, cos_draft, sin_draft = inputs.latent_rope
        q_len, ctx_tokens = x.shape[0], context.shape[0]
        query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_rope = query.view(q_len, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope = self._rotate(q_rope, cos_draft, sin_draft)
        latent_ctx, rope_ctx = self._latent(context, cos_ctx, sin_ctx)
        latent_draft, rope_draft = self._latent(x, cos_draft, sin_draft)
        if inputs.ctx_len > ctx_tokens:
            pad = inputs.ctx_len - ctx_tokens
            latent_ctx = F.pad(latent_ctx, (0, 0, 0, pad))
            rope_ctx = F.pad(rope_ctx, (0, 0, 0, 0, 0, pad))
        latent = torch.cat([latent_ctx, latent_draft], dim=0)
        key_rope = torch.cat([rope_ctx, rope_draft], dim=0)
        if self.absorbed:
            expand = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
            up_key, up_value = expand.split([self.nope_dim, self.v_dim], dim=1)
            q = torch.cat([torch.einsum("qhn,hnr->qhr", q_nope, up_key), q_rope], dim=-1)
            k = torch.cat([latent.unsqueeze(1), key_rope], dim=-1)
            out_latent = attend(q, k, latent.unsqueeze(1), inputs, self.scale)
            out = torch.einsum("qhr,hvr->qhv", out_latent, up_value)
        elif torch.is_grad_enabled():  # each head's keys and values recomputed in the backward, not kept
            out = checkpoint(self._expanded, q_nope, q_rope, latent, key_rope, inputs, use_reentrant=False)
        else:
            out = self._expanded(q_nope, q_rope, latent, key_rope, inputs)
        out = out.reshape(q_len, self.num_heads * self.v_dim)
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)


class BlockShortConvolution(nn.Module):
    """Causal depthwise convolution over the slots of each block (``weight [channels, kernel]``, no bias),
    then SiLU: zero-padded at every block's first slot, so no block reads another's."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [blocks, slots, channels]`` -> the same shape."""
        kernel = self.weight.shape[1]
        padded = F.pad(x.transpose(1, 2), (kernel - 1, 0))
        return F.silu(F.conv1d(padded, self.weight.unsqueeze(1), groups=self.weight.shape[0]).transpose(1, 2))


RECURRENCE_CHUNK_BLOCKS = 32
"""Blocks whose delta-rule recurrence runs at once: each keeps a ``d x d`` state per head per slot (3.2 GB
for K3's 512 blocks of 96 heads at 128 in one slot), so the blocks go through in chunks whose states are
recomputed in the backward instead of kept."""


def _delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor
) -> torch.Tensor:
    """The gated delta rule over the slots of each block (``[blocks, slots, heads, d]`` inputs, ``beta``
    ``[blocks, slots, heads]``): the state starts empty at every block; returns ``q^T S`` per slot."""
    state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outputs = []
    for slot in range(q.shape[1]):
        state = state * decay[:, slot, :, :, None]
        key = k[:, slot]
        predicted = torch.einsum("nhd,nhde->nhe", key, state)
        delta = (v[:, slot] - predicted) * beta[:, slot, :, None]
        state = state + torch.einsum("nhd,nhe->nhde", key, delta)
        outputs.append(torch.einsum("nhd,nhde->nhe", q[:, slot], state))
    return torch.stack(outputs, dim=1)


class DeltaAttention(nn.Module):
    """Kimi Delta Attention (``trainer.draft.kda``) over each proposal block on its own: q, k, v through a
    short causal convolution and SiLU, q and k L2-normalised per head; per slot the state ``S [d, d]`` of a
    head decays channel-wise by ``exp(log_decay)``, then takes the delta rule ``S += k (beta (v - k^T S))``
    and gives ``o = q^T S / sqrt(d)``; the state starts empty at every block (no block reaches another) and
    the layer reads no target context. ``o`` goes through an RMSNorm gated by ``sigmoid(g_proj(x))`` and
    ``o_proj``. Module names are those of the public K3 KDA layers. The recurrence is plain PyTorch (a
    block has 7 slots); fla-core's chunked kernels are not used."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        k = cfg.kda
        if k is None:
            raise ValueError("trainer.draft.kda is not set: a kda layer needs its shape")
        self.num_heads, self.head_dim, self.block_size = k.num_heads, k.head_dim, cfg.block_size
        width, h = k.num_heads * k.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(h, width, bias=False)
        self.k_proj = nn.Linear(h, width, bias=False)
        self.v_proj = nn.Linear(h, width, bias=False)
        self.q_conv1d = BlockShortConvolution(width, k.short_conv_kernel_size)
        self.k_conv1d = BlockShortConvolution(width, k.short_conv_kernel_size)
        self.v_conv1d = BlockShortConvolution(width, k.short_conv_kernel_size)
        self.A_log = nn.Parameter(torch.empty(k.num_heads))
        self.f_a_proj = nn.Linear(h, k.head_dim, bias=False)
        self.f_b_proj = nn.Linear(k.head_dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.b_proj = nn.Linear(h, k.num_heads, bias=False)
        self.full_rank_gate = k.use_full_rank_gate
        if k.use_full_rank_gate:
            self.g_proj = nn.Linear(h, width, bias=False)
        else:
            self.g_a_proj = nn.Linear(h, k.head_dim, bias=False)
            self.g_b_proj = nn.Linear(k.head_dim, width, bias=False)
        self.o_norm = RMSNorm(k.head_dim, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(width, h, bias=False)
        self.lower_bound = k.gate_lower_bound

    @torch.no_grad()
    def reset_recurrence(self) -> None:
        """The recurrence's own parameters: ``A_log`` = log of U(1, 16) per head, ``dt_bias`` 0, the
        convolutions N(0, 0.02) (called by :meth:`DSparkDraft.reset_parameters`)."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        self.dt_bias.zero_()
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.weight.normal_(0.0, INIT_STD)

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """Per slot, head and key channel, the log of the state's decay (in fp32; always < 0)."""
        gate = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).unflatten(-1, (self.num_heads, -1))
        rate = self.A_log.float().exp()[:, None]
        if self.lower_bound is None:
            return -rate * F.softplus(gate)
        return self.lower_bound * torch.sigmoid(rate * gate)

    def forward(self, x: torch.Tensor, context: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """``x [Q, H]`` (after input_layernorm; Q = blocks x block_size) -> ``[Q, H]``; ``context`` unused."""
        blocks = x.view(-1, self.block_size, x.shape[-1])
        heads = (self.num_heads, self.head_dim)
        q = F.normalize(self.q_conv1d(self.q_proj(blocks)).unflatten(-1, heads).float(), dim=-1)
        k = F.normalize(self.k_conv1d(self.k_proj(blocks)).unflatten(-1, heads).float(), dim=-1)
        v = self.v_conv1d(self.v_proj(blocks)).unflatten(-1, heads).float()
        beta = torch.sigmoid(self.b_proj(blocks).float())
        decay = self.log_decay(blocks).exp()
        parts = []
        for chunk in range(0, blocks.shape[0], RECURRENCE_CHUNK_BLOCKS):
            part = [t[chunk : chunk + RECURRENCE_CHUNK_BLOCKS] for t in (q, k, v, beta, decay)]
            if torch.is_grad_enabled():  # the states are recomputed in the backward, not kept
                parts.append(checkpoint(_delta_rule, *part, use_reentrant=False))
            else:
                parts.append(_delta_rule(*part))
        out = torch.cat(parts).mul(self.head_dim**-0.5).to(x.dtype)  # [N, B, heads, d]
        return self._gated_output(out, blocks, x.shape[0])

    def _gated_output(self, out: torch.Tensor, blocks: torch.Tensor, slots: int) -> torch.Tensor:
        """``o_proj`` of the RMSNorm of ``out [N, B, heads, d]`` gated by ``sigmoid(g_proj(x))``: ``[slots, H]``."""
        gate = self.g_proj(blocks) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(blocks))
        out = self.o_norm(out) * torch.sigmoid(gate.unflatten(-1, (self.num_heads, self.head_dim)))
        return self.o_proj(out.reshape(slots, -1))


_FLEX: Any = None


def _flex_attention() -> Any:
    """flex_attention compiled once per process (eager flex materialises the full score matrix);
    the plain function inside a region that is being compiled already (a compiled layer)."""
    if torch.compiler.is_compiling():
        return flex_attention
    global _FLEX
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


class DraftMLP(nn.Module):
    """SiLU-gated MLP."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


ATTENTION_MODULES: dict[str, type[nn.Module]] = {
    "gqa": DraftAttention,
    "mla": LatentAttention,
    "kda": DeltaAttention,
}
"""The attention module of each ``trainer.draft`` layer kind."""


class DraftDecoderLayer(nn.Module):
    """Pre-norm decoder layer; one FSDP2 unit."""

    def __init__(self, cfg: DraftConfig, attention: str = "gqa") -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn: nn.Module = ATTENTION_MODULES[attention](cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)
        self.compile_forward = False
        """Run :meth:`body` compiled (set by :meth:`DSparkDraft.compile_regions`)."""

    def forward(self, x: torch.Tensor, context: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """One layer over the slots ``x [Q, H]``."""
        if self.compile_forward:
            return compiled(DraftDecoderLayer.body)(self, x, context, inputs)
        return self.body(x, context, inputs)

    def body(self, x: torch.Tensor, context: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """The layer's computation (what :meth:`forward` runs, eager or compiled)."""
        x = x + self.self_attn(self.input_layernorm(x), context, inputs)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """Markov head of rank r: ``bias = markov_w2(latent)``; the latent depends on the variant.

    - ``vanilla``: ``latent = W1[prev]``
    - ``gated``: ``latent = sigmoid(gate_proj([h; W1[prev]])) * W1[prev]``
    - ``rnn``: a gated recurrent state over the slots of a block (zero at slot 0):
      ``g, c, o = joint_proj([state; W1[prev]; h])``, ``state = g * state + (1 - g) * tanh(c)``,
      ``latent = tanh(o)`` (sigmoid on g)
    """

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)
        elif kind != "vanilla":
            raise ValueError(f"unknown Markov head type {kind!r}; use vanilla, gated or rnn")

    def forward(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``prev_tokens [N, S]``, post-norm ``hidden [N, S, H]`` -> ``(latent, W1[prev])``, both [N, S, r]."""
        embedded = self.markov_w1(prev_tokens)
        if self.kind == "vanilla":
            return embedded, embedded
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded.to(hidden.dtype)], dim=-1)))
            return gate.to(embedded.dtype) * embedded, embedded
        state = embedded.new_zeros(embedded.shape[0], self.rank)
        latents = []
        for k in range(embedded.shape[1]):
            z = torch.cat([state, embedded[:, k], hidden[:, k].to(embedded.dtype)], dim=-1)
            gate_raw, candidate_raw, output_raw = self.joint_proj(z).chunk(3, dim=-1)
            gate = torch.sigmoid(gate_raw)
            state = gate * state + (1.0 - gate) * torch.tanh(candidate_raw)
            latents.append(torch.tanh(output_raw))
        return torch.stack(latents, dim=1), embedded


class ConfidenceHead(nn.Module):
    """Predicts each slot's acceptance probability (a logit) from its post-norm hidden state."""

    def __init__(self, hidden_size: int, markov_rank: int, with_markov: bool) -> None:
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (markov_rank if with_markov else 0), 1)

    def forward(self, hidden: torch.Tensor, markov_embedding: torch.Tensor) -> torch.Tensor:
        """``[N, S, H]`` (+ ``[N, S, r]``) -> logits ``[N, S]``."""
        features = torch.cat([hidden, markov_embedding.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        return self.proj(features).squeeze(-1)


@dataclass
class SampleInputs:
    """One sample as the draft consumes it (tensors on the model's device)."""

    hs: torch.Tensor
    """[T, n_aux * H] aux-layer features."""
    lhs: torch.Tensor
    """[T, H] target post-norm last hidden state."""
    layout: BlockLayout


class DSparkDraft(nn.Module):
    """The draft plus the frozen target embedding / lm_head; ``forward`` returns the sample's loss."""

    def __init__(
        self,
        cfg: DraftConfig,
        *,
        vocab_size: int,
        num_aux_layers: int,
        attention_backend: str,
        max_length: int,
        compile_regions: bool = False,
    ) -> None:
        super().__init__()
        if attention_backend not in ("sdpa", "flex"):
            raise ValueError(f"attention backend must be sdpa or flex, got {attention_backend!r}")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.attention_backend = attention_backend
        self.max_length = max_length
        self.fc = nn.Linear(num_aux_layers * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftDecoderLayer(cfg, kind) for kind in cfg.layer_attentions)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(vocab_size, cfg.hidden_size, cfg.markov_rank, cfg.markov_type)
        self.confidence_head = (
            ConfidenceHead(cfg.hidden_size, cfg.markov_rank, cfg.confidence_uses_markov_embedding)
            if cfg.confidence_head
            else None
        )
        inv_freq, self.rope_scale = inverse_frequencies(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        self.latent_rope_dim = cfg.mla.qk_rope_head_dim if "mla" in cfg.layer_attentions and cfg.mla is not None else 0
        if self.latent_rope_dim:  # the latent attention rotates its own rotary part, at the same base and scaling
            latent_freq, self.latent_rope_scale = inverse_frequencies(
                self.latent_rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
            )
            self.register_buffer("latent_rope_inv_freq", latent_freq, persistent=False)
        self.register_buffer("embed_weight", torch.empty(0), persistent=False)
        self.register_buffer("lm_head_weight", torch.empty(0), persistent=False)
        self.reset_parameters()
        self.compile_regions(compile_regions)

    def compile_regions(self, enabled: bool) -> None:
        """Run the decoder layers, the context projection and the loss chunks' elementwise work
        through ``torch.compile`` (GPU speed: fused norms, RoPE and softmax passes; the matmuls
        stay cuBLAS calls and flex_attention its own kernels). Off, every op runs eagerly and CPU
        numerics are those of plain PyTorch."""
        self.compiled_regions = bool(enabled)
        for layer in self.layers:
            layer.compile_forward = self.compiled_regions

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Qwen3-style init: linear/embedding weights N(0, 0.02), biases 0, norm weights 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, INIT_STD)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, INIT_STD)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        for module in self.modules():
            if isinstance(module, DeltaAttention):
                module.reset_recurrence()

    def attach_frozen_vocab(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Install the target's frozen embedding and lm_head ([V, H] each, no gradients)."""
        expected = (self.vocab_size, self.cfg.hidden_size)
        for name, tensor in (("embedding", embed_weight), ("lm_head", lm_head_weight)):
            if tuple(tensor.shape) != expected:
                raise ValueError(f"frozen {name} has shape {tuple(tensor.shape)}, expected {expected}")
        self.embed_weight = embed_weight.detach()
        self.lm_head_weight = lm_head_weight.detach()

    def attention_inputs(self, layout: BlockLayout, dtype: torch.dtype) -> AttentionInputs:
        """RoPE tables and the block mask of one sample, shared by every layer."""
        device = layout.anchors.device
        ctx_positions = torch.arange(layout.seq_len, device=device, dtype=torch.int64)
        cos_ctx, sin_ctx = cos_sin(ctx_positions, self.rope_inv_freq, self.rope_scale, dtype)
        cos_draft, sin_draft = cos_sin(layout.positions.reshape(-1), self.rope_inv_freq, self.rope_scale, dtype)
        block_size = layout.block_size
        if self.attention_backend == "flex":
            ctx_len = padded_context_length(layout.seq_len, self.max_length)
            mask = flex_block_mask(layout.anchors, layout.keep, ctx_len, block_size)
        else:
            ctx_len = layout.seq_len
            mask = dense_block_mask(layout.anchors, layout.keep, ctx_len, block_size)
        latent_rope = None
        if self.latent_rope_dim:
            latent_rope = (
                *cos_sin(ctx_positions, self.latent_rope_inv_freq, self.latent_rope_scale, dtype),
                *cos_sin(layout.positions.reshape(-1), self.latent_rope_inv_freq, self.latent_rope_scale, dtype),
            )
        return AttentionInputs(
            cos_ctx,
            sin_ctx,
            cos_draft,
            sin_draft,
            self.attention_backend,
            mask,
            ctx_len,
            latent_rope,  # type: ignore[arg-type]
        )

    def draft_hidden(self, hs: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
        """Post-norm draft hidden states [N, S, H] of one sample."""
        project = compiled(DSparkDraft.project_context) if self.compiled_regions else DSparkDraft.project_context
        return self.slot_hidden(project(self, hs.to(self.fc.weight.dtype)), layout)

    def slot_hidden(self, context: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
        """Post-norm draft hidden states [N, S, H] from the projected context ``H_ctx [T, H]`` (what
        :meth:`project_context` returns; a decoder projects each accepted row once and keeps them)."""
        dtype = self.fc.weight.dtype
        if self.embed_weight.numel() == 0:
            raise RuntimeError("the frozen embedding is not attached (call attach_frozen_vocab)")
        x = F.embedding(layout.slot_token_ids.reshape(-1), self.embed_weight).to(dtype)
        inputs = self.attention_inputs(layout, dtype)
        for layer in self.layers:
            x = layer(x, context, inputs)
        return self.norm(x).view(layout.num_blocks, layout.block_size, -1)

    def project_context(self, hs: torch.Tensor) -> torch.Tensor:
        """``H_ctx = hidden_norm(fc(hs))`` [T, H]."""
        return self.hidden_norm(self.fc(hs))

    def forward(self, sample: SampleInputs, coefficients: LossCoefficients) -> SampleTerms:
        """The DSpark loss of one sample (scaled by ``coefficients``) and its metric sums."""
        hidden = self.draft_hidden(sample.hs, sample.layout)
        return sample_objective(
            hidden=hidden,
            lhs=sample.lhs,
            layout=sample.layout,
            markov_head=self.markov_head,
            confidence_head=self.confidence_head,
            lm_head_weight=self.lm_head_weight,
            coefficients=coefficients,
            fused=self.compiled_regions,
        )
