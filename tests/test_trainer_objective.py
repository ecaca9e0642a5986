"""DSpark draft + loss against a deliberately simple reference written here from the DSpark objective,
plus direct checks of anchors, slot/label alignment, eval masks, weights and the attention mask."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.recipe.schema import DraftConfig, RopeScaling
from runtime.trainer.attention_mask import dense_block_mask, dspark_mask_mod
from runtime.trainer.layout import BlockLayout, anchor_generator, build_layout, eligible_anchor_mask
from runtime.trainer.model import DSparkDraft, SampleInputs
from runtime.trainer.objective import loss_coefficients
from runtime.trainer.rope import inverse_frequencies
from runtime.trainer.vocab_objective import chunk_terms, chunked_vocab_objective

VOCAB, HIDDEN, N_AUX = 97, 32, 3
BLOCK, GAMMA, MASK_ID = 4, 4.0, 5
CE_W, L1_W, CONF_W = 0.1, 0.9, 1.0


def draft_config(
    markov_type: str = "vanilla", num_layers: int = 2, rope_scaling: RopeScaling | None = None
) -> DraftConfig:
    return DraftConfig(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        max_position_embeddings=256,
        block_size=BLOCK,
        mask_token_id=MASK_ID,
        markov_rank=6,
        markov_type=markov_type,
    )


def awkward_sample(seed: int, num_tokens: int = 40) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, mask with a 1-token span, a 2-token span, a long span and a span reaching T-1; hs; lhs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (num_tokens,), generator=g)
    mask = torch.zeros(num_tokens, dtype=torch.uint8)
    mask[3] = 1  # 1-token span: no eligible anchor
    mask[7:9] = 1  # 2-token span: anchor 7 with only slot 0 supervised
    mask[14:24] = 1
    mask[num_tokens - 4 :] = 1  # anchors near the end: later labels fall off the sequence
    hs = torch.randn(num_tokens, N_AUX * HIDDEN, generator=g)
    lhs = torch.randn(num_tokens, HIDDEN, generator=g)
    return ids, mask, hs, lhs


def make_model(cfg: DraftConfig, seed: int = 0) -> DSparkDraft:
    torch.manual_seed(seed)
    model = DSparkDraft(cfg, vocab_size=VOCAB, num_aux_layers=N_AUX, attention_backend="sdpa", max_length=64)
    with torch.no_grad():  # larger than init so that every term has visible gradients
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    g = torch.Generator().manual_seed(seed + 1)
    model.attach_frozen_vocab(torch.randn(VOCAB, HIDDEN, generator=g), torch.randn(VOCAB, HIDDEN, generator=g) * 0.3)
    return model


def layout_for(ids: torch.Tensor, mask: torch.Tensor, num_anchors: int, g: int = 11) -> BlockLayout:
    return build_layout(
        ids,
        mask,
        num_anchors=num_anchors,
        block_size=BLOCK,
        mask_token_id=MASK_ID,
        loss_decay_gamma=GAMMA,
        generator=anchor_generator(3, g),
    )


# ----------------------------------------------------------------------------------------------
# the reference: loops over blocks, layers, heads and slots; dense softmaxes; float64
# ----------------------------------------------------------------------------------------------


def ref_rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def ref_rope(vec: torch.Tensor, position: int, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    half = vec.shape[-1] // 2
    out = torch.empty_like(vec)
    for i in range(half):
        angle = position * float(inv_freq[i])
        c, s = math.cos(angle) * scale, math.sin(angle) * scale
        out[..., i] = vec[..., i] * c - vec[..., i + half] * s
        out[..., i + half] = vec[..., i + half] * c + vec[..., i] * s
    return out


def reference_loss(model: DSparkDraft, ids, mask, hs, lhs, anchors, keep) -> torch.Tensor:
    cfg = model.cfg
    P = {name: p for name, p in model.named_parameters()}
    embed = model.embed_weight.double()
    lm_head = model.lm_head_weight.double()
    inv_freq, scale = model.rope_inv_freq.double(), model.rope_scale
    T, S, nh, nkv, hd = len(ids), cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    group = nh // nkv

    def lin(x, name):
        return x @ P[name].T

    context = ref_rms(lin(hs.double(), "fc.weight"), P["hidden_norm.weight"])
    blocks = []
    for i in range(len(anchors)):
        a = int(anchors[i])
        tokens = [int(ids[a]) if keep[i] else MASK_ID] + [MASK_ID] * (S - 1)
        blocks.append(torch.stack([embed[t] for t in tokens]))
    for layer in range(cfg.num_layers):
        pre = f"layers.{layer}."
        new_blocks = []
        for i, x in enumerate(blocks):
            a = int(anchors[i])
            xn = ref_rms(x, P[pre + "input_layernorm.weight"])
            visible_ctx = list(range(a)) if keep[i] else []
            keys, values = [], []
            for j in visible_ctx:
                k = ref_rms(
                    lin(context[j], pre + "self_attn.k_proj.weight").view(nkv, hd), P[pre + "self_attn.k_norm.weight"]
                )
                keys.append(ref_rope(k, j, inv_freq, scale))
                values.append(lin(context[j], pre + "self_attn.v_proj.weight").view(nkv, hd))
            for s in range(S):
                k = ref_rms(
                    lin(xn[s], pre + "self_attn.k_proj.weight").view(nkv, hd), P[pre + "self_attn.k_norm.weight"]
                )
                keys.append(ref_rope(k, a + s, inv_freq, scale))
                values.append(lin(xn[s], pre + "self_attn.v_proj.weight").view(nkv, hd))
            keys_t, values_t = torch.stack(keys), torch.stack(values)
            outs = []
            for s in range(S):
                q = ref_rms(
                    lin(xn[s], pre + "self_attn.q_proj.weight").view(nh, hd), P[pre + "self_attn.q_norm.weight"]
                )
                q = ref_rope(q, a + s, inv_freq, scale)
                heads = []
                for h in range(nh):
                    scores = torch.stack([q[h] @ keys_t[j, h // group] for j in range(len(keys))]) / math.sqrt(hd)
                    probs = torch.softmax(scores, dim=0)
                    heads.append(sum(probs[j] * values_t[j, h // group] for j in range(len(keys))))
                outs.append(torch.cat(heads))
            x = x + lin(torch.stack(outs), pre + "self_attn.o_proj.weight")
            xn2 = ref_rms(x, P[pre + "post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(lin(xn2, pre + "mlp.gate_proj.weight"))
            x = x + lin(gate * lin(xn2, pre + "mlp.up_proj.weight"), pre + "mlp.down_proj.weight")
            new_blocks.append(x)
        blocks = new_blocks

    w1, w2 = P["markov_head.markov_w1.weight"], P["markov_head.markov_w2.weight"]
    ce_sum = l1_sum = bce_sum = weight_sum = 0.0
    for i, x in enumerate(blocks):
        if not keep[i]:
            continue
        a = int(anchors[i])
        hidden = ref_rms(x, P["norm.weight"])
        state = torch.zeros(cfg.markov_rank, dtype=torch.float64)
        still_valid = True
        for k in range(S):
            label_index = a + k + 1
            still_valid = still_valid and label_index < T and bool(mask[label_index])
            if not still_valid:
                break  # the supervised slots are a contiguous prefix
            prev = int(ids[a + k])
            embedded = w1[prev]
            if cfg.markov_type == "vanilla":
                latent = embedded
            elif cfg.markov_type == "gated":
                gate_in = torch.cat([hidden[k], embedded])
                latent = (
                    torch.sigmoid(gate_in @ P["markov_head.gate_proj.weight"].T + P["markov_head.gate_proj.bias"])
                    * embedded
                )
            else:
                z = (
                    torch.cat([state, embedded, hidden[k]]) @ P["markov_head.joint_proj.weight"].T
                    + P["markov_head.joint_proj.bias"]
                )
                g_raw, c_raw, o_raw = z.chunk(3)
                g = torch.sigmoid(g_raw)
                state = g * state + (1 - g) * torch.tanh(c_raw)
                latent = torch.tanh(o_raw)
            weight = math.exp(-k / GAMMA)
            logits = hidden[k] @ lm_head.T + w2 @ latent
            label = int(ids[label_index])
            ce = torch.logsumexp(logits, 0) - logits[label]
            p = torch.softmax(logits, 0)
            q = torch.softmax(lhs[label_index - 1].double() @ lm_head.T, 0)
            l1 = (p - q).abs().sum()
            accept = torch.clamp(1 - 0.5 * l1, 0, 1).detach()
            conf = (
                torch.cat([hidden[k], embedded]) @ P["confidence_head.proj.weight"][0]
                + P["confidence_head.proj.bias"][0]
            )
            bce = -(
                accept * torch.nn.functional.logsigmoid(conf) + (1 - accept) * torch.nn.functional.logsigmoid(-conf)
            )
            ce_sum = ce_sum + weight * ce
            l1_sum = l1_sum + weight * l1
            bce_sum = bce_sum + weight * bce
            weight_sum += weight
    return (CE_W * ce_sum + L1_W * l1_sum + CONF_W * bce_sum) / weight_sum


@pytest.mark.parametrize("markov_type", ["vanilla", "gated", "rnn"])
def test_loss_and_gradients_equal_simple_reference(markov_type: str) -> None:
    cfg = draft_config(markov_type)
    model = make_model(cfg).double()
    ids, mask, hs, lhs = awkward_sample(1)
    layout = layout_for(ids, mask, num_anchors=16)  # more blocks than eligible anchors: padded blocks
    assert not bool(layout.keep.all()) and bool(layout.keep.any())
    coefficients = loss_coefficients(
        ce_weight=CE_W,
        l1_weight=L1_W,
        confidence_weight=CONF_W,
        global_weight_sum=float(layout.weights.sum()),
        gradient_scale=1.0,
        chunk_rows=5,  # not a multiple of the block size: chunks split blocks
    )
    terms = model(SampleInputs(hs=hs.double(), lhs=lhs.double(), layout=layout), coefficients)
    terms.loss.backward()
    fast = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    reference = reference_loss(model, ids, mask, hs, lhs, layout.anchors, layout.keep)
    reference.backward()
    # the vocabulary terms are computed in fp32 by design; everything else is float64 here
    assert float(terms.loss.detach()) == pytest.approx(float(reference.detach()), rel=2e-6)
    for name, p in model.named_parameters():
        scale = float(p.grad.abs().max()) + 1e-12
        assert float((fast[name] - p.grad).abs().max()) <= 5e-5 * scale, name
        assert float(p.grad.abs().max()) > 0, f"{name} got no gradient"


def test_sum_over_samples_normalises_by_global_weight() -> None:
    """Two samples with one shared denominator give the mean over all their slots (what the
    all-reduced micro-step denominator means), independent of how samples are split."""
    cfg = draft_config(num_layers=1)
    model = make_model(cfg).double()
    samples = [awkward_sample(seed) for seed in (2, 3)]
    layouts = [
        layout_for(ids, mask, num_anchors=6, g=seed) for seed, (ids, mask, _, _) in zip((2, 3), samples, strict=True)
    ]
    total_weight = float(sum(x.weights.sum() for x in layouts))
    coefficients = loss_coefficients(
        ce_weight=CE_W,
        l1_weight=L1_W,
        confidence_weight=CONF_W,
        global_weight_sum=total_weight,
        gradient_scale=1.0,
        chunk_rows=7,
    )
    joint = sum(
        model(SampleInputs(hs=hs.double(), lhs=lhs.double(), layout=lay), coefficients).loss
        for (ids, mask, hs, lhs), lay in zip(samples, layouts, strict=True)
    )
    per_sample = []
    for (ids, mask, hs, lhs), lay in zip(samples, layouts, strict=True):
        own = float(reference_loss(model, ids, mask, hs, lhs, lay.anchors, lay.keep).detach())
        per_sample.append(own * float(lay.weights.sum()))
    assert float(joint.detach()) == pytest.approx(sum(per_sample) / total_weight, rel=2e-6)


def test_vocab_objective_never_materialises_whole_fp32_vocab_tensor() -> None:
    """No tensor of [all slots, vocab] fp32 exists during forward + backward of the chunked terms."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestTensor(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            from torch.utils._pytree import tree_flatten

            kwargs = kwargs or {}
            inputs = {
                t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
            }
            out = func(*args, **kwargs)
            for t in tree_flatten(out)[0]:
                # new storage only: views and in-place results share their input's storage
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    LargestTensor.largest = max(LargestTensor.largest, t.untyped_storage().nbytes())
            return out

    rows, vocab, hidden, rank, chunk = 64, 4096, 16, 4, 8
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=g, requires_grad=True)
    latent = torch.randn(rows, rank, generator=g, requires_grad=True)
    w2 = torch.randn(vocab, rank, generator=g, requires_grad=True)
    lm_head, teacher = torch.randn(vocab, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    labels, weights = torch.randint(0, vocab, (rows,), generator=g), torch.rand(rows, generator=g)
    with LargestTensor():  # inputs are made outside: only what the objective allocates counts
        loss, *_ = chunked_vocab_objective(
            h,
            latent,
            w2,
            lm_head,
            teacher,
            labels,
            weights,
            ce_coef=0.1,
            l1_coef=0.9,
            chunk_rows=chunk,
        )
        loss.backward()
    whole = rows * vocab * 4
    assert LargestTensor.largest <= chunk * vocab * 4 < whole
    assert float(h.grad.abs().sum()) > 0 and float(w2.grad.abs().sum()) > 0


def test_chunk_terms_with_a_separate_bias_and_16_bit_gradient_match_float64() -> None:
    """The pieces the GPU path combines for 16-bit inputs (bf16 draft logits, the Markov bias from a
    tensor-core matmul with an fp32 result, a bf16 gradient) give the float64 terms and gradient
    within bf16 rounding; run eagerly here (on CUDA the same function runs compiled)."""
    rows, vocab, ce_coef, l1_coef = 12, 300, 0.1, 0.9
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3
    bias = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 0.5
    teacher = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, vocab, (rows,), generator=g)
    w = torch.rand(rows, generator=g, dtype=torch.float64)
    logits16, teacher16 = logits.to(torch.bfloat16), teacher.to(torch.bfloat16)
    ce, l1, correct, grad = chunk_terms(
        logits16,
        bias.to(torch.float32),
        teacher16,
        labels,
        (ce_coef * w).float(),
        (l1_coef * w).float(),
        True,
        torch.bfloat16,
    )
    z = (logits16.double() + bias.float().double()).requires_grad_()
    p, q = torch.softmax(z, dim=1), torch.softmax(teacher16.double(), dim=1)
    ref_ce = torch.logsumexp(z, dim=1) - z.gather(1, labels[:, None]).squeeze(1)
    ref_l1 = (p - q).abs().sum(dim=1)
    (ce_coef * (w * ref_ce).sum() + l1_coef * (w * ref_l1).sum()).backward()
    assert grad is not None and grad.dtype == torch.bfloat16
    assert torch.allclose(ce.double(), ref_ce.detach(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(l1.double(), ref_l1.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(correct, z.detach().argmax(dim=1) == labels)
    assert torch.allclose(grad.double(), z.grad, rtol=1e-2, atol=1e-2 * float(z.grad.abs().max()))
    _, _, _, none = chunk_terms(logits16, None, teacher16, labels, w.float(), w.float(), False, torch.float32)
    assert none is None


# ----------------------------------------------------------------------------------------------
# layout: anchors, slots, labels, eval mask, weights
# ----------------------------------------------------------------------------------------------


def test_anchor_eligibility_and_sampling() -> None:
    ids, mask, _, _ = awkward_sample(4)
    eligible = eligible_anchor_mask(mask)
    expected = {p for p in range(len(ids) - 1) if mask[p] and mask[p + 1]}
    assert set(torch.nonzero(eligible).flatten().tolist()) == expected
    assert 3 not in expected and 7 in expected and 8 not in expected  # 1-token span, 2-token span

    few = layout_for(ids, mask, num_anchors=64)
    assert few.num_eligible == len(expected)
    assert set(few.anchors[few.keep].tolist()) == expected  # all of them, once
    assert int(few.keep.sum()) == len(expected) and not bool(few.keep[len(expected) :].any())
    assert bool((few.weights[~few.keep] == 0).all()) and bool((few.slot_token_ids[~few.keep] == MASK_ID).all())

    some = layout_for(ids, mask, num_anchors=5)
    kept = some.anchors[some.keep].tolist()
    assert len(kept) == 5 and kept == sorted(kept) and len(set(kept)) == 5 and set(kept) <= expected
    again = layout_for(ids, mask, num_anchors=5)
    assert torch.equal(again.anchors, some.anchors)  # a function of (seed, g) only
    other = build_layout(
        ids,
        mask,
        num_anchors=5,
        block_size=BLOCK,
        mask_token_id=MASK_ID,
        loss_decay_gamma=GAMMA,
        generator=anchor_generator(3, 12),
    )
    assert not torch.equal(other.anchors, some.anchors)


def test_slots_labels_eval_mask_and_weights() -> None:
    ids, mask, _, _ = awkward_sample(5)
    layout = layout_for(ids, mask, num_anchors=64)
    T = len(ids)
    for i in range(layout.num_blocks):
        if not layout.keep[i]:
            continue
        a = int(layout.anchors[i])
        assert layout.slot_token_ids[i].tolist() == [int(ids[a])] + [MASK_ID] * (BLOCK - 1)
        assert layout.positions[i].tolist() == [a + k for k in range(BLOCK)]
        valid = True
        for k in range(BLOCK):
            valid = valid and a + k + 1 < T and bool(mask[a + k + 1])
            assert bool(layout.eval_mask[i, k]) == valid, (a, k)
            if a + k < T:
                assert int(layout.prev_tokens[i, k]) == int(ids[a + k])  # teacher-forced Markov input
            if valid:
                assert int(layout.labels[i, k]) == int(ids[a + k + 1])  # slot k predicts anchor+k+1
                assert int(layout.teacher_index[i, k]) == a + k  # teacher from lhs at label-1
                assert float(layout.weights[i, k]) == pytest.approx(math.exp(-k / GAMMA))
            else:
                assert float(layout.weights[i, k]) == 0.0
        assert bool(layout.eval_mask[i, 0])  # slot 0 of a real block is always supervised
    by_anchor = {int(a): i for i, a in enumerate(layout.anchors.tolist()) if layout.keep[i]}
    assert layout.eval_mask[by_anchor[7]].tolist() == [True] + [False] * (BLOCK - 1)
    last = by_anchor[T - 2]  # its slot 1 would predict position T: off the sequence
    assert layout.eval_mask[last].tolist() == [True] + [False] * (BLOCK - 1)
    # a gap in the mask ends the prefix even when later labels are assistant tokens again
    gap_mask = torch.ones(12, dtype=torch.uint8)
    gap_mask[4] = 0
    gap = build_layout(
        torch.arange(12),
        gap_mask,
        num_anchors=16,
        block_size=BLOCK,
        mask_token_id=MASK_ID,
        loss_decay_gamma=GAMMA,
        generator=anchor_generator(0, 0),
    )
    row = {int(a): i for i, a in enumerate(gap.anchors.tolist()) if gap.keep[i]}[1]
    assert gap.eval_mask[row].tolist() == [True, True, False, False]
    # what the objective reads instead of syncing the GPU: the supervised slots' flat indices and
    # the weight total, both made on the host with the layout
    for built in (layout, gap):
        flat = built.eval_mask.reshape(-1)
        assert built.supervised_rows.tolist() == [i for i in range(flat.numel()) if bool(flat[i])]
        assert built.weight_sum == float(built.weights.sum()) > 0


def test_attention_mask_contents() -> None:
    anchors = torch.tensor([0, 3, 6, 0])
    keep = torch.tensor([True, True, True, False])
    ctx_len, S = 9, 3
    mask = dense_block_mask(anchors, keep, ctx_len, S)
    assert mask.shape == (4 * S, ctx_len + 4 * S)
    for q in range(4 * S):
        block = q // S
        for kv in range(ctx_len + 4 * S):
            sees_context = kv < ctx_len and bool(keep[block]) and kv < int(anchors[block])
            sees_own_block = kv >= ctx_len and (kv - ctx_len) // S == block  # bidirectional; padded rows too
            expected = sees_context or sees_own_block
            assert bool(mask[q, kv]) == expected, (q, kv)
    assert not bool(mask[0:S, :ctx_len].any())  # anchor 0 sees no context
    assert int(mask[S, :ctx_len].sum()) == 3  # anchor 3 sees context 0, 1, 2 (not itself)

    from torch.nn.attention.flex_attention import create_mask

    padded_ctx = 16  # flex pads the context; padded keys are never visible
    flex = create_mask(dspark_mask_mod(anchors, keep, padded_ctx, S), 1, 1, 4 * S, padded_ctx + 4 * S, device="cpu")[
        0, 0
    ]
    dense_padded = dense_block_mask(anchors, keep, padded_ctx, S)
    assert torch.equal(flex, dense_padded)
    assert torch.equal(dense_padded[:, :ctx_len], mask[:, :ctx_len]) and not bool(
        dense_padded[:, ctx_len:padded_ctx].any()
    )


def test_int64_index_math_for_long_context() -> None:
    """Indices are int64 end to end; a position beyond 2**31 / width survives the layout math."""
    T = 70_000
    ids = torch.randint(0, VOCAB, (T,))
    mask = torch.zeros(T, dtype=torch.uint8)
    mask[T - 6 :] = 1
    layout = build_layout(
        ids,
        mask,
        num_anchors=4,
        block_size=BLOCK,
        mask_token_id=MASK_ID,
        loss_decay_gamma=GAMMA,
        generator=anchor_generator(0, 0),
    )
    for tensor in (
        layout.anchors,
        layout.positions,
        layout.labels,
        layout.teacher_index,
        layout.prev_tokens,
        layout.slot_token_ids,
    ):
        assert tensor.dtype == torch.int64
    # flattened offset of the last teacher row in a K3-wide [T, 5 * 7168] feature tensor
    offset = layout.teacher_index.max() * (5 * 7168)
    assert int(offset) > 2**31 and offset.dtype == torch.int64


def test_yarn_rope_matches_transformers() -> None:
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = RopeScaling(type="yarn", factor=16.0, original_max_position_embeddings=4096)
    ours, scale = inverse_frequencies(64, 10000.0, scaling, 65536)
    config = Qwen3Config(
        hidden_size=4096,
        num_attention_heads=64,
        head_dim=64,
        max_position_embeddings=65536,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 4096,
        },
    )
    theirs, their_scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert torch.allclose(ours, theirs.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(their_scale)
    plain, one = inverse_frequencies(64, 10000.0, None, 4096)
    assert one == 1.0 and not torch.allclose(plain, ours)
