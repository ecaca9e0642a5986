"""tools/compare_runs: alignment by step, the largest deviation per metric, plots, checkpoint hashes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from runtime.shared.acceptance_length import LEGACY_POOLED_KEY, POOLED_KEY
from tools.compare_runs import deviations, load_run, slot_number, smooth, verdict, write_plots

REPO = Path(__file__).resolve().parent.parent


def make_run(
    folder: Path, losses: list[float], sha: str, skip_step: int | None = None, hash_scheme: str | None = None
) -> Path:
    folder.mkdir(parents=True)
    lines = []
    for step, loss in enumerate(losses, start=1):
        if step == skip_step:
            continue
        lines.append(
            json.dumps(
                {
                    "step": step,
                    "loss": loss,
                    "loss_ce": loss / 2,
                    "tau": 1 + step / 10,
                    "lr": 1e-3,
                    "acc@0": 0.5,
                    "tokens_per_s": 100.0,
                    "data_wait_fraction": 0.1,
                    "time": "2026-11-29T00:00:00+00:00",
                }
            )
        )
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    state_dir = folder / "checkpoints" / "step_00000004"
    state_dir.mkdir(parents=True)
    state = {"step": 4, "weights_sha256": sha, **({"hash_scheme": hash_scheme} if hash_scheme else {})}
    (state_dir / "trainer_state.json").write_text(json.dumps(state))
    return folder


def test_largest_deviation_is_found_at_its_step(tmp_path: Path) -> None:
    a = load_run(make_run(tmp_path / "a", [4.0, 3.0, 2.0, 1.0], "aaa"))
    b = load_run(make_run(tmp_path / "b", [4.0, 3.0, 2.5, 1.0], "bbb", skip_step=1))
    rows = {d.metric: d for d in deviations(a, b)}
    assert rows["loss"].step == 3 and rows["loss"].absolute == 0.5 and rows["loss"].relative == 0.2
    assert rows["tau"].absolute == 0.0
    assert deviations(a, b)[0].metric in {"loss", "loss_ce"}, "sorted by relative deviation"
    assert set(a.steps) - set(b.steps) == {1}


def test_cli_prints_table_hashes_and_writes_plots(tmp_path: Path) -> None:
    run_a = make_run(tmp_path / "a", [4.0, 3.0, 2.0, 1.0], "same")
    run_b = make_run(tmp_path / "b", [4.0, 3.0, 2.0, 1.5], "same")
    out = tmp_path / "plots"
    done = subprocess.run(
        [str(REPO / "tools" / "compare_runs"), str(run_a), str(run_b), "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "loss" in done.stdout and "step_00000004 step 4 same  (same as the other run)" in done.stdout
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["accuracy.png", "data_wait.png", "loss.png", "lr.png", "tau.png", "tokens_per_s.png"]
    assert all((out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in pngs)


def test_differing_checkpoints_are_flagged_and_bad_lines_named(tmp_path: Path) -> None:
    run_a = make_run(tmp_path / "a", [1.0, 1.0, 1.0, 1.0], "x1")
    run_b = make_run(tmp_path / "b", [1.0, 1.0, 1.0, 1.0], "x2")
    done = subprocess.run(
        [str(REPO / "tools" / "compare_runs"), str(run_a), str(run_b), "--no-plots"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "DIFFERS from the other run" in done.stdout
    (run_b / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\nnot json\n')
    done = subprocess.run(
        [str(REPO / "tools" / "compare_runs"), str(run_a), str(run_b), "--no-plots"], capture_output=True, text=True
    )
    assert done.returncode == 2 and "metrics.jsonl:2" in done.stderr


def test_hashes_of_two_schemes_are_not_compared(tmp_path: Path) -> None:
    """A run saved before checkpoints hashed their tensors in parallel records no hash_scheme: its
    weights hash is not comparable with a newer run's, and the table says so instead of DIFFERS."""
    from tools.compare_runs import render_checkpoints

    a = load_run(make_run(tmp_path / "a", [1.0] * 4, "old"))
    b = load_run(make_run(tmp_path / "b", [1.0] * 4, "new", hash_scheme="sha256-per-tensor/1"))
    lines = "\n".join(render_checkpoints([a, b]))
    assert "DIFFERS" not in lines
    assert "old  (not comparable: hashed as sha256-sequential, the other run as sha256-per-tensor/1)" in lines
    c = load_run(make_run(tmp_path / "c", [1.0] * 4, "new", hash_scheme="sha256-per-tensor/1"))
    assert "new  (same as the other run)" in "\n".join(render_checkpoints([b, c]))


def test_single_run_plots(tmp_path: Path) -> None:
    run = load_run(make_run(tmp_path / "a", [2.0, 1.0, 0.5, 0.2], "h"))
    written = write_plots([run], tmp_path / "plots")
    assert (tmp_path / "plots" / "loss.png") in written


def test_learning_metrics_come_before_timing_noise(tmp_path: Path) -> None:
    a = load_run(make_run(tmp_path / "a", [2.0, 1.5, 2.5, 1.0], "h"))
    b = load_run(make_run(tmp_path / "b", [2.0, 1.5, 2.0, 1.0], "h"))
    for values in b.steps.values():  # timing differs far more than the loss (50% against 20%)
        values["tokens_per_s"] = 50.0
    order = [d.metric for d in deviations(a, b)]
    assert order.index("loss") < order.index("tokens_per_s") and set(order[-2:]) == {
        "data_wait_fraction",
        "tokens_per_s",
    }


def test_smoothing_is_a_trailing_mean_and_per_slot_metrics_get_small_multiples(tmp_path: Path) -> None:
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    folder = tmp_path / "run"
    folder.mkdir()
    rows = [{"step": s, "loss": 3 - s / 100, **{f"acc@{k}": 0.9 - 0.1 * k for k in range(7)}} for s in range(1, 101)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = write_plots([load_run(folder)], tmp_path / "plots")
    assert {p.name for p in written} == {"loss.png", "accuracy.png"}


def test_launcher_plots_draws_a_jobs_plots(tmp_path: Path) -> None:
    from launcher.jobs import JobRecord, write_record

    runs = tmp_path / "runs"
    job_dir = make_run(runs / "tiny" / "stamp", [2.0, 1.5, 1.2, 1.0], "h")
    write_record(JobRecord("91", "slurm", "tiny", str(job_dir), "recipes/tiny.yaml", "0" * 64, False, False), runs)
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "plots", "91", "--runs-dir", str(runs)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert (job_dir / "plots" / "loss.png").exists() and "loss.png" in done.stdout


def test_the_verdict_says_identical_or_where_the_runs_first_differ(tmp_path: Path) -> None:
    a = load_run(make_run(tmp_path / "a", [2.0, 1.5, 1.2, 1.0], "h"))
    same = load_run(make_run(tmp_path / "same", [2.0, 1.5, 1.2, 1.0], "h"))
    other = load_run(make_run(tmp_path / "other", [2.0, 1.5, 1.25, 1.0], "h"))
    assert verdict(a, same).startswith("verdict: identical on all 4 optimizer steps in common (steps 1..4)")
    assert verdict(a, other) == "verdict: first differ at optimizer step 3 in loss (A=1.2, B=1.25)"
    done = subprocess.run(
        [sys.executable, "-m", "tools.compare_runs", str(tmp_path / "a"), str(tmp_path / "other"), "--no-plots"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.splitlines()[0] == verdict(a, other), "the verdict comes first"


def test_two_runs_are_drawn_the_same_way_and_the_lr_never_smoothed(tmp_path: Path) -> None:
    """A 32-step run and a 16-step resumed one share one moving-average window (before, the shorter was
    drawn raw and the longer smoothed, so identical runs looked different); lr is an exact schedule."""
    from tools.compare_runs import PLOTS, smoothing_window

    full = load_run(make_run(tmp_path / "full", [3 - s / 10 for s in range(32)], "h"))
    resumed = load_run(make_run(tmp_path / "resumed", [3 - s / 10 for s in range(16)], "h"))
    assert (
        smoothing_window([full, resumed], ["loss"], PLOTS["loss"])
        == 3
        == smoothing_window([full], ["loss"], PLOTS["loss"])
    )
    assert smoothing_window([full, resumed], ["lr"], PLOTS["lr"]) == 1
    assert "accept rate = 1 - L1/2" in PLOTS["accept"].ylabel, "the plot says what accept rate is"


def test_a_run_without_a_step_is_an_error_not_empty_plots(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "tools.compare_runs", str(folder)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "has no metrics record" in done.stderr and "Traceback" not in done.stderr
    assert not (folder / "plots").exists(), "no plot drawn"


def test_per_slot_panels_number_the_slots_as_the_evaluation_does() -> None:
    """``acc@0`` (the trainer's key) is slot 1, the first drafted token, as in results.json."""
    assert [slot_number(key) for key in ("acc@0", "accept@0", "acc@6")] == [1, 1, 7]


def test_acceptance_length_is_shown_when_the_runs_were_evaluated(tmp_path: Path) -> None:
    from tools.compare_runs import render_acceptance

    a = load_run(make_run(tmp_path / "a", [1.0, 0.9, 0.8, 0.7], "s" * 64), "A")
    b = load_run(make_run(tmp_path / "b", [1.0, 0.9, 0.8, 0.7], "s" * 64), "B")
    assert render_acceptance([a, b]) == []  # neither evaluated: no section
    # step 8 written by an older evaluation: the pooled figure under its old name is still read
    for step, value, key in ((4, 1.5, POOLED_KEY), (8, 2.25, LEGACY_POOLED_KEY)):
        folder = tmp_path / "a" / "eval" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        drafts = {f"step_{step:08d}": {"overall": {key: value}}, "untrained": {}}
        result = {"draft": {"label": f"step_{step:08d}", "step": step}, "sets": {"s": 3}, "passes": [
            {"temperature": 0.0, "drafts": drafts}]}  # fmt: skip
        (folder / "results.json").write_text(json.dumps(result))
    (tmp_path / "a" / "eval" / "broken").mkdir()
    (tmp_path / "a" / "eval" / "broken" / "results.json").write_text("{half")
    assert render_acceptance([a, b])[1:] == ["  A: step_00000008: T=0 2.250 (3 prompts)", "  B: not evaluated"]


def test_a_forked_or_resumed_run_names_its_parent(tmp_path: Path) -> None:
    run_a = make_run(tmp_path / "a", [4.0, 3.0], "same")
    run_b = make_run(tmp_path / "b", [4.0, 3.0], "same")
    parent = {"kind": "fork", "job_id": "local-1", "job_dir": str(run_a), "checkpoint": f"{run_a}/checkpoints/x"}
    (run_b / "job.json").write_text(json.dumps({"job_id": "local-2", "parent": parent}))
    done = subprocess.run(
        [str(REPO / "tools" / "compare_runs"), str(run_a), str(run_b), "--no-plots"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert f"run B: forked from job local-1 at {run_a}/checkpoints/x (a new run" in done.stdout
    assert "run A:" not in done.stdout, "a fresh run has no parent line"
