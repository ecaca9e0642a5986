"""How a verify step accepts drafted tokens (the rules SGLang's DSpark verify and DeepSpec use).

The target scores ``[anchor, d_1 .. d_S]`` in one forward; row ``i`` of its output is the target's
distribution of the token after the first ``i + 1`` of those. Both rules return ``(n, token)``: the
first ``n`` drafted tokens are accepted and ``token`` is the target's own next token (the "bonus"),
so a verify step always commits ``n + 1`` tokens (its acceptance length).

- Greedy (temperature 0): ``n`` is the longest prefix where each drafted token is the target's
  argmax; the bonus is the target's argmax after it. The output is the target's greedy decoding.
- Sampled (temperature T > 0): drafted token ``d_i`` drawn from the draft's ``q_i`` is accepted with
  probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection the token is drawn from
  ``max(p_i - q_i, 0)`` renormalised; when all ``S`` pass, from ``p_S``. Every committed token is then
  distributed exactly as the target's own sampling at temperature T.
"""

from __future__ import annotations

import torch


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """``draft_tokens [S]``, ``target_logits [S + 1, V]`` -> ``(accepted, bonus token)``."""
    _check_shapes(draft_tokens, target_logits)
    target_next = target_logits.argmax(dim=-1).to(draft_tokens.device)
    matches = draft_tokens == target_next[:-1]
    accepted = int(torch.cumprod(matches.to(torch.int64), dim=0).sum())
    return accepted, int(target_next[accepted])


def sampled_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[int, int]:
    """``draft_tokens [S]`` drawn from ``draft_probs [S, V]``; ``target_probs [S + 1, V]`` (both already
    at the sampling temperature) -> ``(accepted, token)``. ``generator`` is a CPU generator: the
    draws are the same on every device."""
    _check_shapes(draft_tokens, target_probs)
    draft_probs = draft_probs.detach().to("cpu", torch.float64)
    target_probs = target_probs.detach().to("cpu", torch.float64)
    tokens = draft_tokens.detach().to("cpu").tolist()
    uniforms = torch.rand(len(tokens), generator=generator, dtype=torch.float64)
    for i, token in enumerate(tokens):
        p, q = float(target_probs[i, token]), float(draft_probs[i, token])
        # u < p/q without dividing: q > 0 for a token the draft drew.
        if float(uniforms[i]) * q < p:
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0.0)
        if float(residual.sum()) <= 0.0:
            residual = target_probs[i]  # p == q: the rejection had probability 0 (rounding)
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(tokens), int(torch.multinomial(target_probs[-1], 1, generator=generator))


def _check_shapes(draft_tokens: torch.Tensor, target_rows: torch.Tensor) -> None:
    if draft_tokens.ndim != 1 or target_rows.ndim != 2 or target_rows.shape[0] != draft_tokens.shape[0] + 1:
        raise ValueError(
            f"a verify step needs S drafted tokens and S + 1 target rows; got tokens {tuple(draft_tokens.shape)} "
            f"and target rows {tuple(target_rows.shape)}"
        )
