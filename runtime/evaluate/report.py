"""The figures of an eval pass, from its generations.

- ``acceptance_length_pooled`` (the headline) and ``acceptance_length_mean_of_decodes``: see
  :mod:`runtime.shared.acceptance_length` (the one definition every route, figure, plot, tool and
  document uses).
- Per slot ``k = 1..block_size``: ``reached`` (steps that verified slot k: every earlier slot was
  accepted), ``accept_rate`` (accepted / reached: the conditional rate, what the confidence head
  predicts) and ``cumulative_rate`` (accepted / steps: how often the step got that far).
- Calibration: the confidence head's mean predicted acceptance per slot against ``accept_rate``, and
  over all verified slots in ten bins of predicted probability; ``expected_calibration_error`` is
  the bins' reached-weighted mean gap.
- Speed: generated tokens per second of the decode loops (prefill included), speculative and plain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.evaluate.decoder import Generation
from runtime.shared.acceptance_length import MEAN_OF_DECODES_KEY, POOLED_KEY, acceptance_lengths
from runtime.shared.speedup_trust import marked, trust_note

CALIBRATION_BINS = 10


def pass_figures(generations: Sequence[Generation], block_size: int) -> dict[str, Any]:
    """Acceptance length, per-slot rates, calibration and speed of speculative ``generations``."""
    steps = [step for generation in generations for step in generation.steps]
    reached = [0] * block_size
    accepted = [0] * block_size
    predicted = [0.0] * block_size
    bins = [[0, 0.0, 0] for _ in range(CALIBRATION_BINS)]  # [count, predicted sum, accepted count]
    has_confidence = any(step.confidence is not None for step in steps)
    tokens = sum(len(g.output_ids) for g in generations)
    seconds = sum(g.seconds for g in generations)
    for step in steps:
        for k in range(min(step.accepted + 1, block_size)):
            hit = k < step.accepted
            reached[k] += 1
            accepted[k] += hit
            if step.confidence is not None:
                p = step.confidence[k]
                predicted[k] += p
                cell = bins[min(int(p * CALIBRATION_BINS), CALIBRATION_BINS - 1)]
                cell[0] += 1
                cell[1] += p
                cell[2] += hit
    figures: dict[str, Any] = {
        "prompts": len(generations),
        "generated_tokens": tokens,
        "verify_steps": len(steps),
        **acceptance_lengths((len(g.output_ids), len(g.steps)) for g in generations),
        "slots": [
            {
                "slot": k + 1,
                "reached": reached[k],
                "accept_rate": _ratio(accepted[k], reached[k]),
                "cumulative_rate": _ratio(accepted[k], len(steps)),
                "mean_confidence": _ratio(predicted[k], reached[k]) if has_confidence else None,
            }
            for k in range(block_size)
        ],
        "seconds": round(seconds, 4),
        "tokens_per_s": _ratio(tokens, seconds),
        "stopped_by": _counts(g.stopped_by for g in generations),
    }
    if has_confidence:
        total = sum(cell[0] for cell in bins)
        figures["calibration_bins"] = [
            {
                "predicted_low": i / CALIBRATION_BINS,
                "count": cell[0],
                "mean_predicted": _ratio(cell[1], cell[0]),
                "observed": _ratio(cell[2], cell[0]),
            }
            for i, cell in enumerate(bins)
        ]
        figures["expected_calibration_error"] = _ratio(sum(abs(cell[1] - cell[2]) for cell in bins), total)
    return figures


def plain_figures(generations: Sequence[Generation]) -> dict[str, Any]:
    """Tokens and speed of plain target decoding."""
    tokens = sum(len(g.output_ids) for g in generations)
    seconds = sum(g.seconds for g in generations)
    return {
        "prompts": len(generations),
        "generated_tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": _ratio(tokens, seconds),
    }


def greedy_agreement(speculative: Sequence[Generation], plain: Sequence[Generation]) -> dict[str, Any]:
    """How many speculative greedy outputs equal the target's own greedy decoding, token for token
    (a generation cut by the position limit is compared on the tokens both have)."""
    differing = []
    for spec, ref in zip(speculative, plain, strict=True):
        if spec.stopped_by == "position_limit" or ref.stopped_by == "position_limit":
            same = spec.output_ids[: len(ref.output_ids)] == ref.output_ids[: len(spec.output_ids)]
        else:
            same = spec.output_ids == ref.output_ids
        if not same:
            differing.append(spec.prompt_id)
    return {"prompts": len(speculative), "identical": len(speculative) - len(differing), "differing": differing}


def _ratio(numerator: float, denominator: float) -> float | None:
    return None if not denominator else round(numerator / denominator, 6)


def _counts(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in values:
        out[value] = out.get(value, 0) + 1
    return out


def results_table(results: dict[str, Any]) -> str:
    """The operator's summary of a results document: acceptance length per draft and temperature,
    speed against the target alone, teacher-forced tau beside it, per-slot rates and calibration."""
    draft = results["draft"]
    sets = ", ".join(f"{name} ({count})" for name, count in results["sets"].items())
    lines = [
        f"eval of {draft['label']} on {sum(results['sets'].values())} prompts [{sets}], {results['device']} "
        f"{results['dtype']}, block size {results['block_size']}, {results['seconds']:.0f} s",
        "",
        f"{'draft':<22} {'T':>4} {'accept len':>10} {'per decode':>10} {'tau (tf)':>8} {'tok/s':>8} "
        f"{'plain tok/s':>11} {'speedup (spread)':>19}",
    ]
    notes = []
    teacher = results.get("teacher_forced", {})
    for entry in results["passes"]:
        plain_rate = entry["plain"]["overall"]["tokens_per_s"] if entry["plain"] else None
        for label, figures in entry["drafts"].items():
            overall = figures["overall"]
            tau = teacher.get(label, {}).get("tau")
            lines.append(
                f"{label:<22} {entry['temperature']:>4g} {_num(overall[POOLED_KEY]):>10} "
                f"{_num(overall.get(MEAN_OF_DECODES_KEY)):>10} {_num(tau):>8} "
                f"{_num(overall['tokens_per_s'], 1):>8} {_num(plain_rate, 1):>11} "
                f"{marked(figures['speedup_vs_plain'], figures):>19}"
            )
            if note := trust_note(figures):
                notes.append(f"  ? {label} T={entry['temperature']:g}: speed-up {note}")
    lines.extend(notes)
    lines.append(
        "  accept len: tokens per verify step pooled over all decodes (all committed tokens / all verify steps; "
        "SGLang's spec_accept_length, what a served target sees)"
    )
    lines.append("  per decode: the mean over decodes of each decode's own tokens per verify step")
    lines.append(
        "  tau (tf): the trainer's teacher-forced tau on the target's greedy answers (one figure per draft; it "
        "models sampling at temperature 1)"
    )
    for entry in results["passes"]:
        figures = entry["drafts"].get(draft["label"])
        if figures is None:
            continue
        slots = figures["overall"]["slots"]
        rates = " ".join(f"{s['slot']}:{_num(s['accept_rate'], 2)}" for s in slots)
        lines.append(f"per-slot accept rate, {draft['label']} T={entry['temperature']:g}: {rates}")
        if slots and slots[0]["mean_confidence"] is not None:
            pairs = " ".join(f"{s['slot']}:{_num(s['mean_confidence'], 2)}/{_num(s['accept_rate'], 2)}" for s in slots)
            lines.append(
                f"  confidence head predicted/observed: {pairs} "
                f"(calibration error {_num(figures['overall'].get('expected_calibration_error'), 3)})"
            )
        server = figures.get("server_avg_spec_accept_length")
        if server is not None:
            lines.append(f"  SGLang's own running average (/server_info avg_spec_accept_length): {server:.3f}")
        agreement = figures.get("greedy_agreement")
        if agreement is not None:
            lines.append(
                f"  greedy outputs identical to the target's own greedy decoding: {agreement['identical']}/"
                f"{agreement['prompts']}"
                + (f" (differ: {', '.join(agreement['differing'][:5])})" if agreement["differing"] else "")
            )
    return "\n".join(lines)


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
