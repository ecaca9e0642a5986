"""Issue 15, item 11: a requeue inside one job (the ranks die between checkpoints, the same resolved
recipe starts again and resumes from the last checkpoint) leaves ``metrics.jsonl`` with every step
exactly once."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from runtime.recipe.schema import MetricsConfig
from runtime.trainer.metrics import MetricsWriter
from tests.support.trainer_runs import launch, make_inputs, make_run, start, wait_all

STEPS = 12
EVERY = 5


def test_resume_at_drops_rows_after_the_checkpoint_and_a_torn_line(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path, MetricsConfig(tensorboard=False), run_name="t", enabled=True)
    for step in range(1, 9):
        writer.write({"step": step, "loss": 1.0})
    with writer.path.open("a") as handle:
        handle.write('{"step": 9, "lo')  # killed mid-write
    assert writer.resume_at(5) == 4
    assert [json.loads(line)["step"] for line in writer.path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert writer.resume_at(5) == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_ranks_killed_between_checkpoints_restart_without_duplicate_steps(tmp_path: Path, port_factory) -> None:
    target, samples = make_inputs(tmp_path / "inputs", count=STEPS * 4)
    overrides = [
        "trainer.gradient_accumulation_steps=2",
        "trainer.global_batch_size=4",
        f"trainer.max_steps={STEPS}",
        "trainer.epochs=8",
        f"trainer.checkpoint.every_steps={EVERY}",
    ]
    run = make_run(tmp_path, "job", world_size=2, target=target, samples=samples, overrides=overrides)
    ranks = start(run, port_factory())
    deadline = time.monotonic() + 240
    while len(run.metrics()) < EVERY + 2:
        assert time.monotonic() < deadline and all(p.poll() is None for p in ranks), wait_all(ranks, 5).text()
        time.sleep(0.02)
    for process in ranks:
        process.send_signal(signal.SIGKILL)  # the node is lost: no checkpoint at the stop
    wait_all(ranks, 30)
    written = [m["step"] for m in run.metrics()]
    assert max(written) > EVERY and max(written) < STEPS, written  # rows beyond the last checkpoint exist

    again = launch(run, port_factory())  # the requeued job: same resolved recipe
    assert again.ok, again.text()
    assert "restart of the same job" in again.logs[0]
    steps = [m["step"] for m in run.metrics()]
    assert steps == list(range(1, STEPS + 1)), steps
