"""The eval's decode time on one capture node with streamed experts (``python3 -m launcher eval``
on the SGLang route, the target at the recipe's TP with the draft).

Decode is copy-bound there: a verify step runs ``block_size + 1`` tokens per request, far too few to
keep the GPUs computing, yet every streamed layer whose experts any of those tokens routes to must
cross PCIe again. So a step costs about the streamed expert bytes those tokens touch over the PCIe
rate, nearly the same for one request as for many, and requests in flight (``eval.batch_size``) are
what make it cheap: the bytes are shared, the committed tokens add up. Tokens committed per step are
``batch x acceptance length``; the plan assumes :data:`PLANNING_ACCEPTANCE_LENGTH` (K3's published
chat-set figure; code and math sets accept more)."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.recipe.fit.expert_routing import untouched_expert_fraction
from runtime.recipe.schema import Recipe
from runtime.recipe.streaming_budget import StreamingSplit

PLANNING_ACCEPTANCE_LENGTH = 4.0
"""Tokens committed per verify step the estimate assumes (K3 DSpark on MT-Bench: 3.9-4.1)."""
PLANNING_PROMPTS = 1000
"""Prompts of the eval the estimate is stated for (a few standard sets)."""
BATCH_SIZES = (1, 8, 32, 128)
TARGET_HOURS = 1.0


@dataclass(frozen=True)
class EvalDecodeEstimate:
    """Seconds per verify step and hours for :data:`PLANNING_PROMPTS` prompts at one batch size."""

    batch_size: int
    step_seconds: float
    tokens_per_s: float
    hours: float


def _new_tokens(recipe: Recipe) -> int:
    return recipe.eval.max_new_tokens if recipe.eval else 256


def estimate(recipe: Recipe, split: StreamingSplit, top_k: int, num_experts: int, batch: int) -> EvalDecodeEstimate:
    """One batch size: the streamed experts the step's tokens touch (uniform routing) over PCIe."""
    tokens_per_step = batch * (recipe.trainer.draft.block_size + 1)
    touched = 1.0 - untouched_expert_fraction(tokens_per_step, top_k, num_experts)
    step_s = split.host_bytes * touched / recipe.plan.pcie_h2d_bytes_per_s
    rate = batch * PLANNING_ACCEPTANCE_LENGTH / step_s
    return EvalDecodeEstimate(batch, step_s, rate, PLANNING_PROMPTS * _new_tokens(recipe) / rate / 3600)


def eval_decode_rows(recipe: Recipe, split: StreamingSplit, top_k: int, num_experts: int) -> list[tuple[str, str]]:
    """Plan rows: per batch size (and the recipe's ``eval.batch_size``), seconds per verify step,
    tokens/s and hours for the planning eval; then the smallest power-of-two batch that finishes it
    within :data:`TARGET_HOURS`."""
    sizes = sorted({*BATCH_SIZES, *([recipe.eval.batch_size] if recipe.eval else [])})
    cells = "; ".join(
        f"batch {e.batch_size}: {e.step_seconds:.2f} s/step, {e.tokens_per_s:,.0f} tok/s, {e.hours:,.1f} h"
        for e in (estimate(recipe, split, top_k, num_experts, b) for b in sizes)
    )
    needed = next(
        (b for b in (2**i for i in range(13)) if estimate(recipe, split, top_k, num_experts, b).hours <= TARGET_HOURS),
        None,
    )
    return [
        (
            "eval decode (streamed)",
            f"copy-bound: {cells} (for {PLANNING_PROMPTS:,} prompts x {_new_tokens(recipe)} new tokens at acceptance "
            f"length {PLANNING_ACCEPTANCE_LENGTH:g})",
        ),
        (
            "eval batch for 1 h",
            f"eval.batch_size >= {needed} (requests in flight share each step's expert copies)"
            if needed
            else f"no batch up to 4096 finishes within {TARGET_HOURS:g} h",
        ),
    ]
