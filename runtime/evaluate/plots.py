"""Plots of eval results: acceptance length over training steps (every evaluated checkpoint of
the job), and for one evaluation the per-slot accept rates and the confidence head's calibration.
Drawn with matplotlib when it is installed; without it, a line says so and nothing else changes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime.files import atomic_path

OVER_STEPS_FILE = "acceptance_over_steps.png"
SLOTS_FILE = "slot_accept_rate.png"
CALIBRATION_FILE = "calibration.png"


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
    written.append(_over_steps(plt, _results(eval_root), eval_root / OVER_STEPS_FILE))
    return [f"plots: {', '.join(str(p) for p in written)}"]


def _slots(plt: Any, results: dict[str, Any], target: Path) -> Path:
    figure, axis = plt.subplots(figsize=(6, 4))
    for entry in results["passes"]:
        for label, figures in entry["drafts"].items():
            slots = figures["overall"]["slots"]
            axis.plot(
                [s["slot"] for s in slots],
                [s["accept_rate"] if s["accept_rate"] is not None else float("nan") for s in slots],
                marker="o",
                label=f"{label} T={entry['temperature']:g}",
            )
    axis.set_xlabel("slot")
    axis.set_ylabel("accept rate (given the earlier slots accepted)")
    axis.set_ylim(0, 1)
    return _save(plt, figure, axis, target)


def _calibration(plt: Any, results: dict[str, Any], target: Path) -> Path | None:
    label = results["draft"]["label"]
    figure, axis = plt.subplots(figsize=(5, 5))
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
    axis.set_xlim(0, 1)
    axis.set_ylim(0, 1)
    return _save(plt, figure, axis, target)


def _over_steps(plt: Any, documents: list[dict[str, Any]], target: Path) -> Path:
    series: dict[float, list[tuple[int, float]]] = {}
    floor: dict[float, float] = {}
    for document in documents:
        step = document["draft"]["step"]
        for entry in document["passes"]:
            temperature = entry["temperature"]
            for label, figures in entry["drafts"].items():
                value = figures["overall"]["mean_acceptance_length"]
                if value is None:
                    continue
                if label == "untrained":
                    floor[temperature] = value
                elif label == document["draft"]["label"] and step is not None:
                    series.setdefault(temperature, []).append((step, value))
    figure, axis = plt.subplots(figsize=(6, 4))
    for temperature, points in sorted(series.items()):
        points.sort()
        axis.plot(*zip(*points, strict=True), marker="o", label=f"trained, T={temperature:g}")
    for temperature, value in sorted(floor.items()):
        axis.axhline(value, linestyle="--", linewidth=1, label=f"untrained, T={temperature:g}")
    axis.set_xlabel("training step")
    axis.set_ylabel("mean acceptance length")
    return _save(plt, figure, axis, target)


def _save(plt: Any, figure: Any, axis: Any, target: Path) -> Path:
    """Legend, layout, PNG at ``target``, figure closed."""
    axis.legend(fontsize=7)
    figure.tight_layout()
    try:
        with atomic_path(target) as tmp:  # a full disk leaves no temp file and says so in one line
            figure.savefig(tmp, dpi=100, format="png")
    finally:
        plt.close(figure)
    return target
