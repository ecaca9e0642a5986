"""The two acceptance lengths over several decodes, each as its docstring defines it, and the reader of
``results.json`` files old and new."""

from __future__ import annotations

import pytest

from runtime.shared.acceptance_length import (
    LEGACY_POOLED_KEY,
    MEAN_OF_DECODES_KEY,
    POOLED_KEY,
    acceptance_length,
    acceptance_length_mean_of_decodes,
    acceptance_length_pooled,
    acceptance_lengths,
    pooled_acceptance_length_of,
)

# (committed tokens, verify steps): a long decode that accepts much, a short one that accepts little,
# and one that stopped on the prefill's token before any verify step.
DECODES = [(60, 10), (4, 4), (1, 0)]


def test_pooled_is_all_tokens_over_all_verify_steps() -> None:
    # 65 tokens (the step-less decode's one included, as SGLang counts it) over 14 steps
    assert acceptance_length_pooled(DECODES) == pytest.approx(65 / 14)


def test_mean_of_decodes_averages_each_decodes_own_figure() -> None:
    # 6.0 and 1.0, each decode weighing the same; the step-less decode has no figure and is left out
    assert acceptance_length_mean_of_decodes(DECODES) == pytest.approx((6.0 + 1.0) / 2)


def test_the_two_differ_when_decodes_differ_and_agree_on_one_decode() -> None:
    assert acceptance_length_pooled(DECODES) != acceptance_length_mean_of_decodes(DECODES)
    assert acceptance_length_pooled([(9, 4)]) == acceptance_length_mean_of_decodes([(9, 4)]) == 2.25
    assert acceptance_length(9, 4) == 2.25


def test_no_verify_step_gives_no_figure() -> None:
    assert acceptance_length(1, 0) is None
    assert acceptance_length_pooled([(1, 0)]) is None and acceptance_length_mean_of_decodes([(1, 0)]) is None
    assert acceptance_lengths([]) == {POOLED_KEY: None, MEAN_OF_DECODES_KEY: None}


def test_both_figures_under_their_keys_from_one_pass_over_a_generator() -> None:
    figures = acceptance_lengths(pair for pair in DECODES)
    assert figures == {POOLED_KEY: round(65 / 14, 6), MEAN_OF_DECODES_KEY: 3.5}


def test_the_reader_takes_the_pooled_figure_from_new_and_older_files() -> None:
    assert pooled_acceptance_length_of({POOLED_KEY: 4.2, MEAN_OF_DECODES_KEY: 3.9}) == 4.2
    assert pooled_acceptance_length_of({LEGACY_POOLED_KEY: 5.01}) == 5.01  # it was always the pooled one
    assert pooled_acceptance_length_of({POOLED_KEY: None, LEGACY_POOLED_KEY: 5.0}) is None  # the new key decides
    assert pooled_acceptance_length_of({}) is None
