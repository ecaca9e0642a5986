"""The vocabulary-sized DSpark terms (CE and full L1), chunked, with their gradients.

For ``M`` supervised slots the draft logits are ``z = h @ lm_head^T + latent @ W2^T`` (the Markov
bias) and the teacher logits are ``lm_head(teacher_hidden)``. Per slot, in fp32:

- ``ce = logsumexp(z) - z[label]``
- ``l1 = sum_v |softmax(z)_v - softmax(teacher)_v|``

and the value returned is ``ce_coef * sum(w * ce) + l1_coef * sum(w * l1)``.

Autograd through a chunked loop would keep every chunk's fp32 ``[rows, vocab]`` intermediates for
the backward pass, i.e. the whole ``[blocks, slots, vocab]`` tensor the design forbids. So this
function computes the gradients chunk by chunk inside its forward pass (closed form, below) and
keeps only ``[M, H]``, ``[M, r]`` and ``[V, r]`` results; the backward pass scales them by the
incoming gradient. Peak memory is a few ``[chunk_rows, vocab]`` buffers, whatever M is.

Gradient of one slot's terms with respect to its logits ``z`` (``p = softmax(z)``,
``q = softmax(teacher)``, ``s = sign(p - q)``):

- CE: ``p - onehot(label)``
- L1: ``d/dz_j sum_i |p_i - q_i| = sum_i s_i p_i (delta_ij - p_j) = p_j (s_j - <p, s>)``
  (``sign(0) = 0``, the subgradient autograd uses for ``abs``).

The teacher is frozen, so nothing flows into it.
"""

from __future__ import annotations

from typing import Any

import torch


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot product of two [rows, n] tensors without an [rows, n] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(-1)


class _ChunkedVocabObjective(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        latent: torch.Tensor,
        markov_w2: torch.Tensor,
        lm_head: torch.Tensor,
        teacher_hidden: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor,
        ce_coef: float,
        l1_coef: float,
        chunk_rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = int(hidden.shape[0])
        device = hidden.device
        want_hidden, want_latent, want_w2 = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        want_grads = want_hidden or want_latent or want_w2
        w2_f32 = markov_w2.to(torch.float32)
        ce_rows = torch.zeros(rows, dtype=torch.float32, device=device)
        l1_rows = torch.zeros(rows, dtype=torch.float32, device=device)
        correct_rows = torch.zeros(rows, dtype=torch.bool, device=device)
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_latent = torch.zeros(latent.shape, dtype=torch.float32, device=device) if want_latent else None
        grad_w2 = torch.zeros_like(w2_f32) if want_w2 else None

        for start in range(0, rows, chunk_rows):
            stop = min(start + chunk_rows, rows)
            h = hidden[start:stop]
            e = latent[start:stop].to(torch.float32)
            lab = labels[start:stop]
            w = weights[start:stop].to(torch.float32)

            z = (h @ lm_head.t()).to(torch.float32)
            z.addmm_(e, w2_f32.t())
            lse = torch.logsumexp(z, dim=1)
            ce_rows[start:stop] = lse - z.gather(1, lab[:, None]).squeeze(1)
            correct_rows[start:stop] = z.argmax(dim=1) == lab
            p = z.sub_(lse[:, None]).exp_()  # z is not needed any more: reuse it for p
            del z

            teacher_logits = teacher_hidden[start:stop] @ lm_head.t()
            diff = torch.softmax(teacher_logits, dim=1, dtype=torch.float32)
            del teacher_logits
            diff.sub_(p).neg_()  # p - q
            l1_rows[start:stop] = torch.linalg.vector_norm(diff, ord=1, dim=1)

            if not want_grads:
                continue
            grad_z = diff.sign_()  # s, in place
            ps = _row_dot(p, grad_z)
            grad_z.sub_(ps[:, None]).mul_(p).mul_((l1_coef * w)[:, None])
            ce_w = ce_coef * w
            grad_z.add_(p.mul_(ce_w[:, None]))
            grad_z.scatter_add_(1, lab[:, None], -ce_w[:, None])
            del p
            if want_hidden:
                grad_hidden[start:stop] = (grad_z.to(lm_head.dtype) @ lm_head).to(hidden.dtype)
            if want_latent:
                grad_latent[start:stop] = grad_z @ w2_f32
            if want_w2:
                grad_w2.addmm_(grad_z.t(), e)
            del grad_z

        loss = (
            ce_coef * (weights.to(torch.float32) * ce_rows).sum()
            + l1_coef * (weights.to(torch.float32) * l1_rows).sum()
        )
        # Intermediate results, not inputs: kept on ctx rather than through save_for_backward.
        ctx.grads = (grad_hidden, grad_latent, grad_w2)
        ctx.dtypes = (hidden.dtype, latent.dtype, markov_w2.dtype)
        ctx.mark_non_differentiable(ce_rows, l1_rows, correct_rows)
        return loss, ce_rows, l1_rows, correct_rows

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        grad_hidden, grad_latent, grad_w2 = ctx.grads
        ctx.grads = None
        hidden_dtype, latent_dtype, w2_dtype = ctx.dtypes
        scale = grad_loss.to(torch.float32)
        out_hidden = (grad_hidden.to(torch.float32) * scale).to(hidden_dtype) if ctx.needs_input_grad[0] else None
        out_latent = (grad_latent * scale).to(latent_dtype) if ctx.needs_input_grad[1] else None
        out_w2 = (grad_w2 * scale).to(w2_dtype) if ctx.needs_input_grad[2] else None
        return out_hidden, out_latent, out_w2, None, None, None, None, None, None, None


def chunked_vocab_objective(
    hidden: torch.Tensor,
    latent: torch.Tensor,
    markov_w2: torch.Tensor,
    lm_head: torch.Tensor,
    teacher_hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    ce_coef: float,
    l1_coef: float,
    chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CE and L1 of ``M`` slots, ``chunk_rows`` at a time.

    Args: ``hidden [M, H]`` post-norm draft hidden; ``latent [M, r]`` Markov latent (the bias is
    ``latent @ markov_w2^T``); ``markov_w2 [V, r]``; ``lm_head [V, H]`` frozen;
    ``teacher_hidden [M, H]`` the target's post-norm last hidden state at ``label - 1``;
    ``labels [M]`` int64; ``weights [M]`` slot weights.

    Returns ``(loss, ce [M], l1 [M], correct [M])``: ``loss`` is differentiable with respect to
    ``hidden``, ``latent`` and ``markov_w2``; the per-slot values are detached fp32 (``correct`` is
    argmax of the Markov-biased logits == label).
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if labels.dtype != torch.int64:
        raise ValueError(f"labels must be int64, got {labels.dtype}")
    return _ChunkedVocabObjective.apply(
        hidden,
        latent,
        markov_w2,
        lm_head,
        teacher_hidden,
        labels,
        weights,
        float(ce_coef),
        float(l1_coef),
        int(chunk_rows),
    )
