"""Speculative sampling is lossless: the tokens it commits are distributed as the target's own
sampling at the same temperature.

A toy target (6 tokens, so every 3-token continuation can be enumerated) and a random draft that
disagrees with it; the first three generated tokens of N speculative decodes against the exact
distribution from the target alone, by a chi-square goodness-of-fit test at significance 1e-3:
with an unseeded run, a correct sampler would fail it once in a thousand runs (the seed is fixed,
so this run's outcome is fixed). The same test on a broken rule (every drafted token accepted)
must fail, so a pass means the rule, not a blunt test.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

import runtime.evaluate.decoder as decoder
from runtime.evaluate.decoder import speculative_generate
from tests.support.toy_spec import toy_pair

pytestmark = pytest.mark.slow

VOCAB = 6
BLOCK = 3
TEMPERATURE = 0.8
PROMPT = [1, 4, 2]
TOKENS = 3
SIGNIFICANCE = 1e-3


def _exact_distribution(model: torch.nn.Module) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3 | prompt) of the target's sampling at TEMPERATURE, by enumeration."""

    def next_probs(prefix: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prefix])).logits[0, -1].to(torch.float64)
        return torch.softmax(logits / TEMPERATURE, dim=-1)

    exact: dict[tuple[int, ...], float] = {}
    first = next_probs(PROMPT)
    for a in range(VOCAB):
        second = next_probs([*PROMPT, a])
        for b in range(VOCAB):
            third = next_probs([*PROMPT, a, b])
            for c in range(VOCAB):
                exact[(a, b, c)] = float(first[a] * second[b] * third[c])
    return exact


def _p_value(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float], n: int) -> float:
    """Chi-square goodness of fit; cells expecting fewer than 5 are pooled into one."""
    stat, cells, pooled_expected, pooled_observed = 0.0, 0, 0.0, 0
    for key in itertools.product(range(VOCAB), repeat=TOKENS):
        expected = exact[key] * n
        if expected < 5:
            pooled_expected += expected
            pooled_observed += counts.get(key, 0)
            continue
        stat += (counts.get(key, 0) - expected) ** 2 / expected
        cells += 1
    if pooled_expected > 0:
        stat += (pooled_observed - pooled_expected) ** 2 / pooled_expected
        cells += 1
    dof = cells - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0)))


def _sample(n: int, seed: int) -> dict[tuple[int, ...], int]:
    pair = toy_pair(VOCAB, BLOCK, seed=11, logit_scale=3.0)
    generator = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(n):
        out = speculative_generate(
            pair.target,
            pair.proposer,
            "p",
            PROMPT,
            max_new_tokens=TOKENS,
            temperature=TEMPERATURE,
            stop_ids=set(),
            generator=generator,
        ).output_ids
        key = tuple(out)
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Thousands of decodes of a toy model are chains of tiny operations: with two torch threads on a
    busy 2-core machine they wait on each other (this test took 421 s in CI that way)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_speculative_sampling_commits_the_targets_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    exact = _exact_distribution(toy_pair(VOCAB, BLOCK, seed=11, logit_scale=3.0).model)
    n = 3000
    counts = _sample(n, seed=2026)
    assert _p_value(counts, exact, n) > SIGNIFICANCE

    # A broken rule, accepting every drafted token, commits the draft's distribution: it must fail.
    def accept_all(
        tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator
    ) -> tuple[int, int]:
        return len(tokens), int(torch.multinomial(target_probs[-1].cpu(), 1, generator=generator))

    monkeypatch.setattr(decoder, "sampled_accept", accept_all)
    broken = _sample(1000, seed=2026)
    assert _p_value(broken, exact, 1000) < SIGNIFICANCE
