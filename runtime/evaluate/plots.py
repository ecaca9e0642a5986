"""Plots of eval results: acceptance length over training steps (every evaluated checkpoint of the job,
the per-checkpoint greedy decodes of ``eval.checkpoint_prompts``, the untrained floors and the trainer's
teacher-forced tau), and for one evaluation the per-slot accept rates and the confidence head's
calibration. Each plot's title names the run, the draft and the prompts; each point (or slot) says how
many verify steps stand behind it. Slot k is the k-th drafted token of a block (1-based, as in
``results.json``). Drawn with matplotlib when it is installed; without it, a line says so and nothing
else changes."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from runtime.files import atomic_path
from runtime.shared.acceptance_length import pooled_acceptance_length_of

OVER_STEPS_FILE = "acceptance_over_steps.png"
DURING_TRAINING_FILE = "during_training.jsonl"
"""Written by :mod:`runtime.evaluate.checkpoint_acceptance` in the job's ``eval/`` folder."""
METRICS_FILE = "metrics.jsonl"
"""The trainer's metrics, in the job folder (``eval/``'s parent)."""
COLORS = {0.0: "tab:blue", 1.0: "tab:orange"}
SLOTS_FILE = "slot_accept_rate.png"
CALIBRATION_FILE = "calibration.png"
TITLE_CHARS_PER_INCH = 15
"""Characters of an 8-point title line that fit one inch of figure width (with a margin)."""


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file; damaged lines (a line being written) are skipped."""
    rows = []
    try:
        text = path.read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _color(temperature: float) -> str:
    return COLORS.get(temperature, "tab:green")


def _title(results: dict[str, Any], what: str, width_in: float) -> str:
    """``what``, the run, the draft and the prompts of one results document, wrapped to fit a figure
    ``width_in`` inches wide."""
    run = Path(results["job_dir"]).name
    prompts = sum(results["sets"].values())
    return _wrapped(
        [what, f"run {run}, draft {results['draft']['label']}", f"{prompts} prompts ({', '.join(results['sets'])})"],
        width_in,
    )


def _wrapped(lines: list[str], width_in: float) -> str:
    """``lines``, each wrapped to fit a figure ``width_in`` inches wide at 8 points (a long run name
    or set list must not run past the figure's edge)."""
    width = int(width_in * TITLE_CHARS_PER_INCH)
    return "\n".join(textwrap.fill(line, width, break_long_words=True) for line in lines)


def _results(eval_root: Path) -> list[dict[str, Any]]:
    found = []
    own = [eval_root / "results.json"] if (eval_root / "results.json").is_file() else []
    for path in own + sorted(eval_root.glob("*/results.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # a damaged or half-copied file: that point is missing from the plot
    return found


def draw_eval_plots(out_dir: Path, eval_root: Path) -> list[str]:
    """Draw the plots of ``out_dir/results.json`` into ``out_dir`` and the over-steps plot into
    ``eval_root``; returns lines for the operator."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["plots: matplotlib is not installed here; results.json has every figure"]
    results = json.loads((out_dir / "results.json").read_text())
    written = [_slots(plt, results, out_dir / SLOTS_FILE)]
    calibration = _calibration(plt, results, out_dir / CALIBRATION_FILE)
    if calibration:
        written.append(calibration)
    written.append(_over_steps(plt, _results(eval_root), eval_root, eval_root / OVER_STEPS_FILE))
    return [f"plots: {', '.join(str(p) for p in written)}"]


def _slots(plt: Any, results: dict[str, Any], target: Path) -> Path:
    width_in = 6.5
    figure, axis = plt.subplots(figsize=(width_in, 4.8))
    # How many verify steps reached each slot (a rate from 3 is not one from 300), for the trained
    # draft at each temperature: one line per temperature under the slot's tick, where labels cannot
    # collide with each other or with the curves.
    counts: list[tuple[float, dict[int, int | None]]] = []
    for entry in results["passes"]:
        temperature = entry["temperature"]
        for label, figures in entry["drafts"].items():
            slots = figures["overall"]["slots"]
            xs = [s["slot"] for s in slots]
            ys = [s["accept_rate"] if s["accept_rate"] is not None else float("nan") for s in slots]
            trained = label == results["draft"]["label"]
            axis.plot(
                xs,
                ys,
                marker="o" if trained else "x",
                linestyle="-" if trained else ":",
                color=_color(temperature),
                label=f"{label}, T={temperature:g}",
            )
            if trained:
                counts.append((temperature, {s["slot"]: s["reached"] for s in slots}))
    ticks = sorted({k for _, reached in counts for k in reached})
    if ticks:
        axis.set_xticks(ticks)
        axis.set_xticklabels(
            [str(k) + "".join(f"\n{_count(reached.get(k))}" for _, reached in counts) for k in ticks], fontsize=7
        )
    below = ", ".join(f"T={t:g}" for t, _ in counts)
    axis.set_xlabel(
        "slot k (the k-th drafted token of the block)"
        + (f"\nbelow each slot: verify steps that reached it, trained draft, {below}" if counts else ""),
        fontsize=8,
    )
    axis.set_ylabel("accept rate (given the earlier slots accepted)")
    axis.set_ylim(0, 1.05)
    axis.set_title(_title(results, "per-slot accept rate", width_in), fontsize=8)
    return _save(plt, figure, axis, target)


def _count(reached: int | None) -> str:
    return "-" if reached is None else str(reached)


def _calibration(plt: Any, results: dict[str, Any], target: Path) -> Path | None:
    label = results["draft"]["label"]
    width_in = 5.0
    figure, axis = plt.subplots(figsize=(width_in, 5.4))
    drew = False
    for entry in results["passes"]:
        figures = entry["drafts"].get(label, {}).get("overall", {})
        points = [(s["mean_confidence"], s["accept_rate"], s["slot"]) for s in figures.get("slots", [])]
        points = [(p, o, k) for p, o, k in points if p is not None and o is not None]
        if points:
            drew = True
            xs, ys, _ = zip(*points, strict=True)
            # Points, not a line: neighbouring slots are not neighbours in calibration.
            axis.plot(xs, ys, marker="o", linestyle="none", label=f"per slot, T={entry['temperature']:g}")
            for x, y, k in points:
                axis.annotate(str(k), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if not drew:
        plt.close(figure)
        return None
    axis.plot([0, 1], [0, 1], linestyle="--", color="grey", label="calibrated")
    axis.set_xlabel("confidence head: predicted acceptance")
    axis.set_ylabel("observed acceptance")
    axis.set_title(_title(results, "confidence calibration (slot k beside its point)", width_in), fontsize=8)
    axis.set_xlim(0, 1)
    axis.set_ylim(0, 1)
    return _save(plt, figure, axis, target)


def _over_steps(plt: Any, documents: list[dict[str, Any]], eval_root: Path, target: Path) -> Path:
    """Pooled acceptance length against training step: each full evaluation of a checkpoint (per temperature),
    the greedy decodes of every checkpoint during training, the untrained floors (one line per
    temperature, in its color) and the trainer's teacher-forced tau from its metrics."""
    series: dict[float, list[tuple[int, float, int]]] = {}
    floor: dict[float, tuple[float, int]] = {}
    prompts: set[str] = set()
    for document in documents:
        step = document["draft"]["step"]
        prompts.add(f"{sum(document['sets'].values())} prompts ({', '.join(document['sets'])})")
        for entry in document["passes"]:
            temperature = entry["temperature"]
            for label, figures in entry["drafts"].items():
                overall = figures["overall"]
                value = pooled_acceptance_length_of(overall)  # an older run's results.json too
                if value is None:
                    continue
                if label == "untrained":
                    floor[temperature] = (value, overall["verify_steps"])
                elif label == document["draft"]["label"] and step is not None:
                    series.setdefault(temperature, []).append((step, value, overall["verify_steps"]))
    width_in = 7.0
    figure, axis = plt.subplots(figsize=(width_in, 4.5))
    for temperature, points in sorted(series.items()):
        points.sort()
        xs, ys, counts = zip(*points, strict=True)
        axis.plot(xs, ys, marker="o", color=_color(temperature), label=f"trained, T={temperature:g} (full eval)")
        for x, y, n in zip(xs, ys, counts, strict=True):
            axis.annotate(f"n={n}", (x, y), textcoords="offset points", xytext=(3, 5), fontsize=6)
    for temperature, (value, steps) in sorted(floor.items()):
        axis.axhline(
            value,
            linestyle="--" if temperature == 0 else ":",
            linewidth=1.2,
            color=_color(temperature),
            label=f"untrained floor, T={temperature:g} ({value:.2f}, n={steps})",
        )
    during = [(r, pooled_acceptance_length_of(r)) for r in _jsonl(eval_root / DURING_TRAINING_FILE)]
    during = [(r, value) for r, value in during if value is not None]
    if during:
        during.sort(key=lambda pair: pair[0]["step"])
        first = during[0][0]
        axis.plot(
            [r["step"] for r, _ in during],
            [value for _, value in during],
            marker="s",
            markersize=4,
            color="tab:purple",
            label=f"each checkpoint, T=0, {first['prompts']} prompts of {first['set']} (during training)",
        )
        for r, value in during:
            axis.annotate(
                f"n={r['verify_steps']}",
                (r["step"], value),
                textcoords="offset points",
                xytext=(3, -10),
                fontsize=6,
                color="tab:purple",
            )
    tau = [(m["step"], m["tau"]) for m in _jsonl(eval_root.parent / METRICS_FILE) if "tau" in m and "step" in m]
    if tau:
        axis.plot(*zip(*sorted(tau), strict=True), color="grey", linewidth=0.8, alpha=0.7,
                  label="trainer's teacher-forced tau (training batches)")  # fmt: skip
    axis.set_xlabel("training step")
    axis.set_ylabel("acceptance length (tokens per verify step,\npooled over the decodes)")
    axis.set_title(
        _wrapped(
            [
                f"acceptance over training: run {eval_root.parent.name}",
                f"{'; '.join(sorted(prompts)) or 'no full eval yet'} (n: verify steps behind a point)",
            ],
            width_in,
        ),
        fontsize=8,
    )
    return _save(plt, figure, axis, target)


def _save(plt: Any, figure: Any, axis: Any, target: Path) -> Path:
    """Legend, layout, PNG at ``target``, figure closed."""
    axis.legend(fontsize=7)
    figure.tight_layout()
    try:
        with atomic_path(target) as tmp:  # a full disk leaves no temp file and says so in one line
            # "tight": the saved image grows to hold every label (the title is never cut)
            figure.savefig(tmp, dpi=100, bbox_inches="tight", format="png")
    finally:
        plt.close(figure)
    return target
