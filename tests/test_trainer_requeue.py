"""Preemption and requeue: SIGTERM (what Slurm and the launcher send) makes every rank checkpoint at
the next step boundary and exit 143; the same resolved recipe started again resumes from that
checkpoint by itself and finishes with the same step sequence."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.support.trainer_runs import launch, make_inputs, make_run, start, wait_all

pytestmark = pytest.mark.distributed

STEPS = 30


@pytest.mark.slow
def test_sigterm_checkpoints_at_step_boundary_and_restart_resumes(tmp_path: Path, port_factory) -> None:
    target, samples = make_inputs(tmp_path / "inputs", count=STEPS * 4)
    overrides = [
        "trainer.gradient_accumulation_steps=2",
        "trainer.global_batch_size=4",
        f"trainer.max_steps={STEPS}",
        "trainer.epochs=8",
        "trainer.checkpoint.every_steps=100",
    ]
    run = make_run(tmp_path, "job", world_size=2, target=target, samples=samples, overrides=overrides)
    ranks = start(run, port_factory())
    deadline = time.monotonic() + 120
    while len(run.metrics()) < 2:
        assert time.monotonic() < deadline and all(p.poll() is None for p in ranks), wait_all(ranks, 5).text()
        time.sleep(0.05)
    for process in ranks:
        process.send_signal(signal.SIGTERM)
    stopped = wait_all(ranks)
    assert stopped.codes == [143, 143], stopped.text()
    done = run.metrics()[-1]["step"]
    assert 2 <= done < STEPS
    assert f"stopped after step {done} on request" in stopped.logs[0]
    assert run.state(done)["step"] == done and run.state(done)["cursor"] == done * 4

    again = launch(run, port_factory())  # the same resolved recipe: no resume_from set
    assert again.ok, again.text()
    assert "restart of the same job" in again.logs[0]
    steps = [m["step"] for m in run.metrics()]
    assert steps == list(range(1, STEPS + 1))
    assert run.state(STEPS)["cursor"] == STEPS * 4
