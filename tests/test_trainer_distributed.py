"""Real multi-process trainer runs over gloo (``python3 -m runtime.trainer`` ranks, FSDP2):
4 ranks == 1 rank, resume == uninterrupted, weights-only warm start, resume mismatch errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.trainer_runs import Run, launch, make_inputs, make_run

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_inputs(tmp_path_factory.mktemp("trainer-inputs"))


def assert_launched(result, run: Run) -> None:
    assert result.ok, result.text()


@pytest.mark.slow
def test_four_rank_fsdp2_equals_one_rank(tmp_path: Path, inputs, port_factory) -> None:
    target, samples = inputs
    common = ["trainer.gradient_accumulation_steps=2", "trainer.global_batch_size=8", "trainer.max_steps=2"]
    four = make_run(
        tmp_path,
        "four",
        world_size=4,
        target=target,
        samples=samples,
        overrides=[*common, "trainer.micro_batch_size=1"],
    )
    one = make_run(
        tmp_path, "one", world_size=1, target=target, samples=samples, overrides=[*common, "trainer.micro_batch_size=4"]
    )
    for run in (four, one):
        assert_launched(launch(run, port_factory()), run)

    four_metrics, one_metrics = four.metrics(), one.metrics()
    assert [m["step"] for m in four_metrics] == [1, 2] == [m["step"] for m in one_metrics]
    for a, b in zip(four_metrics, one_metrics, strict=True):
        for key in ("loss", "loss_ce", "loss_l1", "loss_confidence", "grad_norm", "lr", "tau", "tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert four_metrics[0]["lr"] != four_metrics[1]["lr"]  # warmup: the schedule moved
    w4, w1 = four.exported(2), one.exported(2)
    assert set(w4) == set(w1)
    for name in w4:
        assert torch.allclose(w4[name], w1[name], rtol=1e-5, atol=1e-6), name
    state4 = four.state(2)
    assert state4["world_size"] == 4 and state4["step"] == 2 and state4["cursor"] == 16
    assert four.state(2)["weights_sha256"] != one.state(2)["weights_sha256"] or torch.equal(
        w4["fc.weight"], w1["fc.weight"]
    )


@pytest.mark.slow
def test_resume_equals_uninterrupted_then_warm_start_and_mismatches(tmp_path: Path, inputs, port_factory) -> None:
    target, samples = inputs
    schedule = [
        "trainer.schedule.type=cosine",
        "trainer.schedule.warmup_steps=1",
        "trainer.schedule.total_steps=4",
        "trainer.schedule.min_lr_ratio=0.1",
        "trainer.gradient_accumulation_steps=2",
        "trainer.global_batch_size=4",
        "trainer.checkpoint.every_steps=2",
        "trainer.checkpoint.keep_last=1",
    ]
    whole = make_run(
        tmp_path, "whole", world_size=2, target=target, samples=samples, overrides=[*schedule, "trainer.max_steps=4"]
    )
    assert_launched(launch(whole, port_factory()), whole)

    shared = tmp_path / "shared-checkpoints"
    first = make_run(
        tmp_path,
        "first",
        world_size=2,
        target=target,
        samples=samples,
        overrides=[*schedule, "trainer.max_steps=2"],
        checkpoint_dir=shared,
    )
    assert_launched(launch(first, port_factory()), first)
    second = make_run(
        tmp_path,
        "second",
        world_size=2,
        target=target,
        samples=samples,
        overrides=[*schedule, "trainer.max_steps=4", "trainer.checkpoint.resume_from=auto"],
        checkpoint_dir=shared,
    )
    result = launch(second, port_factory())
    assert_launched(result, second)
    assert "resume (resume_from auto" in result.logs[0]

    resumed = first.metrics() + second.metrics()
    uninterrupted = whole.metrics()
    assert [m["step"] for m in resumed] == [1, 2, 3, 4] == [m["step"] for m in uninterrupted]
    lrs = [m["lr"] for m in uninterrupted]
    assert len(set(lrs)) == 4  # warmup then cosine: every step has its own lr
    assert [m["lr"] for m in resumed] == lrs
    for a, b in zip(resumed, uninterrupted, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["cursor"] == b["cursor"]
    w_resumed, w_whole = second.exported(4), whole.exported(4)
    for name in w_whole:
        assert torch.allclose(w_resumed[name], w_whole[name], rtol=1e-6, atol=1e-7), name
    full_resumed = Run(second.job_dir, second.recipe_path, shared, 2).full_checkpoint(4, tmp_path)
    full_whole = whole.full_checkpoint(4, tmp_path)
    exp_avg_key = next(k for k in full_whole["optim"]["state"] if "fc.weight" in k)
    assert torch.allclose(
        full_resumed["optim"]["state"][exp_avg_key]["exp_avg"],
        full_whole["optim"]["state"][exp_avg_key]["exp_avg"],
        rtol=1e-5,
        atol=1e-9,
    )
    assert sorted(p.name for p in shared.iterdir() if p.name.startswith("step_")) == ["step_00000004"]  # keep_last 1

    # weights-only warm start from step 4: weights loaded; optimizer, schedule, counters fresh
    warm = make_run(
        tmp_path,
        "warm",
        world_size=2,
        target=target,
        samples=samples,
        overrides=[*schedule, "trainer.max_steps=1", f"trainer.checkpoint.init_from={shared / 'step_00000004'}"],
    )
    result = launch(warm, port_factory())
    assert_launched(result, warm)
    assert "warm start" in result.logs[0]
    warm_metrics = warm.metrics()
    assert [m["step"] for m in warm_metrics] == [1] and warm_metrics[0]["cursor"] == 4  # counters from 0
    assert warm_metrics[0]["lr"] == pytest.approx(lrs[0])  # the schedule starts over (warmup step 0)
    before, after = w_whole, warm.exported(1)
    delta = torch.cat([(after[n] - before[n]).abs().flatten() for n in before])
    # fresh AdamW: the first update moves each weight by lr * g / (|g| + eps), i.e. at most lr
    assert float(delta.max()) <= lrs[0] * 1.001
    assert float(delta.median()) > 0.5 * lrs[0]
    warm_full = warm.full_checkpoint(1, tmp_path)
    assert all(int(s["step"]) == 1 for s in warm_full["optim"]["state"].values())
    assert warm.state(1)["step"] == 1

    # resuming with another schedule, world size, data digest and prompt seed names both values of each
    changed = make_run(
        tmp_path,
        "changed",
        world_size=1,
        target=target,
        samples=samples,
        overrides=[
            *schedule,
            "trainer.schedule.type=linear",
            "trainer.micro_batch_size=2",
            "trainer.max_steps=4",
            "trainer.prompt_seed=8",
            f"data.expected_sha256={'cd' * 32}",
            f"trainer.checkpoint.resume_from={shared / 'step_00000004'}",
        ],
    )
    result = launch(changed, port_factory())
    assert result.codes == [1]
    log = result.logs[0]
    assert "cannot resume from" in log
    assert "trainer.schedule.type: the checkpoint has 'cosine', this run has 'linear'" in log
    assert "the checkpoint has 2, this run has 1" in log
    assert f"the checkpoint has '{'ab' * 32}', this run has '{'cd' * 32}'" in log
    # A refusal is one line for the operator; the traceback is kept beside the logs, not in them.
    assert "Traceback" not in log and "[trainer rank 0] error: cannot resume from" in log, log[-3000:]
    assert "CheckpointError" in (changed.job_dir / "logs" / "trainer_0.traceback.txt").read_text()
    assert "trainer.prompt_seed: the checkpoint has 7, this run has 8" in log
