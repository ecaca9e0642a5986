"""``tools/compare_runs RUN_A [RUN_B] [--out DIR]``: compare two runs' metrics step by step.

A run is a job folder (with ``metrics.jsonl`` and ``checkpoints/``) or a ``metrics.jsonl`` file.
The tool aligns the runs by optimizer step, prints for every metric the largest deviation (absolute
and relative, and at which step), writes PNG plots with both runs overlaid (total and per-term loss,
per-slot accuracy, tau, learning rate, tokens/s, data-wait fraction), and lists each run's
checkpoints with their weight hashes. This is how a reproduction is compared with a prior run. With
one run it plots that run alone.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from runtime.user_errors import exit_without_package

try:  # a stock python3 instead of the venv's: one line, not a traceback
    from runtime.files import DiskFullError, atomic_path
    from runtime.shared.acceptance_length import pooled_acceptance_length_of
    from runtime.shared.checkpoint_folders import SEQUENTIAL_HASH_SCHEME
    from runtime.shared.contracts import JOB_FOLDER_SETTING
    from runtime.user_errors import UserError, output_place, require_regular_file, run_command
except ModuleNotFoundError as _missing:
    exit_without_package(_missing, "tools.compare_runs")

IGNORED_KEYS = {"step", "time", "epoch"}


NUMERIC_KEYS = ("loss", "lr", "grad_norm", "tau")
"""Learning metrics a record must give as numbers when it gives them (a text value would drop out of
the comparison and let two different runs read as identical)."""


def _not_a_number(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int | float)


class RunReadError(UserError, ValueError):
    """A run folder or metrics file that cannot be read, naming the file, the line and the fix."""


@dataclass(frozen=True)
class PlotSpec:
    """One PNG: the metrics on it and the y-axis label with its unit."""

    keys: tuple[str, ...]
    ylabel: str
    per_slot: bool = False
    """One small panel per draft slot (``acc@0``, ``acc@1`` ...) instead of one axis; panels are titled
    ``slot k`` 1-based (the k-th drafted token, as the evaluation numbers them), so ``acc@0`` is slot 1."""
    smoothed: bool = True
    """Draw a moving average over the faint raw curve; off for exact schedules (the learning rate)."""


SLOTS = 16
PLOTS: dict[str, PlotSpec] = {
    "loss": PlotSpec(
        ("loss", "loss_ce", "loss_l1", "loss_confidence"), "loss per supervised slot (CE and BCE in nats, L1 in [0, 2])"
    ),
    "accuracy": PlotSpec(tuple(f"acc@{k}" for k in range(SLOTS)), "top-1 accuracy", per_slot=True),
    "accept": PlotSpec(
        tuple(f"accept@{k}" for k in range(SLOTS)),
        "accept rate = 1 - L1/2 (draft vs target distribution, teacher-forced)",
        per_slot=True,
    ),
    "tau": PlotSpec(("tau",), "tau (tokens accepted per draft block)"),
    "grad_norm": PlotSpec(("grad_norm",), "gradient norm (before clipping)"),
    "lr": PlotSpec(("lr",), "learning rate", smoothed=False),
    "tokens_per_s": PlotSpec(("tokens_per_s",), "throughput (tokens/s)"),
    "data_wait": PlotSpec(("data_wait_fraction",), "share of step time waiting for samples"),
}
TIMING_METRICS = ("tokens", "tokens_per_s", "samples_per_s", "step_time_s", "data_wait_s", "data_wait_fraction")
"""Metrics that measure the machine, not the learning: listed last when two runs are compared."""
SMOOTHING_POINTS = 10
"""Curves are smoothed over about len(steps) / SMOOTHING_POINTS steps; the raw curve stays, faint."""


def metric_rank(metric: str) -> tuple[int, str]:
    """Sort key of the deviation table: learning metrics, then the rest, then timing noise."""
    if metric in TIMING_METRICS:
        return 2, metric
    learning = metric.startswith(("loss", "acc@", "accept@", "tau", "confidence"))
    return (0 if learning else 1), metric


def slot_number(key: str) -> int:
    """The 1-based draft slot of a per-slot metric (``acc@0`` -> 1: the first drafted token, as the
    evaluation's plots and ``results.json`` number them; ``metrics.jsonl`` keys count from 0)."""
    return int(key.split("@")[1]) + 1


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (NaN-free input; the first points average fewer)."""
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


@dataclass
class Run:
    """One run's metrics by step and its checkpoints."""

    label: str
    folder: Path | None
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    checkpoints: list[tuple[int, str, str, str]] = field(default_factory=list)
    """(step, folder name, weights SHA-256, how it was hashed) of each checkpoint."""
    """(step, folder name, weights SHA-256)."""


@dataclass(frozen=True)
class Deviation:
    """The largest difference of one metric between two runs."""

    metric: str
    step: int
    value_a: float
    value_b: float

    @property
    def absolute(self) -> float:
        """|a - b|."""
        return abs(self.value_a - self.value_b)

    @property
    def relative(self) -> float:
        """|a - b| / max(|a|, |b|), 0 when both are 0."""
        scale = max(abs(self.value_a), abs(self.value_b))
        return self.absolute / scale if scale else 0.0


def _metrics_path(path: Path) -> Path:
    return path / "metrics.jsonl" if path.is_dir() else path


def load_run(path: Path, label: str | None = None) -> Run:
    """Read a run from a job folder or a metrics.jsonl file; errors name the file and the line."""
    metrics_file = path / "metrics.jsonl" if path.is_dir() else path
    folder = path if path.is_dir() else path.parent
    require_regular_file(metrics_file, "run", "pass a job folder (with metrics.jsonl) or a metrics.jsonl file")
    if not metrics_file.exists():
        raise RunReadError(
            f"{metrics_file} does not exist; fix: pass a job folder (with metrics.jsonl) or a metrics.jsonl file"
        )
    try:
        text = metrics_file.read_text()
    except UnicodeDecodeError as exc:
        raise RunReadError(
            f"{metrics_file} is not a text metrics file (byte {exc.object[exc.start]:#04x} at offset {exc.start}): "
            "fix: pass the metrics.jsonl a trainer wrote, or its job folder"
        ) from None
    run = Run(label=label or folder.name, folder=folder)
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise RunReadError(
                f"{metrics_file}:{number}: not a metrics record with a step ({exc}); each line is one JSON object "
                "with an integer 'step', as the trainer writes. Fix: remove or repair that line"
            ) from None
        if step < 1:
            raise RunReadError(
                f"{metrics_file}:{number}: step {step}; the trainer numbers optimizer steps from 1. Fix: remove or "
                "repair that line"
            )
        wrong = [k for k in NUMERIC_KEYS if k in record and _not_a_number(record[k])]
        wrong += [k for k in record if k.startswith("acc@") and _not_a_number(record[k])]
        if wrong:
            raise RunReadError(
                f"{metrics_file}:{number}: {wrong[0]} is {record[wrong[0]]!r}, not a number; a comparison would "
                "silently leave it out. Fix: remove or repair that line"
            )
        values = {
            key: float(value)
            for key, value in record.items()
            if key not in IGNORED_KEYS and isinstance(value, int | float) and not isinstance(value, bool)
        }
        run.steps[step] = values  # a resumed run repeats steps after its checkpoint: the last one wins
    if not run.steps:
        raise RunReadError(
            f"{metrics_file} has no metrics record: the run has not finished an optimizer step, so there is "
            "nothing to plot or compare. Fix: wait for its first step, or pass another run"
        )
    run.checkpoints = _checkpoints(folder / "checkpoints")
    return run


def _checkpoints(checkpoint_dir: Path) -> list[tuple[int, str, str, str]]:
    found = []
    for state_file in sorted(checkpoint_dir.glob("step_*/trainer_state.json")):
        state = json.loads(state_file.read_text())
        sha, scheme = str(state.get("weights_sha256", "?")), str(state.get("hash_scheme", SEQUENTIAL_HASH_SCHEME))
        found.append((int(state.get("step", 0)), state_file.parent.name, sha, scheme))
    return found


def deviations(a: Run, b: Run) -> list[Deviation]:
    """For every metric both runs have, the step with the largest absolute difference; sorted by
    relative deviation, largest first. NaN against a number counts as infinitely far."""
    common = sorted(set(a.steps) & set(b.steps))
    metrics = sorted({k for s in common for k in a.steps[s]} & {k for s in common for k in b.steps[s]})
    out = []
    for metric in metrics:
        worst: Deviation | None = None
        worst_gap = -1.0
        for step in common:
            if metric not in a.steps[step] or metric not in b.steps[step]:
                continue
            va, vb = a.steps[step][metric], b.steps[step][metric]
            gap = math.inf if math.isnan(va) != math.isnan(vb) else (0.0 if math.isnan(va) else abs(va - vb))
            if gap > worst_gap:
                worst, worst_gap = Deviation(metric, step, va, vb), gap
        if worst is not None:
            out.append(worst)
    # Learning metrics first, timing noise last; inside a group the largest relative deviation first.
    return sorted(
        out, key=lambda d: (metric_rank(d.metric)[0], -(math.inf if math.isnan(d.relative) else d.relative), d.metric)
    )


def verdict(a: Run, b: Run) -> str:
    """One line: the runs agree exactly on every step they share, or the first step and metric where
    they differ (learning metrics first; timing metrics measure the machine and are left out)."""
    common = sorted(set(a.steps) & set(b.steps))
    if not common:
        return "verdict: no optimizer step in common (steps are the optimizer steps each run logged)"
    for step in common:
        for metric in sorted(set(a.steps[step]) & set(b.steps[step]), key=metric_rank):
            if metric in TIMING_METRICS:
                continue
            va, vb = a.steps[step][metric], b.steps[step][metric]
            if va != vb and not (math.isnan(va) and math.isnan(vb)):
                return f"verdict: first differ at optimizer step {step} in {metric} (A={va:.9g}, B={vb:.9g})"
    line = (
        f"verdict: identical on all {len(common)} optimizer steps in common (steps {common[0]}..{common[-1]}), "
        "every learning metric bit for bit"
    )
    last_a, last_b = max(a.steps), max(b.steps)
    if last_a != last_b:  # a run that died early agrees on what it has: say it is shorter, never "identical"
        shorter, longer = ("A", "B") if last_a < last_b else ("B", "A")
        line += (
            f"; but {shorter} ends at step {min(last_a, last_b)} and {longer} at step {max(last_a, last_b)}: "
            f"{shorter} is not the whole run"
        )
    return line


def render_table(a: Run, b: Run, rows: list[Deviation], top: int) -> str:
    """The verdict, the deviation table and the checkpoint listing."""
    common = set(a.steps) & set(b.steps)
    lines = [
        verdict(a, b),
        f"A = {a.folder} ({len(a.steps)} steps)",
        f"B = {b.folder} ({len(b.steps)} steps); {len(common)} steps in common",
        "  largest deviation of each metric, at the optimizer step where it occurs:",
        f"  {'metric':<22} {'step':>6} {'A':>14} {'B':>14} {'|A-B|':>12} {'relative':>9}",
    ]
    for d in rows[:top]:
        lines.append(
            f"  {d.metric:<22} {d.step:>6} {d.value_a:>14.6g} {d.value_b:>14.6g} {d.absolute:>12.4g} {d.relative:>9.2%}"
        )
    if len(rows) > top:
        lines.append(f"  ... {len(rows) - top} more metrics (--top to show them)")
    lines += render_checkpoints([a, b])
    lines += render_acceptance([a, b])
    return "\n".join(lines)


def eval_results(folder: Path | None) -> dict[str, dict]:
    """The run's eval results (``eval/<draft>/results.json``) by draft label; damaged files are skipped."""
    found: dict[str, dict] = {}
    for path in sorted((folder / "eval").glob("*/results.json")) if folder else []:
        try:
            found[path.parent.name] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return found


def render_acceptance(runs: list[Run]) -> list[str]:
    """Pooled acceptance length of each run's newest evaluated checkpoint, per temperature, side by side
    when every run has one (``python3 -m launcher eval``); nothing when no run was evaluated."""
    newest = []
    for run in runs:
        results = [r for r in eval_results(run.folder).values() if r.get("draft", {}).get("step") is not None]
        newest.append(max(results, key=lambda r: r["draft"]["step"]) if results else None)
    if not any(newest):
        return []
    lines = [
        "acceptance length under speculative decoding, tokens per verify step pooled over all decodes "
        "(newest evaluated checkpoint, python3 -m launcher eval):"
    ]
    for run, result in zip(runs, newest, strict=True):
        if result is None:
            lines.append(f"  {run.label}: not evaluated")
            continue
        label = result["draft"]["label"]
        cells = []
        for entry in result["passes"]:
            value = pooled_acceptance_length_of(entry["drafts"].get(label, {}).get("overall", {}))
            cells.append(
                f"T={entry['temperature']:g} {value:.3f}" if value is not None else f"T={entry['temperature']:g} -"
            )
        lines.append(f"  {run.label}: {label}: {', '.join(cells)} ({sum(result['sets'].values())} prompts)")
    return lines


def render_checkpoints(runs: list[Run]) -> list[str]:
    """Checkpoint hashes per run, with equal hashes at equal steps marked."""
    lines = ["checkpoints (weights SHA-256):"]
    by_step = [{step: (sha, scheme) for step, _, sha, scheme in run.checkpoints} for run in runs]
    for run, hashes in zip(runs, by_step, strict=True):
        if not run.checkpoints:
            lines.append(f"  {run.label}: none")
        for step, name, sha, scheme in run.checkpoints:
            others = [h.get(step) for h in by_step if h is not hashes]
            mark = ""
            if len(runs) > 1 and others and others[0] is not None:
                if others[0][1] != scheme:
                    mark = f"  (not comparable: hashed as {scheme}, the other run as {others[0][1]})"
                else:
                    mark = "  (same as the other run)" if others[0][0] == sha else "  (DIFFERS from the other run)"
            lines.append(f"  {run.label}: {name} step {step} {sha}{mark}")
    return lines


def _series(run: Run, key: str) -> tuple[list[int], list[float]]:
    points = [(step, run.steps[step][key]) for step in sorted(run.steps) if key in run.steps[step]]
    points = [(x, y) for x, y in points if math.isfinite(y)]
    return [x for x, _ in points], [y for _, y in points]


def smoothing_window(runs: list[Run], keys: list[str], spec: PlotSpec) -> int:
    """One moving-average window for every curve of a plot (so two runs are drawn the same way): from
    the longest series on it; 1 (raw) for a plot that is never smoothed."""
    longest = max((len(_series(run, key)[0]) for run in runs for key in keys), default=0)
    return max(1, longest // SMOOTHING_POINTS) if spec.smoothed else 1


def _draw(axis: object, run: Run, key: str, label: str, color: str, style: str, window: int) -> None:
    """The raw curve faint with its moving average (``window`` steps) solid on top, or the raw curve
    solid when ``window`` is 1."""
    xs, ys = _series(run, key)
    if not xs:
        return
    axis.plot(xs, ys, style, color=color, alpha=0.25 if window > 1 else 0.9, linewidth=0.8)  # type: ignore[attr-defined]
    if window > 1:
        axis.plot(xs, smooth(ys, window), style, color=color, linewidth=1.6, label=label)  # type: ignore[attr-defined]
    else:
        axis.lines[-1].set_label(label)  # type: ignore[attr-defined]


def write_plots(runs: list[Run], out_dir: Path) -> list[Path]:
    """One PNG per metric group (per-slot metrics as small multiples), runs overlaid when there are
    two; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    styles = ["-", "--", ":"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    several = len(runs) > 1
    for name, spec in PLOTS.items():
        present = [k for k in spec.keys if any(k in values for run in runs for values in run.steps.values())]
        if not present:
            continue
        if spec.per_slot:
            columns = min(4, len(present))
            rows = math.ceil(len(present) / columns)
            # Constrained layout leaves room for the super title and labels above and beside the panels.
            figure, axes = plt.subplots(
                rows, columns, figsize=(2.6 * columns, 2.2 * rows), sharex=True, sharey=True, layout="constrained"
            )
            panels = list(getattr(axes, "flat", [axes]))
            window = smoothing_window(runs, present, spec)
            for axis, key in zip(panels, present, strict=False):
                for run_index, run in enumerate(runs):
                    label = run.label if several else key
                    color, style = colors[run_index % len(colors)], styles[run_index % len(styles)]
                    _draw(axis, run, key, label, color, style, window)
                axis.set_title(f"slot {slot_number(key)}", fontsize=9)
                axis.grid(alpha=0.3)
                axis.set_ylim(0, 1)
            for axis in panels[len(present) :]:
                axis.set_visible(False)
            figure.supxlabel("optimizer step")
            # Wrapped to the figure: a label longer than the panels would stretch the saved image.
            figure.supylabel(textwrap.fill(spec.ylabel, int(2.2 * rows * 9)), fontsize=9)
            smoothing = f"solid: moving average over {window} steps, faint: every step" if window > 1 else ""
            title = (
                f"{spec.ylabel} per draft slot (slot k: the k-th drafted token)"
                + (f" ({' vs '.join(r.label for r in runs)})" if several else "")
                + (f"\n{smoothing}" if smoothing else "")
            )
            width = int(2.6 * columns * 11)
            figure.suptitle("\n".join(textwrap.fill(line, width) for line in title.split("\n")), fontsize=10)
            if several:
                panels[0].legend(fontsize=7)
        else:
            figure, axis = plt.subplots(figsize=(8, 4.5))
            window = smoothing_window(runs, present, spec)
            for run_index, run in enumerate(runs):
                for key_index, key in enumerate(present):
                    label = f"{run.label}: {key}" if several else key
                    color = colors[(key_index if not several or len(present) > 1 else run_index) % len(colors)]
                    _draw(axis, run, key, label, color, styles[run_index % len(styles)], window)
            axis.set_xlabel("optimizer step")
            axis.set_ylabel(spec.ylabel)
            smoothing = f"; solid: moving average over {window} steps, faint: every step" if window > 1 else ""
            axis.set_title(name.replace("_", " ") + smoothing, fontsize=10)
            axis.grid(alpha=0.3)
            if several or len(present) > 1:
                axis.legend(fontsize=8, ncol=2)
        target = out_dir / f"{name}.png"
        try:
            with atomic_path(target, moved_by=JOB_FOLDER_SETTING) as tmp:  # a full disk leaves no temp file
                figure.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
        finally:
            plt.close(figure)
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    """Command line entry; returns the exit code (one line and 2 for bad input)."""
    return run_command(_main, argv)


def lineage(run: Run) -> str:
    """``run A: resumes job X from CHECKPOINT (the same run)`` or ``... forked from ...`` from the job's
    ``job.json`` (its ``parent``); empty for a fresh run or a bare metrics file."""
    record = run.folder / "job.json" if run.folder else None
    try:
        parent = json.loads(record.read_text()).get("parent") if record and record.is_file() else None
    except (OSError, ValueError, AttributeError):
        return ""
    if not isinstance(parent, dict):
        return ""
    if parent.get("kind") == "fork":
        return (
            f"run {run.label}: forked from job {parent.get('job_id')} at {parent.get('checkpoint')} "
            "(a new run: its recipe may differ from its parent's)"
        )
    return f"run {run.label}: resumes job {parent.get('job_id')} from {parent.get('checkpoint')} (the same run)"


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/compare_runs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_a", type=Path, help="job folder or metrics.jsonl")
    parser.add_argument("run_b", type=Path, nargs="?", help="job folder or metrics.jsonl (omit to plot one run)")
    parser.add_argument(
        "--out",
        type=Path,
        help="folder for the PNG plots (default: plots/ in run A's folder, or compare-<B> there when comparing)",
    )
    parser.add_argument("--top", type=int, default=25, help="rows of the deviation table")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    if args.top < 1:
        raise RunReadError(f"--top is {args.top}; fix: use a value >= 1 (rows of the deviation table)")
    if args.out is not None:
        output_place(args.out, "--out", fix="give a folder of its own for the plots")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise RunReadError(f"--out {args.out} is a file; the plots go into a folder. Fix: give a folder's path")
    run_a = load_run(args.run_a, "A")
    runs = [run_a]
    if args.run_b:
        run_b = load_run(args.run_b, "B")
        if _metrics_path(args.run_a).resolve() == _metrics_path(args.run_b).resolve():
            raise RunReadError(
                f"{args.run_a} and {args.run_b} are the same run ({_metrics_path(args.run_a).resolve()}): comparing it with "
                "itself proves nothing. Fix: pass two different job folders"
            )
        runs.append(run_b)
    for line in filter(None, (lineage(run) for run in runs)):
        print(line)
    if args.run_b:
        run_b = runs[1]
        print(render_table(run_a, run_b, deviations(run_a, run_b), args.top))
    else:
        print(f"run {args.run_a}: {len(run_a.steps)} steps")
        print("\n".join(render_checkpoints(runs) + render_acceptance(runs)))
    if not args.no_plots:
        default = run_a.folder / "plots" if run_a.folder else Path("plots")
        if args.run_b and args.out is None:
            default = default / f"compare-{Path(args.run_b).resolve().name}"
        try:
            written = write_plots(runs, args.out or default)
        except DiskFullError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"plots: {', '.join(str(p) for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
