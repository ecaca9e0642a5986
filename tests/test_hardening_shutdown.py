"""Issue 15, item 10: when a component fails, the local supervisor stops every task of the other
component at once (SIGTERM to all, then one grace deadline from ``job.stop_grace_s``), instead of
one task at a time."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.support.launcher_cli import REPO, launch, probe_overrides

pytestmark = pytest.mark.distributed

STOP_DELAY_S = 3


def only_job_dir(runs_dir: Path) -> Path:
    (job_dir,) = [p for p in (runs_dir / "tiny").iterdir() if p.is_dir()]
    return job_dir


@pytest.mark.slow
def test_failed_capture_stops_all_trainer_ranks_in_parallel(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    data = tmp_path / "train.jsonl"  # the probe reads no data; the preflight checks its digest
    data.write_text('{"id": "r0", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}\n')
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    done = launch(
        [
            "tiny",
            "--local",
            "--probe",
            *probe_overrides(runs),
            "--set",
            f"data.train_path={data}",
            "--set",
            f"data.expected_sha256={digest}",
            "--set",
            "data.num_rows=null",
            "--set",
            "job.env.DSPARK_PROBE_FAIL=capture",
            "--set",
            "job.env.DSPARK_PROBE_HOLD_S=120",
            "--set",
            f"job.env.DSPARK_PROBE_STOP_DELAY_S={STOP_DELAY_S}",
            "--set",
            "job.stop_grace_s=60",
        ]
    )
    assert done.returncode != 0
    stops = only_job_dir(runs) / "probe" / "stops"
    signalled = {p.stem: float(p.read_text()) for p in stops.glob("trainer_*.term")}
    left = {p.stem: float(p.read_text()) for p in stops.glob("trainer_*.exit")}
    assert len(signalled) == 4 and len(left) == 4, (sorted(signalled), sorted(left), done.stderr[-2000:])
    # every rank got its SIGTERM before any rank had finished stopping: they stop side by side
    assert max(signalled.values()) < min(left.values()), (signalled, left)


@pytest.mark.slow
@pytest.mark.mooncake
def test_sigterm_to_the_local_supervisor_keeps_the_work(tmp_path: Path, tiny_assets: Path) -> None:
    """Ctrl-C or SIGTERM to ``launcher tiny --local``: the trainer is stopped first, finishes its step and
    checkpoints while the capture still serves it; the console says STOPPED with the step and the resume
    command, and status says STOPPED. (Before: the capture and its master went first, the trainer waited
    for samples, was killed after the grace period and no checkpoint was written.)"""
    import re
    import signal
    import subprocess
    import sys
    import time

    from tests.support.tiny_runs import final_weights, metrics, run_tiny

    runs = tmp_path / "runs"
    # No periodic checkpoint before the stop: the one found afterwards is the stop's. The run has --set
    # overrides of result fields: its resume continues with them (issue 35: the resume is the same run).
    same_run = ("trainer.checkpoint.every_steps=1000", "trainer.optimizer.lr=0.001", "trainer.max_steps=12")
    command = [sys.executable, "-m", "launcher", "tiny", "--local", *probe_overrides(runs)]
    for item in same_run:
        command += ["--set", item]
    supervisor = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and supervisor.poll() is None:
            jobs = list((runs / "tiny").glob("*/metrics.jsonl")) if (runs / "tiny").exists() else []
            if jobs and len(jobs[0].read_text().splitlines()) >= 3:
                break
            time.sleep(0.2)
        assert supervisor.poll() is None, "the run ended before the stop"
        stopped_at = time.monotonic()
        supervisor.send_signal(signal.SIGTERM)
        console, _ = supervisor.communicate(timeout=240)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.communicate()
    took_s = time.monotonic() - stopped_at
    job_dir = only_job_dir(runs)
    assert supervisor.returncode == 130, console[-4000:]
    found = re.search(
        r"\[local\] STOPPED: stopped after step (\d+) on request; checkpoint (\S+); resume with `(.+)`", console
    )
    assert found, console[-4000:]
    step = int(found.group(1))
    assert f"--resume {job_dir}" in found.group(3)
    assert metrics(job_dir)[-1]["step"] == step, "the checkpoint is at the last step the trainer finished"
    state = json.loads((job_dir / "checkpoints" / "latest" / "trainer_state.json").read_text())
    assert state["step"] == step and step < 12
    status = launch(["status", str(job_dir)]).stdout
    assert re.search(r"^  trainer +1 STOPPED ", status, re.M) and re.search(r"^  capture +0 STOPPED ", status, re.M), (
        status
    )
    assert (
        "'tiny': STOPPED" in status and f"newest complete {job_dir / 'checkpoints' / f'step_{step:08d}'}" in status
    ), status
    print(f"stopped at step {step}; {took_s:.1f} s from SIGTERM to the supervisor's exit")

    # The printed resume command, as printed: it continues at lr 0.001 to the run's own 12 steps, and
    # ends bit for bit where an uninterrupted run with the same overrides ends.
    assert found.group(3) == f"python3 -m launcher --resume {job_dir} --local", found.group(3)
    resumed = launch(found.group(3).split()[3:])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    (resumed_dir,) = {p for p in (runs / "tiny").iterdir() if p.is_dir()} - {job_dir}
    rows = metrics(resumed_dir)
    assert [r["step"] for r in rows] == list(range(step + 1, 13)) and {r["lr"] for r in rows} == {0.001}
    assert json.loads((resumed_dir / "job.json").read_text())["parent"]["job_id"] == f"local-{job_dir.name}"
    whole = run_tiny("local", tmp_path / "whole", *same_run[1:])
    assert [r["loss"] for r in metrics(whole)][step:] == [r["loss"] for r in rows]
    assert final_weights(resumed_dir / "checkpoints") == final_weights(whole / "checkpoints")
