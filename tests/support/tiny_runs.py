"""Whole tiny-pipeline runs for the end-to-end tests (no tests here): one run through the launcher, the
checks every healthy run must pass, what a run left behind (metrics, weights, capture counts), and the
shared reference run.

The reference run is the uninterrupted 32-step ``launcher tiny --local`` run that several tests compare
against (the e2e, streamed-experts, capture-shares and feature-cache tests). It is made once per pytest
run: under pytest-xdist the workers share one folder and a lock, so whichever worker needs it first
makes it and the others wait and reuse it (several pytest processes share it through
``DSPARK_SHARED_RUN_DIR``). It keeps every checkpoint (steps 8, 16, 24, 32), so a test
of an 8-step run compares against step 8 of it: the run's first steps do not depend on its length (the
schedule's warm-up is fixed and the sample sequence is the prompt order).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from launcher.control import job_report
from launcher.jobs import JobRecord, find_record
from runtime.files import exclusive_lock
from runtime.recipe import load_recipe
from runtime.shared.prompt_order import PromptOrder
from tests.support.launcher_cli import launch, probe_overrides

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 900.0
REFERENCE_STEPS = 32
# Every checkpoint of the reference run stays (checkpoint.every_steps is 8 in recipes/tiny.yaml).
REFERENCE_OVERRIDES = ("trainer.checkpoint.keep_last=4",)


def run_tiny(
    mode: str, runs: Path, *overrides: str, expected_warnings: tuple[str, ...] = (), flags: tuple[str, ...] = ()
) -> Path:
    """Run the tiny recipe to completion (``mode`` local or slurm); returns its job folder. Its console
    must be a healthy run's, but for WARNING lines that contain one of ``expected_warnings`` (a test
    that damages something on purpose expects to be told). ``flags`` go to the launcher as they are
    (``--resume JOB``)."""
    args = ["tiny", *flags, *probe_overrides(runs)]
    for item in overrides:
        args += ["--set", item]
    before = set((runs / "tiny").iterdir()) if (runs / "tiny").exists() else set()
    done = launch([*args, "--local"] if mode == "local" else args)
    assert done.returncode == 0, done.stdout + done.stderr
    (job_dir,) = set((runs / "tiny").iterdir()) - before
    record = find_record(str(job_dir), runs)
    if mode == "local":
        assert_healthy_console(done.stdout + done.stderr, job_dir, expected_warnings)
        # The capture still ran when the trainer finished: stopped with SIGTERM, it exits 0 (completed).
        assert_capture_completed(record)
    if mode == "slurm":
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while (state := job_report(record).state) not in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}:
            assert time.monotonic() < deadline, f"job {record.job_id} still {state}"
            time.sleep(3)
        assert state == "COMPLETED", launch(["logs", str(job_dir)]).stdout[-4000:]
        # Both components end cleanly: the capture is stopped through the stop file, not cancelled.
        assert_capture_completed(record)
        assert_healthy_console(launch(["logs", str(job_dir)]).stdout, job_dir, expected_warnings)
    return job_dir


def assert_capture_completed(record: JobRecord) -> None:
    """Every capture task (one per capture node) ended with success, and the component COMPLETED."""
    states = {c.name: (c.state, c.results) for c in job_report(record).components}
    state, results = states["capture"]
    assert state == "COMPLETED" and results and set(results.values()) == {"success"}, states
    assert states["trainer"][0] == "COMPLETED", states


GLOG_LINE = re.compile(r"^(\[\w+\] )?[EWF]\d{4} \d\d:\d\d:\d\d", re.MULTILINE)


def assert_healthy_console(console: str, job_dir: Path, expected_warnings: tuple[str, ...] = ()) -> None:
    """A healthy run's console has no glog error/warning lines, no WARNING of ours, no cancelled step and
    no transformers load report; Mooncake's native output went to the task's native log instead."""
    assert not GLOG_LINE.findall(console), [m for m in console.splitlines() if GLOG_LINE.match(m)][:5]
    warnings = [
        line
        for line in console.splitlines()
        if " WARNING [" in line and not any(expected in line for expected in expected_warnings)
    ]
    assert not warnings, f"a healthy run prints no WARNING: {warnings[:5]}"
    # A full window is the healthy steady state: its pause/resume flips are not console news.
    assert "producer resumed" not in console and "producer paused" not in console
    assert "UNEXPECTED" not in console and "CANCELLED" not in console and "REPLICA_IS_NOT_READY" not in console
    native = job_dir / "logs" / "native_capture_0.log"
    # The native library's lines go there; a healthy client start's own-segment lookup is held and
    # dropped (runtime/native_log.py), so the file may hold nothing else.
    assert native.exists(), "the capture's native output goes to logs/native_capture_0.log"


def metrics(job_dir: Path) -> list[dict]:
    """Rows of a job's metrics.jsonl."""
    return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(checkpoint_dir: Path) -> tuple[int, str]:
    """(step, weights SHA-256) of the newest checkpoint in ``checkpoint_dir``."""
    return weights_at(checkpoint_dir, "latest")


def weights_at(checkpoint_dir: Path, step: int | str) -> tuple[int, str]:
    """(step, weights SHA-256) of checkpoint ``step`` (a step number, or ``latest``)."""
    name = step if isinstance(step, str) else f"step_{step:08d}"
    state = json.loads((checkpoint_dir / name / "trainer_state.json").read_text())
    return int(state["step"]), str(state["weights_sha256"])


def prompt_rows(first_g: int, count: int) -> list[int]:
    """The data rows of global samples ``first_g .. first_g + count - 1`` in the tiny recipe's prompt order."""
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml").recipe
    order = PromptOrder(recipe.data.num_rows, recipe.trainer.effective_prompt_seed, recipe.trainer.epochs, None)
    return [order.locate(g).row_index for g in range(first_g, first_g + count)]


def committed_per_capture_task(job_dir: Path) -> dict[int, int]:
    """Samples each capture task of a job committed, from its log's last progress line."""
    counts = {}
    for path in (job_dir / "logs").glob("*_capture_*.out"):
        rank = int(re.search(r"_capture_(\d+)\.out$", path.name).group(1))  # type: ignore[union-attr]
        found = re.findall(r"capture (?:finished|stopped) after (\d+) samples", path.read_text(errors="replace"))
        counts[rank] = int(found[-1]) if found else 0
    return counts


ENV_SHARED_RUN_DIR = "DSPARK_SHARED_RUN_DIR"
"""A folder shared by several pytest processes started together (``.ci/run`` runs the Slurm tests beside
the other slow ones): the reference run is made once for all of them."""


def shared_run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every worker of this pytest run sees: ``DSPARK_SHARED_RUN_DIR`` when set, else under
    xdist the parent of the workers' own temporary folders (one per run), else this run's own."""
    if os.environ.get(ENV_SHARED_RUN_DIR):
        return Path(os.environ[ENV_SHARED_RUN_DIR])
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job folder of the shared 32-step reference run, made by the first caller of this pytest run.
    A failed attempt is recorded, and later callers fail with its output instead of trying again."""
    root = shared_run_root(tmp_path_factory) / "tiny_reference"
    made, failed = root / "job_dir.txt", root / "failed.txt"
    with exclusive_lock(root.parent / "tiny_reference.lock"):
        if not made.exists() and not failed.exists():
            try:
                job_dir = run_tiny("local", root / "runs", *REFERENCE_OVERRIDES)
            except AssertionError as exc:
                failed.write_text(str(exc))
                raise
            made.write_text(str(job_dir))
    if failed.exists():
        pytest.fail(f"the shared reference run failed (in another test):\n{failed.read_text()[-6000:]}")
    return Path(made.read_text())
