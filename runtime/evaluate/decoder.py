"""Speculative decoding of one prompt with the draft, and plain decoding with the target alone.

The loop, as SGLang's DSpark decode runs it for one request:

1. Prefill the prompt; the target's next token (greedy or sampled) is the first anchor. The draft's
   context is the aux hidden states of the prompt.
2. The draft proposes ``S = block_size`` tokens after the anchor.
3. The target runs ``[anchor, d_1 .. d_S]`` on its cache (one forward over ``S + 1`` tokens);
   :mod:`runtime.evaluate.verify` accepts ``n`` drafted tokens and gives the target's next token.
4. The cache is cut back to the anchor and the ``n`` accepted tokens; their aux states join the
   draft's context; the target's token is the next anchor. Repeat from 2.

A verify step offers ``n + 1`` tokens (the accepted ones plus the target's own); the acceptance
length reported is tokens committed per verify step
(:func:`runtime.shared.acceptance_length.acceptance_length`, SGLang's ``spec_accept_length``). Generation
ends at a stop token, at ``max_new_tokens`` (tokens past either are not committed, and do not count)
or when the next verify block would pass the position limit of the target or the draft.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from runtime.evaluate.draft import DraftProposer
from runtime.evaluate.target import TargetDecoder
from runtime.evaluate.verify import greedy_accept, sampled_accept


@dataclass
class VerifyRecord:
    """One verify step."""

    accepted: int
    """Drafted tokens accepted (0..S); the step offers ``accepted + 1`` tokens, fewer are committed
    when a stop token or ``max_new_tokens`` comes first."""
    confidence: list[float] | None
    """The confidence head's predicted acceptance per slot, or None without one."""


@dataclass
class Generation:
    """The outcome of decoding one prompt."""

    prompt_id: str
    output_ids: list[int]
    seconds: float
    """Wall time of the decode loop (prefill included)."""
    steps: list[VerifyRecord] = field(default_factory=list)
    """Verify steps (empty for plain decoding)."""
    stopped_by: str = "max_new_tokens"
    """``stop_token``, ``max_new_tokens`` or ``position_limit``."""


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """The target's own next token: argmax, or a draw at ``temperature``."""
    if temperature == 0.0:
        return int(logits.argmax())
    probs = F.softmax(logits.to(torch.float32) / temperature, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


class _Output:
    """Committed tokens, and whether generation is over."""

    def __init__(self, max_new_tokens: int, stop_ids: Collection[int]) -> None:
        self.ids: list[int] = []
        self.max_new_tokens = max_new_tokens
        self.stop_ids = set(stop_ids)
        self.stopped_by = ""

    def commit(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            if self.stopped_by:
                return
            self.ids.append(int(token))
            if token in self.stop_ids:
                self.stopped_by = "stop_token"
            elif len(self.ids) >= self.max_new_tokens:
                self.stopped_by = "max_new_tokens"


def _position_limit(target: TargetDecoder, proposer: DraftProposer | None) -> int:
    limit = target.max_positions
    if proposer is not None:
        limit = min(limit, proposer.model.cfg.max_position_embeddings)
    return limit


def speculative_generate(
    target: TargetDecoder,
    proposer: DraftProposer,
    prompt_id: str,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float,
    stop_ids: Collection[int],
    generator: torch.Generator,
) -> Generation:
    """Decode ``prompt_ids`` speculatively; see the module docstring."""
    started = time.perf_counter()
    out = _Output(max_new_tokens, stop_ids)
    steps: list[VerifyRecord] = []
    first = target.start(prompt_ids)
    proposer.reset(first.aux)
    anchor = _pick(first.logits[-1], temperature, generator)
    out.commit([anchor])
    block = proposer.block_size
    limit = _position_limit(target, proposer)
    while not out.stopped_by:
        position = target.length  # the anchor's position
        if position + block + 1 > limit:
            out.stopped_by = "position_limit"
            break
        proposal = proposer.propose(anchor, temperature, generator)
        verified = target.extend([anchor, *proposal.tokens.tolist()])
        if temperature == 0.0:
            accepted, bonus = greedy_accept(proposal.tokens, verified.logits)
        else:
            assert proposal.probs is not None
            target_probs = F.softmax(verified.logits / temperature, dim=-1)
            accepted, bonus = sampled_accept(proposal.tokens, proposal.probs, target_probs, generator)
        steps.append(VerifyRecord(accepted=accepted, confidence=proposal.confidence))
        target.rollback(position + accepted + 1)
        proposer.append(verified.aux[: accepted + 1])
        out.commit([*proposal.tokens[:accepted].tolist(), bonus])
        anchor = bonus
    return Generation(prompt_id, out.ids, time.perf_counter() - started, steps, out.stopped_by)


def plain_generate(
    target: TargetDecoder,
    prompt_id: str,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float,
    stop_ids: Collection[int],
    generator: torch.Generator,
) -> Generation:
    """Decode ``prompt_ids`` with the target alone, one token per forward on the same cache."""
    started = time.perf_counter()
    out = _Output(max_new_tokens, stop_ids)
    step = target.start(prompt_ids)
    limit = target.max_positions
    while True:
        out.commit([_pick(step.logits[-1], temperature, generator)])
        if out.stopped_by:
            break
        if target.length + 1 > limit:
            out.stopped_by = "position_limit"
            break
        step = target.extend([out.ids[-1]])
    return Generation(prompt_id, out.ids, time.perf_counter() - started, [], out.stopped_by)
