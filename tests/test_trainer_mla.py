"""The latent-attention (MLA) draft backbone is faithful: forward and backward equal an independent
reference written here (fp32, small shapes, one query at a time, its own rotary and its own visibility
rule), the absorbed and expanded forms agree, no proposal block sees another's tokens, the plan counts
its parameters as the model has them, and a draft in the public K3 MLA naming loads through
``init_from`` and round-trips through the export."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from runtime.recipe import load_recipe
from runtime.recipe.fit.trainer_memory import draft_parameter_counts
from runtime.trainer.draft_spec import DraftSpec
from runtime.trainer.layout import BlockLayout
from runtime.trainer.model import LatentAttention

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny.yaml"
MLA_SETS = [
    "trainer.draft.attention=mla",
    "trainer.draft.mla={q_lora_rank: 48, kv_lora_rank: 32, qk_nope_head_dim: 16, qk_rope_head_dim: 8, "
    "v_head_dim: 12, use_output_gate: true, rope_interleave: true}",
]


def _spec(*extra: str) -> DraftSpec:
    return DraftSpec.from_recipe(load_recipe(TINY, [*MLA_SETS, *extra]).recipe)


def _layout(seq_len: int = 40) -> BlockLayout:
    """Three proposal blocks of 7 slots, at anchors 5, 17 and 30 (the only eligible positions)."""
    from runtime.trainer.layout import anchor_generator, build_layout

    torch.manual_seed(1)
    ids = torch.randint(4, 100, (seq_len,))
    mask = torch.zeros(seq_len, dtype=torch.uint8)
    for anchor in (5, 17, 30):
        mask[anchor : anchor + 2] = 1
    layout = build_layout(
        ids, mask, num_anchors=3, block_size=7, mask_token_id=3, loss_decay_gamma=4.0, generator=anchor_generator(0, 0)
    )
    assert layout.anchors.tolist() == [5, 17, 30] and bool(layout.keep.all())
    return layout


def _reference_rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    """Interleaved rotary, written pair by pair: channels (2i, 2i+1) rotate by position x inv_freq[i] (the
    angle in fp32, as the served draft computes it)."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]  # [N, rope/2]
    cos, sin = (angles.cos() * scale).to(x.dtype), (angles.sin() * scale).to(x.dtype)
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def _reference_latent_attention(
    attn: LatentAttention,
    x: torch.Tensor,
    context: torch.Tensor,
    layout: BlockLayout,
    inv_freq: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The attention of every slot, one query at a time, with nothing absorbed: each key is expanded from
    its token's latent, and a slot of block b sees context tokens before its anchor and its own block."""
    h = attn.num_heads

    def norm(layer: torch.nn.Module, t: torch.Tensor) -> torch.Tensor:  # RMSNorm in fp32, as Qwen3 and the draft do
        t32 = t.float()
        return layer.weight * (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + layer.eps)).to(t.dtype)

    query = attn.q_b_proj(norm(attn.q_a_layernorm, attn.q_a_proj(x))).view(x.shape[0], h, -1)
    slot_positions = layout.positions.reshape(-1)

    def key_value(tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        compressed = attn.kv_a_proj_with_mqa(tokens)
        latent, rope = compressed[:, : attn.rank], compressed[:, attn.rank :]
        expanded = attn.kv_b_proj(norm(attn.kv_a_layernorm, latent)).view(tokens.shape[0], h, -1)
        rope = _reference_rotate(rope, positions, inv_freq, scale)
        keys = torch.cat([expanded[..., : attn.nope_dim], rope[:, None, :].expand(-1, h, -1)], dim=-1)
        return keys, expanded[..., attn.nope_dim :]

    k_ctx, v_ctx = key_value(context, torch.arange(context.shape[0]))
    k_slot, v_slot = key_value(x, slot_positions)
    q_rope = _reference_rotate(query[..., attn.nope_dim :], slot_positions, inv_freq, scale)
    queries = torch.cat([query[..., : attn.nope_dim], q_rope], dim=-1)
    out = []
    block_size = layout.block_size
    for index in range(x.shape[0]):
        block = index // block_size
        anchor = int(layout.anchors[block])
        own = slice(block * block_size, (block + 1) * block_size)
        keys = torch.cat([k_ctx[:anchor], k_slot[own]], dim=0)  # [S, h, d]
        values = torch.cat([v_ctx[:anchor], v_slot[own]], dim=0)
        scores = torch.einsum("hd,shd->hs", queries[index], keys) / math.sqrt(queries.shape[-1])
        out.append(torch.einsum("hs,shv->hv", scores.softmax(dim=-1), values).reshape(-1))
    gated = torch.stack(out) * torch.sigmoid(attn.g_proj(x))
    return attn.o_proj(gated)


def _close(a: torch.Tensor, b: torch.Tensor, bound: float = 1e-5) -> bool:
    """``a`` equals ``b`` to ``bound`` of ``b``'s largest magnitude."""
    return bool((a - b).abs().max() <= bound * b.abs().max())


def _inputs(spec: DraftSpec, layout: BlockLayout):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    draft = spec.build(attention_backend="sdpa").double()
    attn = draft.layers[0].self_attn
    assert isinstance(attn, LatentAttention)
    x = torch.randn(layout.num_blocks * layout.block_size, spec.draft.hidden_size, dtype=torch.float64)
    context = torch.randn(layout.seq_len, spec.draft.hidden_size, dtype=torch.float64)
    return draft, attn, x, context


@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_latent_attention_forward_and_backward_equal_an_independent_reference(absorbed: bool) -> None:
    spec, layout = _spec(), _layout()
    draft, attn, x, context = _inputs(spec, layout)
    x.requires_grad_(True)
    inputs = draft.attention_inputs(layout, torch.float64)
    attn.absorbed = absorbed
    got = attn(x, context, inputs)
    want = _reference_latent_attention(attn, x, context, layout, draft.latent_rope_inv_freq, draft.latent_rope_scale)
    # float64, but RMSNorm and the rotary angles run in fp32 (as Qwen3 and the served draft): agreement
    # to fp32's precision, relative to the tensor's size
    assert _close(got, want), (got - want).abs().max()
    upstream = torch.randn_like(got)
    grads = torch.autograd.grad(got, [x, *attn.parameters()], upstream)
    want_grads = torch.autograd.grad(want, [x, *attn.parameters()], upstream)
    for name, a, b in zip(["x", *(n for n, _ in attn.named_parameters())], grads, want_grads, strict=True):
        assert _close(a, b), (name, (a - b).abs().max())
    # fp32, the bound
    draft32, attn32 = draft.float(), attn.float()
    inputs32 = draft32.attention_inputs(layout, torch.float32)
    got32 = attn32(x.detach().float(), context.float(), inputs32)
    assert (got32.double() - want.detach()).abs().max() <= 1e-5


def test_the_absorbed_form_equals_the_expanded_one() -> None:
    spec, layout = _spec(), _layout()
    draft, attn, x, context = _inputs(spec, layout)
    inputs = draft.attention_inputs(layout, torch.float64)
    assert not attn.absorbed, "the expanded form is the default (faster at K3 shapes on a GPU)"
    expanded = attn(x, context, inputs)
    attn.absorbed = True
    absorbed = attn(x, context, inputs)
    assert torch.allclose(expanded, absorbed, atol=1e-10, rtol=0), (expanded - absorbed).abs().max()


def test_no_proposal_block_sees_another_blocks_tokens_nor_context_at_or_after_its_anchor() -> None:
    spec, layout = _spec(), _layout()
    draft, attn, x, context = _inputs(spec, layout)
    inputs = draft.attention_inputs(layout, torch.float64)
    before = attn(x, context, inputs)
    changed = x.clone()
    changed[7:14] += torch.randn(7, x.shape[1], dtype=x.dtype)  # block 1's slots
    after = attn(changed, context, inputs)
    assert torch.equal(before[:7], after[:7]) and torch.equal(before[14:], after[14:]), "blocks 0 and 2 unchanged"
    assert not torch.equal(before[7:14], after[7:14])
    later = context.clone()
    later[17:] += 1.0  # at and after block 1's anchor: only block 2 (anchor 30) may see it
    moved = attn(x, later, inputs)
    assert torch.equal(before[:14], moved[:14]) and not torch.equal(before[14:], moved[14:])


def test_the_plan_counts_the_latent_drafts_parameters_as_the_model_has_them() -> None:
    for extra in ([], ["trainer.draft.mla.q_lora_rank=null", "trainer.draft.mla.use_output_gate=false"]):
        spec = _spec(*extra)
        draft = spec.build(attention_backend="sdpa")
        counts = draft_parameter_counts(spec.draft, spec.num_aux_layers, spec.vocab_size)
        assert counts["trainable"] == sum(p.numel() for p in draft.parameters() if p.requires_grad), extra
    k3 = load_recipe(REPO / "recipes" / "kimi_k3_v1c.yaml").recipe
    assert draft_parameter_counts(k3.trainer.draft, 5, k3.capture.vocab_size)["trainable"] == 2_249_289_601


PUBLIC_ATTENTION_NAMES = (
    "q_a_proj.weight",
    "q_a_layernorm.weight",
    "q_b_proj.weight",
    "kv_a_proj_with_mqa.weight",
    "kv_a_layernorm.weight",
    "kv_b_proj.weight",
    "o_proj.weight",
    "g_proj.weight",
)


def test_a_draft_in_the_public_k3_mla_naming_loads_through_init_from_and_exports_the_same_names(
    tmp_path: Path,
) -> None:
    """A synthetic checkpoint named as the public K3 MLA drafters name their tensors (``model.`` prefixed,
    with the frozen vocabulary the loader ignores) is taken by init_from tensor for tensor, and the
    export writes those names back with the MLA shape in its config."""
    from safetensors.torch import load_file, save_file

    from runtime.trainer.export import draft_config, read_exported_weights

    spec = _spec()
    draft = spec.build(attention_backend="sdpa")
    names = set(draft.state_dict())
    attention = {n.split("self_attn.", 1)[1] for n in names if ".self_attn." in n}
    assert attention == set(PUBLIC_ATTENTION_NAMES)
    torch.manual_seed(5)
    public = {f"model.{n}": torch.randn_like(t) for n, t in draft.state_dict().items()}
    public["model.embed_tokens.weight"] = torch.zeros(spec.vocab_size, spec.draft.hidden_size)
    folder = tmp_path / "public-k3-mla-draft"
    folder.mkdir()
    save_file({n: t.contiguous() for n, t in public.items()}, str(folder / "model.safetensors"))
    loaded = read_exported_weights(folder, names)
    assert set(loaded) == names
    draft.load_state_dict(loaded)
    assert all(torch.equal(draft.state_dict()[n], public[f"model.{n}"]) for n in names)
    config = draft_config(spec, torch.bfloat16)
    assert config["architectures"] == ["KimiK3DSparkMLADraftModel"]
    mla = spec.draft.mla
    assert mla is not None
    for key, value in {
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "mla_use_output_gate": True,
        "rope_interleave": True,
    }.items():
        assert config[key] == value, key
    # the export's own bytes: the public names again
    save_file({n: t.contiguous() for n, t in draft.state_dict().items()}, str(tmp_path / "export.safetensors"))
    assert set(load_file(str(tmp_path / "export.safetensors"))) == names
    json.dumps(config)


def test_an_mla_draft_needs_its_shape_and_the_gqa_recipes_keep_their_digest() -> None:
    from runtime.recipe import RecipeError

    with pytest.raises(RecipeError, match="attention is mla, but trainer.draft.mla is not set"):
        load_recipe(TINY, ["trainer.draft.attention=mla"])
    with pytest.raises(RecipeError, match="qk_rope_head_dim"):
        load_recipe(TINY, [*MLA_SETS, "trainer.draft.mla.qk_rope_head_dim=7"])
    plain, explicit = load_recipe(TINY), load_recipe(TINY, ["trainer.draft.attention=gqa"])
    assert plain.digest == explicit.digest  # the new field at its default leaves the digest as it was
    assert load_recipe(TINY, MLA_SETS).digest != plain.digest


def test_the_k3_recipe_with_the_mla_draft_resolves_and_plans() -> None:
    """The K3 MLA draft (runtime/recipe/backbones.py): five latent-attention layers of 96 heads; the plan
    counts its parameters, the keys it keeps per context token and its trainer memory."""
    from launcher.plan import make_plan
    from runtime.recipe.backbones import K3_MLA_DRAFT_SETS
    from runtime.recipe.fit.trainer_memory import attention_shape

    k3 = REPO / "recipes" / "kimi_k3_v1c.yaml"
    recipe = load_recipe(k3, list(K3_MLA_DRAFT_SETS)).recipe
    shape = attention_shape(recipe.trainer.draft)
    assert (shape.heads, shape.score_dim, shape.value_dim) == (96, 192, 128)
    counts = draft_parameter_counts(recipe.trainer.draft, recipe.num_aux_layers, recipe.capture.vocab_size)
    per_layer_attention = 7168 * 1536 + 1536 + 1536 * 96 * 192 + 7168 * 576 + 512 + 512 * 96 * 256 + 2 * 96 * 128 * 7168
    assert shape.params == per_layer_attention
    gqa = draft_parameter_counts(load_recipe(k3).recipe.trainer.draft, 5, recipe.capture.vocab_size)
    assert counts["trainable"] - gqa["trainable"] == 5 * (
        per_layer_attention - attention_shape(load_recipe(k3).recipe.trainer.draft).params
    )
    plan = make_plan(recipe)
    assert plan.numbers["draft_trainable_params"] == counts["trainable"]
    assert "draft" in plan.render().lower()


def test_the_evaluation_reads_an_exported_mla_drafts_shape_back(tmp_path: Path) -> None:
    from runtime.evaluate.draft import draft_config_from_export
    from runtime.trainer.export import draft_config

    spec = _spec()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(draft_config(spec, torch.float32)))
    read = draft_config_from_export(path, spec)
    assert read.attention == "mla" and read.mla == spec.draft.mla
    built = spec.with_draft(read).build(attention_backend="sdpa")
    assert set(built.state_dict()) == set(spec.build(attention_backend="sdpa").state_dict())
