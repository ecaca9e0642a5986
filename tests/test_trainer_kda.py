"""The KDA+MLA hybrid draft backbone: a KDA layer's recurrence equals an independent reference written here
(one head, one slot at a time, forward and backward), its state never crosses a proposal block, it is
causal within one, it reads no target context; the plan counts the hybrid's parameters as the model has
them, and an exported hybrid's shape is read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runtime.recipe import RecipeError, load_recipe
from runtime.recipe.backbones import BACKBONE_SETS
from runtime.recipe.fit.trainer_memory import draft_parameter_counts
from runtime.trainer.draft_spec import DraftSpec
from runtime.trainer.model import DeltaAttention

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny.yaml"
HYBRID = list(BACKBONE_SETS["kda-mla"]["tiny"])


def _spec(*extra: str) -> DraftSpec:
    return DraftSpec.from_recipe(load_recipe(TINY, [*HYBRID, *extra]).recipe)


def _kda(*extra: str) -> tuple[DeltaAttention, int]:
    torch.manual_seed(0)
    spec = _spec(*extra)
    draft = spec.build(attention_backend="sdpa").double()
    layer = draft.layers[0].self_attn
    assert isinstance(layer, DeltaAttention)
    with torch.no_grad():  # a non-zero dt_bias and convolution, so every term of the gate is exercised
        layer.dt_bias.normal_(0.0, 0.5)
    return layer, spec.draft.hidden_size


def _reference(layer: DeltaAttention, x: torch.Tensor, block_size: int) -> torch.Tensor:
    """The layer, written out: per block, per head, per slot (the short convolution as a sum over the slots
    before it in the block, the state reset to zero at every block)."""
    heads, d = layer.num_heads, layer.head_dim
    kernel = layer.q_conv1d.weight.shape[1]

    def conv(projected: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [B, C] within one block
        rows = []
        for t in range(projected.shape[0]):
            acc = torch.zeros_like(projected[0])
            for j in range(kernel):
                source = t - (kernel - 1) + j
                if source >= 0:
                    acc = acc + weight[:, j] * projected[source]
            rows.append(F.silu(acc))
        return torch.stack(rows)

    out_rows = []
    for block in x.view(-1, block_size, x.shape[-1]):
        q = conv(layer.q_proj(block), layer.q_conv1d.weight).view(block_size, heads, d)
        k = conv(layer.k_proj(block), layer.k_conv1d.weight).view(block_size, heads, d)
        v = conv(layer.v_proj(block), layer.v_conv1d.weight).view(block_size, heads, d)
        gate = (layer.f_b_proj(layer.f_a_proj(block)) + layer.dt_bias).view(block_size, heads, d)
        beta = torch.sigmoid(layer.b_proj(block))
        gate_out = torch.sigmoid(layer.g_proj(block)).view(block_size, heads, d)
        per_head = []
        for h in range(heads):
            state = torch.zeros(d, d, dtype=x.dtype)
            rate = layer.A_log[h].exp()
            outputs = []
            for t in range(block_size):
                qn = q[t, h] / q[t, h].norm().clamp_min(1e-12)
                kn = k[t, h] / k[t, h].norm().clamp_min(1e-12)
                log_decay = layer.lower_bound * torch.sigmoid(rate * gate[t, h])
                state = torch.diag(log_decay.exp()) @ state
                state = state + torch.outer(kn, beta[t, h] * (v[t, h] - kn @ state))
                o = (qn @ state) / d**0.5
                rms = o * torch.rsqrt(o.float().pow(2).mean() + layer.o_norm.eps).to(o.dtype)
                outputs.append(layer.o_norm.weight * rms * gate_out[t, h])
            per_head.append(torch.stack(outputs))
        out_rows.append(torch.stack(per_head, dim=1).reshape(block_size, heads * d))
    return layer.o_proj(torch.cat(out_rows))


def test_the_kda_layer_equals_an_independent_reference_forward_and_backward() -> None:
    layer, hidden = _kda()
    x = torch.randn(3 * 7, hidden, dtype=torch.float64, requires_grad=True)
    got = layer(x, torch.empty(0), None)  # type: ignore[arg-type]
    want = _reference(layer, x, 7)
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-5 * scale, (got - want).abs().max()
    upstream = torch.randn_like(got)
    for name, a, b in zip(
        ["x", *(n for n, _ in layer.named_parameters())],
        torch.autograd.grad(got, [x, *layer.parameters()], upstream),
        torch.autograd.grad(want, [x, *layer.parameters()], upstream),
        strict=True,
    ):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max() + 1e-12, (name, (a - b).abs().max())


def test_the_kda_state_never_crosses_a_block_and_is_causal_within_one() -> None:
    layer, hidden = _kda()
    x = torch.randn(3 * 7, hidden, dtype=torch.float64)
    before = layer(x, torch.empty(0), None)  # type: ignore[arg-type]
    alone = layer(x[7:14], torch.empty(0), None)  # type: ignore[arg-type]
    assert torch.allclose(before[7:14], alone, rtol=0, atol=1e-12), "a block's output is its own alone"
    changed = x.clone()
    changed[7:14] += 1.0
    after = layer(changed, torch.empty(0), None)  # type: ignore[arg-type]
    assert torch.equal(before[:7], after[:7]) and torch.equal(before[14:], after[14:])
    later = x.clone()
    later[10:14] += 1.0  # slots 3..6 of block 1
    moved = layer(later, torch.empty(0), None)  # type: ignore[arg-type]
    assert torch.equal(before[7:10], moved[7:10]) and not torch.equal(before[10:14], moved[10:14])


def test_a_hybrid_draft_trains_through_its_one_context_layer() -> None:
    """The whole hybrid draft: its KDA layers get no context; its MLA layer does, so the draft's hidden
    states move with the context and its loss has gradients everywhere."""
    from runtime.trainer.layout import anchor_generator, build_layout

    spec = _spec()
    torch.manual_seed(0)
    draft = spec.build(attention_backend="sdpa")
    draft.attach_frozen_vocab(
        torch.randn(spec.vocab_size, spec.draft.hidden_size), torch.randn(spec.vocab_size, spec.draft.hidden_size)
    )
    assert [type(layer.self_attn).__name__ for layer in draft.layers] == [
        "DeltaAttention",
        "LatentAttention",
        "DeltaAttention",
    ]
    ids = torch.randint(4, 100, (40,))
    mask = torch.ones(40, dtype=torch.uint8)
    layout = build_layout(
        ids, mask, num_anchors=4, block_size=7, mask_token_id=3, loss_decay_gamma=4.0, generator=anchor_generator(0, 0)
    )
    hs = torch.randn(40, spec.num_aux_layers * spec.draft.hidden_size)
    hidden = draft.draft_hidden(hs, layout)
    moved = draft.draft_hidden(hs + 1.0, layout)
    assert not torch.allclose(hidden, moved)
    hidden.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in draft.named_parameters() if "layers." in n)


def test_the_plan_counts_the_hybrids_parameters_and_an_exported_hybrid_reads_back(tmp_path: Path) -> None:
    from runtime.evaluate.draft import draft_config_from_export
    from runtime.trainer.export import draft_config

    for extra in ([], ["trainer.draft.kda.use_full_rank_gate=false", "trainer.draft.kda.gate_lower_bound=null"]):
        spec = _spec(*extra)
        draft = spec.build(attention_backend="sdpa")
        counts = draft_parameter_counts(spec.draft, spec.num_aux_layers, spec.vocab_size)
        assert counts["trainable"] == sum(p.numel() for p in draft.parameters()), extra
    spec = _spec()
    config = draft_config(spec, torch.float32)
    assert config["architectures"] == ["KimiK3DSpark4KDA1MLADraftModel"]
    assert config["linear_attn_config"]["kda_layers"] == [1, 3] and config["linear_attn_config"][
        "full_attn_layers"
    ] == [2]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    read = draft_config_from_export(path, spec)
    assert read.layer_attentions == ("kda", "mla", "kda") and read.kda == spec.draft.kda and read.mla == spec.draft.mla
    k3 = load_recipe(REPO / "recipes" / "kimi_k3_v1c.yaml", list(BACKBONE_SETS["kda-mla"]["kimi_k3_v1c"])).recipe
    assert k3.trainer.draft.layer_attentions == ("kda", "kda", "mla", "kda", "kda")


def test_a_draft_of_kda_layers_alone_is_refused_it_would_never_see_the_target() -> None:
    with pytest.raises(RecipeError, match="kda reads no target context"):
        load_recipe(TINY, [*HYBRID, "trainer.draft.layers=[kda, kda, kda]"])
    with pytest.raises(RecipeError, match="layers lists 2 attentions for num_layers 3"):
        load_recipe(TINY, [*HYBRID, "trainer.draft.layers=[kda, mla]"])
    with pytest.raises(RecipeError, match="trainer.draft.kda is not set"):
        load_recipe(TINY, ["trainer.draft.num_layers=2", "trainer.draft.layers=[kda, gqa]"])
