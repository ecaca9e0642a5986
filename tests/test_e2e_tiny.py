"""The tiny pipeline end to end with --local: capture (master + embedded engine + producer) and the
4-rank CPU trainer train over Mooncake. The loss falls and tau rises; the optimizer consumed exactly
the prompt order; a run stopped at step 16 and resumed by a second submission (``tiny --resume JOB`` at the recipe's full
length, as the runbook does) reaches the same weights as an uninterrupted run.

The uninterrupted run is the shared reference run (``tiny_reference_run``: 32 steps), made once for
every test that compares against it. The same pipeline on the real local Slurm cluster: the runbook
test (stop at 16, resume, an uninterrupted run, all exact) and the two-capture-node test.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.launcher_cli import launch
from tests.support.tiny_runs import final_weights, metrics, prompt_rows, run_tiny, weights_at

pytestmark = [pytest.mark.slow, pytest.mark.mooncake, pytest.mark.distributed]


def test_tiny_trains_and_consumes_the_prompt_order(tiny_reference_run: Path) -> None:
    full = tiny_reference_run
    records = metrics(full)
    assert [r["step"] for r in records] == list(range(1, 33))
    first, last = records[:4], records[-4:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    print(
        f"loss {mean(first, 'loss'):.3f} -> {mean(last, 'loss'):.3f}, "
        f"tau {mean(first, 'tau'):.3f} -> {mean(last, 'tau'):.3f}"
    )
    assert mean(last, "loss") < mean(first, "loss"), "the loss falls on the tiny target"
    assert mean(last, "tau") > mean(first, "tau"), "tau rises"
    consumed = [row for r in records for row in r["row_indices"]]
    assert consumed == prompt_rows(0, 256), "the optimizer saw exactly the prompt order"
    assert final_weights(full / "checkpoints")[0] == 32
    status = launch(["status", str(full)])
    assert "capture" in status.stdout and "trainer" in status.stdout and "COMPLETED" in status.stdout
    for component in ("capture", "trainer"):  # how long each ran, as sacct gives it for a Slurm job
        assert re.search(rf"^  {component} .* \d\d:\d\d:\d\d +localhost$", status.stdout, re.M), status.stdout
    logs = launch(["logs", str(full)]).stdout
    assert "_capture_0.out" in logs and "_trainer_0.out" in logs and "[trainer]" in logs


def test_a_run_stopped_at_step_16_resumes_exactly(tmp_path: Path, tiny_reference_run: Path) -> None:
    """Stop after 16 steps, then a second submission resumes from the checkpoint: the same rows, losses
    and final weights as the uninterrupted reference run. (On Slurm, tests/test_runbook.py checks the
    same of the runbook's stop-and-resume.)"""
    runs = tmp_path / "runs"
    records = metrics(tiny_reference_run)
    reference_checkpoints = tiny_reference_run / "checkpoints"

    shared = tmp_path / "checkpoints"
    stopped = run_tiny("local", runs, "trainer.max_steps=16", f"trainer.checkpoint.dir={shared}")
    stopped_records = metrics(stopped)
    assert [r["step"] for r in stopped_records] == list(range(1, 17))
    assert [row for r in stopped_records for row in r["row_indices"]] == prompt_rows(0, 128)
    assert [r["loss"] for r in stopped_records] == [r["loss"] for r in records[:16]]
    assert final_weights(shared) == weights_at(reference_checkpoints, 16)

    # The runbook's way: the recipe named again, the job's own --set kept, its max_steps lifted (a longer run
    # is the same run at tiny's constant learning rate).
    resumed = run_tiny("local", runs, "trainer.max_steps=null", flags=("--resume", str(stopped)))
    resumed_records = metrics(resumed)
    assert [r["step"] for r in resumed_records] == list(range(17, 33)), "continued from step 16"
    assert [row for r in resumed_records for row in r["row_indices"]] == prompt_rows(128, 128)
    assert [r["loss"] for r in resumed_records] == [r["loss"] for r in records[16:]]
    assert final_weights(shared) == final_weights(reference_checkpoints), (
        "resumed weights equal the uninterrupted run's"
    )
    status = launch(["status", str(resumed)])
    assert "capture" in status.stdout and "trainer" in status.stdout and "COMPLETED" in status.stdout
    assert f"parent: resumes job local-{stopped.name} ({stopped}) from {shared / 'step_00000016'}" in status.stdout
    logs = launch(["logs", str(resumed)]).stdout
    assert "_capture_0.out" in logs and "_trainer_0.out" in logs and "[trainer]" in logs


def test_tiny_with_streamed_experts_trains_exactly_like_resident(tmp_path: Path, tiny_reference_run: Path) -> None:
    """capture.expert_streaming on, most experts on the host (2 of 8 MoE layers resident), and the
    Mooncake sample segment on the trainer node: the same per-step losses, consumed rows and weights
    as the all-resident reference run (segment on the capture node) after its first 8 steps."""
    streamed = run_tiny(
        "local",
        tmp_path / "runs",
        "trainer.max_steps=8",
        "capture.expert_streaming.enabled=true",
        "capture.expert_streaming.resident_fraction=0.25",
        "transport.segment_placement=trainer",
    )
    assert "expert streaming on cpu: 2 of 8 MoE layers resident, 6 streamed" in launch(["logs", str(streamed)]).stdout
    got, expected = metrics(streamed), metrics(tiny_reference_run)[:8]
    assert [r["step"] for r in got] == list(range(1, 9))
    assert [r["loss"] for r in got] == [r["loss"] for r in expected]
    assert [r["row_indices"] for r in got] == [r["row_indices"] for r in expected]
    assert final_weights(streamed / "checkpoints") == weights_at(tiny_reference_run / "checkpoints", 8)


def test_a_corrupt_checkpoint_is_refused_in_one_console_line_and_the_printed_resume_works(
    tmp_path: Path, tiny_reference_run: Path
) -> None:
    """Resuming from a checkpoint with flipped bytes: the console says why and what to do once, with no
    traceback; the traceback is kept beside the logs. The resume command the failure prints, run as
    printed, does not loop on the refused checkpoint: checked on the login node first, it skips it for the
    one before it and continues bit for bit as the uninterrupted reference run."""
    import shlex
    import shutil

    from tests.support.launcher_cli import probe_overrides

    for step in ("step_00000008", "step_00000016"):
        shutil.copytree(tiny_reference_run / "checkpoints" / step, tmp_path / "checkpoints" / step)
    checkpoint = tmp_path / "checkpoints" / "step_00000016"
    shard = max((checkpoint / "dcp").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    shard.write_bytes(bytes(data))

    runs = tmp_path / "runs"
    args = ["tiny", *probe_overrides(runs), "--set", f"trainer.checkpoint.resume_from={checkpoint}", "--local"]
    done = launch(args)
    console = done.stdout + done.stderr
    assert done.returncode != 0, console[-3000:]
    assert "Traceback" not in console, console[-3000:]
    said = [line for line in console.splitlines() if f"{shard.name} is corrupt: sha256" in line]
    # Said once, by the trainer; the supervisor's lines point at it, the status table the run ends with
    # (what `status` shows later) keeps the reason as its note, and the closing line names the cause again.
    closing = "[local] the cause, above: trainer rank 0 exited with code 1: checkpoint file "
    assert any(line.startswith(closing) for line in said), console[-3000:]
    refusals = [line for line in said if not line.strip().startswith("note:") and not line.startswith(closing)]
    assert len(refusals) == 1, console[-3000:]
    assert refusals[0].startswith("[trainer rank 0] error: checkpoint file ") and "Fix:" in refusals[0], refusals
    failed = "[local] FAILED: trainer rank 0 exited with code 1; its error line above says why and the fix"
    assert failed in console, console[-3000:]
    (job_dir,) = (runs / "tiny").iterdir()
    assert "CheckpointError" in (job_dir / "logs" / "trainer_0.traceback.txt").read_text()

    # The printed resume command, as printed (the job's own recipe: its ports, its runs folder).
    (printed,) = {m for m in re.findall(r"resume with `([^`]+)`", console)}
    assert printed == f"python3 -m launcher --resume {job_dir} --local", printed
    resumed = launch(shlex.split(printed)[3:])
    console = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, console[-3000:]
    lines = console.splitlines()
    skipped = [i for i, line in enumerate(lines) if line.startswith("skipped step_00000016 is not whole (checkpoint")]
    chosen = [i for i, line in enumerate(lines) if line.startswith("resuming from ") and "step_00000008" in line]
    started = [i for i, line in enumerate(lines) if line.startswith("[local] job ")]
    assert skipped and chosen and started and skipped[0] < chosen[0] < started[0], console[:3000]
    (again,) = set((runs / "tiny").iterdir()) - {job_dir}
    assert [r["step"] for r in metrics(again)] == list(range(9, 33)), "continued from step 8"
    assert final_weights(again / "checkpoints") == final_weights(tiny_reference_run / "checkpoints")
