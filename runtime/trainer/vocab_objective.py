"""The vocabulary-sized DSpark terms (CE and full L1), chunked, with their gradients.

For ``M`` supervised slots the draft logits are ``z = h @ lm_head^T + latent @ W2^T`` (the Markov
bias) and the teacher logits are ``lm_head(teacher_hidden)``. Per slot, in fp32:

- ``ce = logsumexp(z) - z[label]``
- ``l1 = sum_v |softmax(z)_v - softmax(teacher)_v|``

and the value returned is ``ce_coef * sum(w * ce) + l1_coef * sum(w * l1)``.

Autograd through a chunked loop would keep every chunk's fp32 ``[rows, vocab]`` intermediates for
the backward pass, i.e. the whole ``[blocks, slots, vocab]`` tensor that chunking exists to avoid
(fp32 at K3's 163,840-token vocabulary: 0.66 MB per drafted position, tens of GB per sample). So this
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

from runtime.trainer.compiled import compiled


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot product of two [rows, n] tensors without an [rows, n] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(-1)


def chunk_terms(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    ce_weights: torch.Tensor,
    l1_weights: torch.Tensor,
    want_grads: bool,
    grad_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Everything of one chunk between its matmuls: the elementwise and row-reduction work.

    ``logits [rows, V]`` are the draft logits (with the Markov bias already added when ``bias`` is
    None, else ``bias`` fp32 [rows, V] is added here); ``teacher_logits [rows, V]``;
    ``ce_weights``/``l1_weights [rows]`` are ``ce_coef * w`` and ``l1_coef * w``. Returns fp32
    ``ce``, ``l1``, bool ``correct`` [rows] and the gradient of the weighted terms with respect to
    the logits in ``grad_dtype`` (None unless ``want_grads``).

    Eager on CPU it performs the very operations, in the very order, of the in-place loop it
    replaced (fp32 results are bitwise unchanged); on CUDA it runs compiled, which fuses the ~20
    passes over the [rows, V] fp32 buffers into a few kernels.
    """
    z = logits.to(torch.float32)
    if bias is not None:
        z = z + bias
    lse = torch.logsumexp(z, dim=1)
    ce = lse - z.gather(1, labels[:, None]).squeeze(1)
    correct = z.argmax(dim=1) == labels
    p = (z - lse[:, None]).exp()
    diff = p - torch.softmax(teacher_logits, dim=1, dtype=torch.float32)
    l1 = torch.linalg.vector_norm(diff, ord=1, dim=1)
    if not want_grads:
        return ce, l1, correct, None
    sign = diff.sign()
    # bmm in eager (no [rows, V] temporary); a fused row reduction when compiled
    ps = (p * sign).sum(dim=1) if torch.compiler.is_compiling() else _row_dot(p, sign)
    grad_z = (sign - ps[:, None]) * p * l1_weights[:, None]
    grad_z = grad_z + p * ce_weights[:, None]
    grad_z = grad_z.scatter_add(1, labels[:, None], -ce_weights[:, None])
    return ce, l1, correct, grad_z.to(grad_dtype)


_MM_FP32_OUT: bool | None = None


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 16-bit matrices on tensor cores with an fp32 result (``out_dtype`` where this
    build has it for CUDA, else a 16-bit result cast up)."""
    global _MM_FP32_OUT
    if _MM_FP32_OUT is None:
        try:
            torch.mm(a[:1, :1], b[:1, :1], out_dtype=torch.float32)
            _MM_FP32_OUT = True
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_FP32_OUT = False
    if _MM_FP32_OUT:
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).to(torch.float32)


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
        fused: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = int(hidden.shape[0])
        device = hidden.device
        want_hidden, want_latent, want_w2 = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        want_grads = want_hidden or want_latent or want_w2
        # 16-bit Markov matrices on CUDA: their matmuls run on tensor cores with fp32 accumulation
        # (the inputs are exactly representable, so only the summation order and, for the
        # gradients, the 16-bit rounding of grad_z - the one lm_head's input gradient always
        # used - differ from the fp32 matmuls that ran without tensor cores).
        tensor_cores = fused and markov_w2.dtype in (torch.bfloat16, torch.float16) and hidden.is_cuda
        w2_f32 = None if tensor_cores else markov_w2.to(torch.float32)
        terms = compiled(chunk_terms) if fused else chunk_terms  # rows vary: dynamic after one recompile
        grad_dtype = lm_head.dtype if tensor_cores else torch.float32
        ce_rows = torch.zeros(rows, dtype=torch.float32, device=device)
        l1_rows = torch.zeros(rows, dtype=torch.float32, device=device)
        correct_rows = torch.zeros(rows, dtype=torch.bool, device=device)
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_latent = torch.zeros(latent.shape, dtype=torch.float32, device=device) if want_latent else None
        grad_w2 = torch.zeros(markov_w2.shape, dtype=torch.float32, device=device) if want_w2 else None

        for start in range(0, rows, chunk_rows):
            stop = min(start + chunk_rows, rows)
            h = hidden[start:stop]
            lab = labels[start:stop]
            w = weights[start:stop].to(torch.float32)

            logits = h @ lm_head.t()
            if tensor_cores:
                e = latent[start:stop].to(markov_w2.dtype)
                bias = _mm_fp32(e, markov_w2.t())
            else:
                e = latent[start:stop].to(torch.float32)
                logits = logits.to(torch.float32).addmm_(e, w2_f32.t())
                bias = None
            teacher_logits = teacher_hidden[start:stop] @ lm_head.t()
            ce, l1, correct, grad_z = terms(
                logits, bias, teacher_logits, lab, ce_coef * w, l1_coef * w, want_grads, grad_dtype
            )
            del logits, bias, teacher_logits
            ce_rows[start:stop] = ce
            l1_rows[start:stop] = l1
            correct_rows[start:stop] = correct
            if grad_z is None:
                continue
            if want_hidden:
                grad_hidden[start:stop] = (grad_z.to(lm_head.dtype) @ lm_head).to(hidden.dtype)
            if tensor_cores:
                if want_latent:
                    grad_latent[start:stop] = _mm_fp32(grad_z, markov_w2)
                if want_w2:
                    grad_w2.add_(_mm_fp32(grad_z.t(), e))
            else:
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
        return out_hidden, out_latent, out_w2, None, None, None, None, None, None, None, None


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
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CE and L1 of ``M`` slots, ``chunk_rows`` at a time.

    Args: ``hidden [M, H]`` post-norm draft hidden; ``latent [M, r]`` Markov latent (the bias is
    ``latent @ markov_w2^T``); ``markov_w2 [V, r]``; ``lm_head [V, H]`` frozen;
    ``teacher_hidden [M, H]`` the target's post-norm last hidden state at ``label - 1``;
    ``labels [M]`` int64; ``weights [M]`` slot weights.

    Returns ``(loss, ce [M], l1 [M], correct [M])``: ``loss`` is differentiable with respect to
    ``hidden``, ``latent`` and ``markov_w2``; the per-slot values are detached fp32 (``correct`` is
    argmax of the Markov-biased logits == label).

    ``fused`` (GPU): the elementwise work of each chunk runs compiled (:func:`chunk_terms`) and, for
    16-bit inputs on CUDA, the Markov-bias matmuls run on tensor cores. Off (the default, and
    always on CPU) the fp32 results are those of plain eager PyTorch.
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
        bool(fused),
    )
