"""Acceptance length, the headline figure of an evaluation, defined once for every route, figure,
plot, tool and document: tokens committed to the output per verify step (SGLang's
``spec_accept_length`` = ``completion_tokens / spec_verify_ct``).

Over several decodes there are two figures, and they differ (a long decode weighs more in the first):

- :func:`acceptance_length_pooled` (``results.json`` key :data:`POOLED_KEY`): every decode's committed
  tokens summed over every decode's verify steps summed. What a served target sees per verify step;
  the headline of every table.
- :func:`acceptance_length_mean_of_decodes` (key :data:`MEAN_OF_DECODES_KEY`): the mean over decodes
  of each decode's own :func:`acceptance_length`.

Torch-free: the launcher and the tools read ``results.json`` with :func:`pooled_acceptance_length_of`,
which also reads the files of older runs (:data:`LEGACY_POOLED_KEY`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

POOLED_KEY = "acceptance_length_pooled"
MEAN_OF_DECODES_KEY = "acceptance_length_mean_of_decodes"
LEGACY_POOLED_KEY = "mean_acceptance_length"
"""The pooled figure's key in ``results.json`` and ``during_training.jsonl`` of older runs: it was
always the pooled figure, whatever the name said."""

DIGITS = 6


def acceptance_length(committed_tokens: int, verify_steps: int) -> float | None:
    """Acceptance length of one decode: tokens committed per verify step, as SGLang serves it.

    ``committed_tokens`` are the tokens the decode emitted: the first one, which the target picks
    from the prompt's prefill before any verify step, counts; a token past the stop token or past
    ``max_new_tokens`` does not (a verify step's bonus token after a stop is never emitted). None
    without a verify step."""
    return round(committed_tokens / verify_steps, DIGITS) if verify_steps else None


def acceptance_length_pooled(decodes: Iterable[tuple[int, int]]) -> float | None:
    """Pooled acceptance length of ``decodes`` (``(committed_tokens, verify_steps)`` each): all their
    committed tokens over all their verify steps. A decode without a verify step still adds its
    tokens, as SGLang's counters do. None without a verify step."""
    tokens = steps = 0
    for committed_tokens, verify_steps in decodes:
        tokens += committed_tokens
        steps += verify_steps
    return acceptance_length(tokens, steps)


def acceptance_length_mean_of_decodes(decodes: Iterable[tuple[int, int]]) -> float | None:
    """Mean over ``decodes`` (``(committed_tokens, verify_steps)`` each) of each decode's own
    :func:`acceptance_length`; a decode without a verify step has none and is left out. None when no
    decode has a verify step."""
    # Each decode's exact ratio, rounded once at the end (not the rounded per-decode figures).
    ratios = [tokens / steps for tokens, steps in decodes if steps]
    return round(sum(ratios) / len(ratios), DIGITS) if ratios else None


def acceptance_lengths(decodes: Iterable[tuple[int, int]]) -> dict[str, float | None]:
    """Both figures of ``decodes`` under their ``results.json`` keys."""
    pairs = list(decodes)
    return {POOLED_KEY: acceptance_length_pooled(pairs), MEAN_OF_DECODES_KEY: acceptance_length_mean_of_decodes(pairs)}


def pooled_acceptance_length_of(figures: Mapping[str, Any]) -> float | None:
    """The pooled acceptance length recorded in ``figures`` (a draft's ``overall`` or a set's figures
    of ``results.json``, or a ``during_training.jsonl`` line), from this code's files or an older
    run's (:data:`LEGACY_POOLED_KEY`); None when it has none."""
    if POOLED_KEY in figures:
        return figures[POOLED_KEY]
    return figures.get(LEGACY_POOLED_KEY)
