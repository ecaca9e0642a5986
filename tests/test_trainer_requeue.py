"""Preemption and requeue: SIGTERM (what Slurm and the launcher send) makes every rank checkpoint at
the next step boundary and exit 143; the same resolved recipe started again resumes from that
checkpoint by itself and finishes with the same step sequence."""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from runtime.shared.contracts import step_sample_indices
from runtime.trainer.file_source import sample_file
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


@pytest.mark.slow
def test_a_stop_whose_samples_stop_coming_drops_the_step_and_resumes_exactly(tmp_path: Path, port_factory) -> None:
    """What a Slurm cancel or preemption does: the capture and its Mooncake master are signalled with
    the trainer, so the samples of the step in progress stop coming. SIGTERM during that wait (one of
    the step's two micro-steps already ran) makes every rank drop the step together and checkpoint the
    last finished one, without waiting out transport.idle_timeout_s; the resume runs the dropped step
    again and ends bit-identical to an uninterrupted run."""
    steps, world, batch = 6, 2, 4
    target, samples = make_inputs(tmp_path / "inputs", count=steps * batch)
    overrides = [
        "trainer.gradient_accumulation_steps=2",
        f"trainer.global_batch_size={batch}",
        f"trainer.max_steps={steps}",
        "trainer.checkpoint.every_steps=100",
        "transport.idle_timeout_s=900",
    ]
    reference = make_run(tmp_path, "reference", world_size=world, target=target, samples=samples, overrides=overrides)
    done = launch(reference, port_factory())
    assert done.ok, done.text()

    # The stopped run sees the samples of steps 1..3 and of the first micro-step of step 4 only.
    partial = tmp_path / "partial"
    partial.mkdir()
    first_micro_step = {g for rank in range(world) for g in step_sample_indices(3, rank, world, 1, 2)[:1]}
    for g in [*range(3 * batch), *sorted(first_micro_step)]:
        shutil.copy(sample_file(samples, g), sample_file(partial, g))
    run = make_run(tmp_path, "stopped", world_size=world, target=target, samples=partial, overrides=overrides)
    ranks = start(run, port_factory())
    deadline = time.monotonic() + 120
    while len(run.metrics()) < 3:
        assert time.monotonic() < deadline and all(p.poll() is None for p in ranks), wait_all(ranks, 5).text()
        time.sleep(0.05)
    time.sleep(2)  # the first micro-step of step 4 runs; then every rank waits for the second one's samples
    for process in ranks:
        process.send_signal(signal.SIGTERM)
    stopped = wait_all(ranks, timeout_s=60)
    assert stopped.codes == [143, 143], stopped.text()
    assert "stopped after step 3 on request" in stopped.logs[0], stopped.text()
    assert "the samples of step 4 stopped coming after the stop request" in stopped.logs[0], stopped.text()
    assert [m["step"] for m in run.metrics()] == [1, 2, 3]
    assert run.state(3)["cursor"] == 3 * batch

    for g in range(steps * batch):
        shutil.copy(sample_file(samples, g), sample_file(partial, g))
    again = launch(run, port_factory())
    assert again.ok, again.text()
    assert [m["step"] for m in run.metrics()] == list(range(1, steps + 1))
    want, got = reference.exported(steps), run.exported(steps)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[name], got[name]) for name in want), (
        "the resumed run differs from the uninterrupted one"
    )
