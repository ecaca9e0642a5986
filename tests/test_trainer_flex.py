"""The flex_attention path (GPU default) against the explicit-mask SDPA path.

On CPU flex_attention has no backward, so the CPU test compares forward outputs (compiled flex,
with the context padded to the recipe's max length and with padded blocks); the GPU test compares
loss and gradients and is skipped (and counted) without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from runtime.recipe.schema import DraftConfig, RopeScaling
from runtime.trainer.layout import anchor_generator, build_layout
from runtime.trainer.model import DSparkDraft, SampleInputs
from runtime.trainer.objective import loss_coefficients
from runtime.trainer.synthetic import synthetic_sample

VOCAB, HIDDEN, N_AUX, T, MAX_LENGTH = 300, 64, 2, 150, 200


def build(backend: str, device: str) -> DSparkDraft:
    cfg = DraftConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        rope_scaling=RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=64),
        max_position_embeddings=256,
        block_size=7,
        mask_token_id=3,
        markov_rank=8,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = DSparkDraft(
            cfg, vocab_size=VOCAB, num_aux_layers=N_AUX, attention_backend=backend, max_length=MAX_LENGTH
        )
    g = torch.Generator().manual_seed(1)
    model.attach_frozen_vocab(
        torch.randn(VOCAB, HIDDEN, generator=g).to(device), (torch.randn(VOCAB, HIDDEN, generator=g) * 0.1).to(device)
    )
    return model


def sample_and_layout(num_anchors: int):
    sample = synthetic_sample(
        5, num_tokens=T, vocab_size=VOCAB, hidden_size=HIDDEN, num_aux_layers=N_AUX, feature_dtype=torch.float32
    )
    layout = build_layout(
        sample.ids,
        sample.mask,
        num_anchors=num_anchors,
        block_size=7,
        mask_token_id=3,
        loss_decay_gamma=4.0,
        generator=anchor_generator(0, 5),
    )
    return sample, layout


@pytest.mark.slow
def test_flex_forward_equals_sdpa_on_cpu() -> None:
    sample, layout = sample_and_layout(num_anchors=150)  # more blocks than eligible anchors: padded blocks
    assert not bool(layout.keep.all())
    outputs = {}
    for backend in ("sdpa", "flex"):
        model = build(backend, "cpu")
        with torch.no_grad():
            outputs[backend] = model.draft_hidden(sample.hs, layout)
    kept = layout.keep
    assert torch.allclose(outputs["flex"][kept], outputs["sdpa"][kept], atol=2e-5, rtol=1e-4)


@pytest.mark.gpu
def test_flex_loss_and_gradients_equal_sdpa_on_gpu() -> None:
    sample, layout = sample_and_layout(num_anchors=24)
    results = {}
    for backend in ("sdpa", "flex"):
        model = build(backend, "cuda")
        dev = layout.to(torch.device("cuda"))
        coefficients = loss_coefficients(
            ce_weight=0.1,
            l1_weight=0.9,
            confidence_weight=1.0,
            global_weight_sum=float(layout.weights.sum()),
            gradient_scale=1.0,
            chunk_rows=21,
        )
        terms = model(SampleInputs(hs=sample.hs.cuda(), lhs=sample.lhs.cuda(), layout=dev), coefficients)
        terms.loss.backward()
        results[backend] = (
            float(terms.loss.detach()),
            {n: p.grad.detach().clone() for n, p in model.named_parameters()},
        )
    assert results["flex"][0] == pytest.approx(results["sdpa"][0], rel=1e-4)
    for name, grad in results["sdpa"][1].items():
        assert torch.allclose(
            results["flex"][1][name], grad, rtol=1e-3, atol=1e-5 * (float(grad.abs().max()) + 1e-12)
        ), name
