"""The tiny pipeline end to end, on the real two-node local Slurm cluster and with --local: capture
(master + embedded engine + producer) and the 4-rank CPU trainer train over Mooncake. The loss falls
and tau rises; the optimizer consumed exactly the prompt order; a run stopped at step 16 and resumed
by a second submission with resume_from: auto reaches the same weights as an uninterrupted run."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from launcher.control import job_report
from launcher.jobs import JobRecord, find_record
from runtime.recipe import load_recipe
from runtime.shared.prompt_order import PromptOrder
from tests.support.launcher_cli import launch, probe_overrides

pytestmark = [pytest.mark.slow, pytest.mark.mooncake, pytest.mark.distributed]

REPO = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 900.0


def run_tiny(mode: str, runs: Path, *overrides: str) -> Path:
    """Run the tiny recipe to completion; returns its job folder."""
    args = ["tiny", *probe_overrides(runs)]
    for item in overrides:
        args += ["--set", item]
    before = set((runs / "tiny").iterdir()) if (runs / "tiny").exists() else set()
    done = launch([*args, "--local"] if mode == "local" else args)
    assert done.returncode == 0, done.stdout + done.stderr
    (job_dir,) = set((runs / "tiny").iterdir()) - before
    record = find_record(str(job_dir), runs)
    if mode == "local":
        assert_healthy_console(done.stdout + done.stderr, job_dir)
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
        assert_healthy_console(launch(["logs", str(job_dir)]).stdout, job_dir)
    return job_dir


def assert_capture_completed(record: JobRecord) -> None:
    """Every capture task (one per capture node) ended with success, and the component COMPLETED."""
    states = {c.name: (c.state, c.results) for c in job_report(record).components}
    state, results = states["capture"]
    assert state == "COMPLETED" and results and set(results.values()) == {"success"}, states
    assert states["trainer"][0] == "COMPLETED", states


GLOG_LINE = re.compile(r"^(\[\w+\] )?[EWF]\d{4} \d\d:\d\d:\d\d", re.MULTILINE)


def assert_healthy_console(console: str, job_dir: Path) -> None:
    """A healthy run's console has no glog error/warning lines, no cancelled step and no transformers
    load report; Mooncake's native output went to the task's native log instead."""
    assert not GLOG_LINE.findall(console), [m for m in console.splitlines() if GLOG_LINE.match(m)][:5]
    assert "UNEXPECTED" not in console and "CANCELLED" not in console and "REPLICA_IS_NOT_READY" not in console
    native = job_dir / "logs" / "native_capture_0.log"
    assert native.exists() and "metadata not found" in native.read_text(errors="replace"), "glog lines are kept there"


def metrics(job_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(checkpoint_dir: Path) -> tuple[int, str]:
    state = json.loads((checkpoint_dir / "latest" / "trainer_state.json").read_text())
    return int(state["step"]), str(state["weights_sha256"])


def prompt_rows(first_g: int, count: int) -> list[int]:
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml").recipe
    order = PromptOrder(recipe.data.num_rows, recipe.trainer.effective_prompt_seed, recipe.trainer.epochs, None)
    return [order.locate(g).row_index for g in range(first_g, first_g + count)]


@pytest.mark.parametrize("mode", ["local", pytest.param("slurm", marks=pytest.mark.slurm)])
def test_tiny_trains_consumes_the_prompt_order_and_resumes_exactly(
    mode: str, tmp_path: Path, tiny_assets: Path, request: pytest.FixtureRequest
) -> None:
    if mode == "slurm":
        request.getfixturevalue("slurm_cluster")
    runs = tmp_path / "runs"

    # Uninterrupted: 32 steps (2 epochs of 128 rows, global batch 8).
    full = run_tiny(mode, runs)
    records = metrics(full)
    assert [r["step"] for r in records] == list(range(1, 33))
    first, last = records[:4], records[-4:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    print(
        f"{mode}: loss {mean(first, 'loss'):.3f} -> {mean(last, 'loss'):.3f}, "
        f"tau {mean(first, 'tau'):.3f} -> {mean(last, 'tau'):.3f}"
    )
    assert mean(last, "loss") < mean(first, "loss"), "the loss falls on the tiny target"
    assert mean(last, "tau") > mean(first, "tau"), "tau rises"
    consumed = [row for r in records for row in r["row_indices"]]
    assert consumed == prompt_rows(0, 256), "the optimizer saw exactly the prompt order"
    full_step, full_hash = final_weights(full / "checkpoints")
    assert full_step == 32
    status = launch(["status", str(full)])
    assert "capture" in status.stdout and "trainer" in status.stdout and "COMPLETED" in status.stdout
    logs = launch(["logs", str(full)]).stdout
    assert "_capture_0.out" in logs and "_trainer_0.out" in logs and "[trainer]" in logs

    # Interrupted: stop after 16 steps, then a second submission resumes from the checkpoint.
    shared = tmp_path / "checkpoints"
    run_tiny(mode, runs, "trainer.max_steps=16", f"trainer.checkpoint.dir={shared}")
    assert final_weights(shared)[0] == 16
    resumed = run_tiny(mode, runs, "trainer.checkpoint.resume_from=auto", f"trainer.checkpoint.dir={shared}")
    resumed_records = metrics(resumed)
    assert [r["step"] for r in resumed_records] == list(range(17, 33)), "continued from step 16"
    assert [row for r in resumed_records for row in r["row_indices"]] == prompt_rows(128, 128)
    assert [r["loss"] for r in resumed_records] == [r["loss"] for r in records[16:]]
    assert final_weights(shared) == (32, full_hash), "resumed weights equal the uninterrupted run's"


def test_tiny_with_streamed_experts_trains_exactly_like_resident(tmp_path: Path, tiny_assets: Path) -> None:
    """capture.expert_streaming on, most experts on the host (2 of 8 MoE layers resident), and the
    Mooncake sample segment on the trainer node: the same per-step losses, consumed rows and final
    weights hash as the all-resident run with the segment on the capture node."""
    runs = tmp_path / "runs"
    steps = "trainer.max_steps=8"
    resident = run_tiny("local", runs, steps)
    streamed = run_tiny(
        "local",
        runs,
        steps,
        "capture.expert_streaming.enabled=true",
        "capture.expert_streaming.resident_fraction=0.25",
        "transport.segment_placement=trainer",
    )
    assert "expert streaming on cpu: 2 of 8 MoE layers resident, 6 streamed" in launch(["logs", str(streamed)]).stdout
    got, expected = metrics(streamed), metrics(resident)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert [r["loss"] for r in got] == [r["loss"] for r in expected]
    assert [r["row_indices"] for r in got] == [r["row_indices"] for r in expected]
    assert final_weights(streamed / "checkpoints") == final_weights(resident / "checkpoints")
