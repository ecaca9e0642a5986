"""The DSpark loss of one sample and its metric sums.

Per supervised slot (``eval_mask``), with weight ``w = exp(-k / gamma)``:

- CE on the Markov-biased draft logits against the true next token,
- full L1 between the fp32 softmaxes of the draft and of the teacher (frozen lm_head on ``lhs`` at
  ``label - 1``),
- BCE between the confidence logit and ``clamp(1 - 0.5 * L1, 0, 1)`` (detached).

The caller passes coefficients that already hold the recipe weights and the normalisation
(``weight / sum of slot weights over all ranks``, see :func:`loss_coefficients`), so the returned
loss is this sample's share of the global objective and gradients add up across samples and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.trainer.layout import BlockLayout
from runtime.trainer.vocab_objective import chunked_vocab_objective


@dataclass(frozen=True)
class LossCoefficients:
    """Multipliers of the three summed terms of one sample, and the vocabulary chunk size."""

    ce: float
    l1: float
    confidence: float
    chunk_rows: int


def loss_coefficients(
    *,
    ce_weight: float,
    l1_weight: float,
    confidence_weight: float,
    global_weight_sum: float,
    gradient_scale: float,
    chunk_rows: int,
) -> LossCoefficients:
    """Coefficients for one micro-step.

    ``global_weight_sum`` is the sum of slot weights of this micro-step over every rank (each term is
    divided by it, as DeepSpec does); it is either 0 (nothing supervised anywhere) or at least 1
    (slot 0 of a real block always counts with weight 1), so clamping it at 1 only avoids 0/0.
    ``gradient_scale`` turns the per-rank gradients into the global one after FSDP's reduction.
    """
    scale = gradient_scale / max(float(global_weight_sum), 1.0)
    return LossCoefficients(
        ce=ce_weight * scale, l1=l1_weight * scale, confidence=confidence_weight * scale, chunk_rows=chunk_rows
    )


@dataclass
class SampleTerms:
    """The loss of one sample and detached sums for metrics."""

    loss: torch.Tensor
    """Differentiable scalar: ``coef.ce * sum(w ce) + coef.l1 * sum(w l1) + coef.conf * sum(w bce)``."""
    sums: dict[str, torch.Tensor]
    """Detached fp64 sums (scalars, or [S] per slot); see :data:`SCALAR_SUMS` / :data:`SLOT_SUMS`."""


SCALAR_SUMS: tuple[str, ...] = (
    "weight",
    "ce",
    "l1",
    "confidence",
    "confidence_abs_error",
    "valid_blocks",
    "tau",
    "tokens",
    "eligible_anchors",
    "kept_blocks",
    "supervised_slots",
)
"""Scalar sums of one sample: ``weight`` is the sum of slot weights; ``ce``/``l1``/``confidence``
are weighted sums of the terms; ``tau`` sums ``1 + sum_k prod_{i<=k} accept_i`` over valid blocks."""
SLOT_SUMS: tuple[str, ...] = ("slot_count", "slot_correct", "slot_accept")
"""Per-slot [S] sums over supervised slots: count, argmax hits, acceptance rate."""


def _scatter_rows(values: torch.Tensor, rows: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    grid = torch.zeros(shape[0] * shape[1], dtype=torch.float64, device=values.device)
    grid[rows] = values.detach().to(torch.float64)
    return grid.view(shape)


def sample_objective(
    *,
    hidden: torch.Tensor,
    lhs: torch.Tensor,
    layout: BlockLayout,
    markov_head: nn.Module,
    confidence_head: nn.Module | None,
    lm_head_weight: torch.Tensor,
    coefficients: LossCoefficients,
    fused: bool = False,
) -> SampleTerms:
    """Loss and metric sums of one sample from its post-norm draft hidden ``[N, S, H]``.

    ``fused``: the vocabulary terms' elementwise work runs compiled (see
    :func:`runtime.trainer.vocab_objective.chunked_vocab_objective`)."""
    num_blocks, block_size, hidden_size = hidden.shape
    shape = (num_blocks, block_size)
    rows = layout.supervised_rows
    flat_hidden = hidden.reshape(num_blocks * block_size, hidden_size)
    latent_all, markov_embedding = markov_head(layout.prev_tokens, hidden)
    latent = latent_all.reshape(num_blocks * block_size, -1).index_select(0, rows)
    teacher_rows = layout.teacher_index.reshape(-1).index_select(0, rows)
    teacher_hidden = lhs.index_select(0, teacher_rows).to(lm_head_weight.dtype)
    labels = layout.labels.reshape(-1).index_select(0, rows)
    weights = layout.weights.reshape(-1).index_select(0, rows).to(torch.float32)

    loss, ce, l1, correct = chunked_vocab_objective(
        flat_hidden.index_select(0, rows).to(lm_head_weight.dtype),
        latent,
        markov_head.markov_w2.weight,
        lm_head_weight,
        teacher_hidden,
        labels,
        weights,
        ce_coef=coefficients.ce,
        l1_coef=coefficients.l1,
        chunk_rows=coefficients.chunk_rows,
        fused=fused,
    )
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
    sums: dict[str, torch.Tensor] = {}
    zero = torch.zeros((), dtype=torch.float64, device=hidden.device)
    if confidence_head is not None:
        confidence_logits = confidence_head(hidden, markov_embedding).reshape(-1).index_select(0, rows)
        bce = F.binary_cross_entropy_with_logits(confidence_logits.to(torch.float32), accept, reduction="none")
        loss = loss + coefficients.confidence * (weights * bce).sum()
        sums["confidence"] = (weights * bce).detach().sum().to(torch.float64)
        error = (torch.sigmoid(confidence_logits.detach().to(torch.float32)) - accept).abs()
        sums["confidence_abs_error"] = (weights * error).sum().to(torch.float64)
    else:
        sums["confidence"] = zero
        sums["confidence_abs_error"] = zero

    accept_grid = _scatter_rows(accept, rows, shape)
    valid_blocks = layout.keep & layout.eval_mask.any(dim=1)
    tau_per_block = 1.0 + torch.cumprod(accept_grid, dim=1).sum(dim=1)
    sums.update(
        weight=weights.sum().to(torch.float64),
        ce=(weights * ce).sum().to(torch.float64),
        l1=(weights * l1).sum().to(torch.float64),
        valid_blocks=valid_blocks.sum().to(torch.float64),
        tau=(tau_per_block * valid_blocks).sum(),
        # torch.full, not torch.tensor(..., device=): a host-to-device copy of a pageable
        # scalar waits for everything queued on the stream (the whole forward).
        tokens=torch.full((), float(layout.seq_len), dtype=torch.float64, device=hidden.device),
        eligible_anchors=torch.full((), float(layout.num_eligible), dtype=torch.float64, device=hidden.device),
        kept_blocks=layout.keep.sum().to(torch.float64),
        supervised_slots=torch.full((), float(rows.numel()), dtype=torch.float64, device=hidden.device),
        slot_count=layout.eval_mask.to(torch.float64).sum(dim=0),
        slot_correct=_scatter_rows(correct.to(torch.float64), rows, shape).sum(dim=0),
        slot_accept=accept_grid.sum(dim=0),
    )
    return SampleTerms(loss=loss, sums=sums)
