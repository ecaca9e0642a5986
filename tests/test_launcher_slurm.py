"""The launcher on the real two-node local Slurm cluster (tools/slurm_local): one hetjob, two
components on different nodes, the environment contract, status, cancel, failure and requeue."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from submitit.core import utils

from launcher.control import job_report
from launcher.hetjob import HetJob
from launcher.jobs import JobRecord, find_record
from tests.support.launcher_cli import CONTRACT, TRAINER_CONTRACT, launch, probe_overrides, read_probes

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent

JOB_TIMEOUT_S = 240.0


def submit(runs: Path, *extra: str) -> str:
    """Submit the tiny recipe's probe job; returns the job id."""
    done = launch(["tiny", "--probe", *probe_overrides(runs), *extra])
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.split("submitted job ", 1)[1].split()[0]


def wait_for_state(job_id: str, runs: Path, accept: set[str], timeout_s: float = JOB_TIMEOUT_S) -> str:
    """Poll ``status`` until the job state is in ``accept``; returns it."""
    record = find_record(job_id, runs)
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        state = job_report(record).state
        if state in accept:
            return state
        time.sleep(2)
    raise AssertionError(f"job {job_id} still {state!r} after {timeout_s:.0f} s (wanted {sorted(accept)})")


def wait_for_text(path: Path, text: str, timeout_s: float = JOB_TIMEOUT_S) -> None:
    """Wait until ``path`` exists and contains ``text``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(1)
    raise AssertionError(f"{path} never contained {text!r}")


def tiny_run_past_step_3(runs: Path) -> tuple[str, JobRecord, Path]:
    """Submit a real tiny run (no periodic checkpoint before step 1000, so a checkpoint found later is a
    stop's) and wait until it has finished 3 steps; returns its job id, record and metrics file."""
    done = launch(["tiny", *probe_overrides(runs), "--set", "trainer.checkpoint.every_steps=1000"])
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = done.stdout.split("submitted job ", 1)[1].split()[0]
    record = find_record(job_id, runs)
    metrics = Path(record.job_dir) / "metrics.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline, "the trainer never reached step 3"
        time.sleep(0.5)
    return job_id, record, metrics


def test_hetjob_runs_both_components_with_the_contract(slurm_cluster, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    started = time.monotonic()
    job_id = submit(runs)
    assert wait_for_state(job_id, runs, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED"
    print(f"probe hetjob {job_id}: submitted to COMPLETED in {time.monotonic() - started:.1f} s")
    record = find_record(job_id, runs)
    report = job_report(record)
    assert [(c.name, c.state) for c in report.components] == [("capture", "COMPLETED"), ("trainer", "COMPLETED")]
    assert report.components[0].nodes != report.components[1].nodes, "the components ran on different nodes"

    probes = read_probes(Path(record.job_dir))
    assert sorted(probes) == [("capture", 0), ("trainer", 0), ("trainer", 1), ("trainer", 2), ("trainer", 3)]
    capture_node = probes[("capture", 0)]["env"]["SLURMD_NODENAME"]
    trainer_nodes = {probes[("trainer", r)]["env"]["SLURMD_NODENAME"] for r in range(4)}
    assert len(trainer_nodes) == 1 and capture_node not in trainer_nodes
    trainer_node = trainer_nodes.pop()
    for rank in range(4):
        env = probes[("trainer", rank)]["env"]
        assert set(env) >= TRAINER_CONTRACT, "same contract as --local"
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == str(rank)
        assert env["MASTER_ADDR"] == trainer_node, "MASTER_ADDR is the trainer group's own node"
        assert probes[("trainer", rank)]["all_reduce_sum"] == 6
    capture = probes[("capture", 0)]
    assert set(capture["env"]) >= CONTRACT and "RANK" not in capture["env"]
    resolved = json.loads((Path(record.job_dir) / "recipe.resolved.json").read_text())["recipe"]
    port = resolved["transport"]["master_rpc_port"]
    assert capture["env"]["DSPARK_MOONCAKE_MASTER"].endswith(f":{port}")
    assert capture["trainer_message"] == "trainer-ok", "trainer rank 0 reached the capture node's endpoint"

    status = launch(["status", job_id, "--runs-dir", str(runs)])
    assert status.returncode == 0 and "capture" in status.stdout and "trainer" in status.stdout
    logs = launch(["logs", job_id, "--runs-dir", str(runs)])
    assert "_capture_0.out" in logs.stdout and "_trainer_3.out" in logs.stdout


def test_one_node_layout_runs_both_components_as_steps_sharing_the_node_and_its_gpu(
    slurm_cluster, tmp_path: Path
) -> None:
    """recipes/one_gpu.yaml (job.layout: one_node) on one node with one GPU: the probe job's two
    overlapping steps start together, both see the one GPU, and the trainer reaches the capture's store."""
    runs = tmp_path / "runs"
    cache = f"trainer.feature_cache.dir={tmp_path / 'features'}"
    done = launch(["one_gpu", "--probe", *probe_overrides(runs, short_run=False), "--set", cache])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "capture + trainer one node" in done.stdout
    job_id = done.stdout.split("submitted job ", 1)[1].split()[0]
    assert wait_for_state(job_id, runs, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED"
    record = find_record(job_id, runs)
    assert record.one_node
    report = job_report(record)
    assert [(c.name, c.state, c.het_group) for c in report.components] == [
        ("capture", "COMPLETED", None),
        ("trainer", "COMPLETED", None),
    ], "both read from the one plain job, no het group"
    probes = read_probes(Path(record.job_dir))
    assert sorted(probes) == [("capture", 0), ("trainer", 0)]
    capture, trainer = probes[("capture", 0)], probes[("trainer", 0)]
    assert capture["env"]["SLURMD_NODENAME"] == trainer["env"]["SLURMD_NODENAME"], "one node"
    assert capture["env"]["CUDA_VISIBLE_DEVICES"] == trainer["env"]["CUDA_VISIBLE_DEVICES"] == "0", "one GPU, shared"
    assert trainer["env"]["WORLD_SIZE"] == "1", "the trainer step's own task count, not the job's"
    assert capture["trainer_message"] == "trainer-ok", "trainer rank 0 reached the capture's endpoint"


def test_cancel_cancels_both_components(slurm_cluster, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    job_id = submit(runs, "--set", "job.env.DSPARK_PROBE_HOLD_S=600")
    record = find_record(job_id, runs)
    wait_for_text(record.log_path("trainer", 0), "holding")
    done = launch(["cancel", job_id, "--runs-dir", str(runs)])
    assert done.returncode == 0, done.stderr
    assert wait_for_state(job_id, runs, {"CANCELLED", "FAILED", "COMPLETED"}) == "CANCELLED"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = [c.state for c in job_report(record).components]
        if all(s.startswith("CANCELLED") for s in states):
            break
        time.sleep(2)
    assert all(s.startswith("CANCELLED") for s in states), states


def test_failed_component_ends_the_wait(slurm_cluster, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    job_id = submit(runs, "--set", "job.env.DSPARK_PROBE_FAIL=capture", "--set", "job.env.DSPARK_PROBE_HOLD_S=600")
    started = time.monotonic()
    assert wait_for_state(job_id, runs, {"FAILED", "COMPLETED", "CANCELLED"}) == "FAILED"
    status = launch(["status", job_id, "--runs-dir", str(runs)])
    assert status.returncode == 1 and "FAILED" in status.stdout
    record = find_record(job_id, runs)
    # submitit's own wait on the job must end too (it would hang on an unparsed 123+0 row).
    job = HetJob(folder=Path(record.job_dir) / "submitit", job_id=job_id, tasks=list(range(5)))
    job.wait()
    assert job.exception() is not None
    assert time.monotonic() - started < 200, "the trainer was held 600 s: the failure stopped it"


def test_usr2_requeues_once_through_task_zero(slurm_cluster, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    job_id = submit(runs, "--set", "job.env.DSPARK_PROBE_HOLD_S=600")
    record = find_record(job_id, runs)
    wait_for_text(record.log_path("trainer", 0), "holding")
    time.sleep(2)  # let every worker install its handlers
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=60)
    # The requeued run does not hold (DSPARK_REQUEUE_COUNT=1), so the job completes.
    assert wait_for_state(job_id, runs, {"COMPLETED", "FAILED", "CANCELLED"}, timeout_s=360) == "COMPLETED"
    probes = read_probes(Path(record.job_dir))
    assert probes[("trainer", 0)]["env"]["DSPARK_REQUEUE_COUNT"] == "1"
    assert probes[("trainer", 0)]["env"]["SLURM_RESTART_COUNT"] == "1"
    payload = utils.DelayedSubmission.load(utils.JobPaths(Path(record.job_dir) / "submitit", job_id).submitted_pickle)
    assert payload.function.requeue_count == 1
    capture_log = record.log_path("capture", 0).read_text(errors="replace")
    assert "Not checkpointing nor requeuing" in capture_log, "only task 0 (trainer rank 0) acts on the signal"


def test_manual_smoke_sbatch_of_the_checked_in_script(slurm_cluster, tiny_assets, tmp_path: Path) -> None:
    """`DSPARK_RESOLVE_ARGS="--smoke" sbatch sbatch/tiny.sbatch` (no launcher): the script resolves the
    recipe in the allocation, runs the gate's checks 1-3 there, writes the job's payload and record,
    runs both components to completion, and `gate` of the job PASSes."""
    runs, job_dir = tmp_path / "runs", tmp_path / "job"
    env = {
        **os.environ,
        "DSPARK_REPO": str(REPO),
        "DSPARK_JOB_DIR": str(job_dir),
        "DSPARK_RESOLVE_ARGS": f"--smoke --set job.runs_dir={runs}",
    }
    done = subprocess.run(
        ["sbatch", str(REPO / "sbatch" / "tiny.sbatch")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    job_id = done.stdout.split()[-1]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (job_dir / "job.json").exists():
        assert time.monotonic() < deadline, "the script never resolved the recipe"
        time.sleep(1)
    assert wait_for_state(job_id, runs, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED"
    record = find_record(job_id, runs)
    assert Path(record.job_dir) == job_dir and record.components == {"capture": 1, "trainer": 4}
    steps = [json.loads(line)["step"] for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]  # the smoke overlay's one step
    assert (tmp_path / f"slurm-tiny-{job_id}.out").exists(), "the batch log lands in the submit directory"
    gated = launch(["gate", str(job_dir)])
    assert gated.returncode == 0 and "smoke gate: PASS" in gated.stdout, gated.stdout + gated.stderr
    assert "NOT RUN" not in gated.stdout


def test_the_time_out_signal_stops_the_trainer_with_a_checkpoint_before_the_requeue(
    slurm_cluster, tiny_assets, tmp_path: Path
) -> None:
    """A real tiny run on the local cluster gets the time-out signal (USR2, what Slurm sends
    job.signal_delay_s before the limit) mid-run: trainer rank 0's task stops the trainer at its next
    step boundary with a checkpoint while the capture and its master still serve, tells the capture to
    stop, and only then requeues (whose SIGTERM reaches every process at once); the requeued run resumes
    from that checkpoint and completes."""
    runs = tmp_path / "runs"
    job_id, record, metrics = tiny_run_past_step_3(runs)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=60)
    assert wait_for_state(job_id, runs, {"COMPLETED", "FAILED", "CANCELLED"}, timeout_s=420) == "COMPLETED"
    trainer_log = record.log_path("trainer", 0).read_text(errors="replace")
    capture_log = record.log_path("capture", 0).read_text(errors="replace")
    assert "stopping the trainer at its next step boundary (a checkpoint) before the requeue" in trainer_log
    stopped = [line for line in trainer_log.splitlines() if "on request; checkpoint" in line]
    assert stopped, trainer_log[-3000:]
    step = int(stopped[0].split("stopped after step ", 1)[1].split()[0])
    # The master served until the trainer had stopped, and the requeue's SIGTERM, which reaches the master
    # too, is the job's stop, not a capture failure.
    assert "the capture fails now" not in capture_log, capture_log[-3000:]
    assert "ERROR" not in capture_log, capture_log[-3000:]
    # The stop's checkpoint (no periodic one before step 1000) is what the requeued run resumed from.
    assert (Path(record.job_dir) / "checkpoints" / f"step_{step:08d}" / "trainer_state.json").is_file()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps[-1] == 32 and sorted(set(steps)) == list(range(1, 33)), steps


def test_a_plain_scancel_keeps_the_last_finished_step(slurm_cluster, tiny_assets, tmp_path: Path) -> None:
    """A plain `scancel JOB` (a preemption acts the same) signals every process of the job at once: the
    capture and its Mooncake master stop with the trainer, so the samples of the step in progress stop
    coming. The trainer drops that step on every rank and checkpoints the last finished one within
    Slurm's KillWait; `status` names that checkpoint and the command that resumes from it."""
    runs = tmp_path / "runs"
    job_id, record, metrics = tiny_run_past_step_3(runs)
    subprocess.run(["scancel", job_id], check=True, timeout=60)
    assert wait_for_state(job_id, runs, {"COMPLETED", "FAILED", "CANCELLED"}) == "CANCELLED"
    # sacct says CANCELLED at once; the ranks are still stopping (Slurm kills them KillWait s later).
    wait_for_text(record.log_path("trainer", 0), "on request; checkpoint", timeout_s=60)
    trainer_log = record.log_path("trainer", 0).read_text(errors="replace")
    stopped = [line for line in trainer_log.splitlines() if "on request; checkpoint" in line]
    step = int(stopped[0].split("stopped after step ", 1)[1].split()[0])
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps[-1] == step < 32, (steps, step)
    # No periodic checkpoint before step 1000: this one is the stop's, and it is complete.
    checkpoint = Path(record.job_dir) / "checkpoints" / f"step_{step:08d}"
    assert (checkpoint / "trainer_state.json").is_file()
    status = launch(["status", job_id, "--runs-dir", str(runs)])
    assert f"newest complete {checkpoint}; resume with `" in status.stdout, status.stdout
    assert f"--resume {record.job_dir}" in status.stdout, status.stdout
