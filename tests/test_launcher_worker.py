"""``launcher.worker`` (one srun task of a hetjob) without a cluster: the Slurm variables a task would
get, the payload pickle a manual sbatch's resolve step writes, the environment probe as the component, and fake
``scontrol`` at the process boundary (tests/support/fake_slurm.py). Both components' workers run
side by side on loopback, as the two het groups would: results land as submitit result pickles
under job-wide task ids, a failed component leaves an error result with its trace, and the time-out
signal makes task 0 checkpoint the payload (one more requeue) and ask Slurm to requeue the job. The
real local cluster tests run the same worker under real Slurm."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.hetjob import SUBMITIT_DIRNAME, task_index
from runtime.transport.loopback import free_port
from tests.support.fake_slurm import FakeSlurm
from tests.support.launcher_cli import launch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
JOB_ID = "4242"


def _job(tmp_path: Path, *sets: str) -> Path:
    job_dir = tmp_path / "job"
    ports = [
        f"job.master_port={free_port()}",
        f"transport.master_rpc_port={free_port()}",
        f"transport.metadata_http_port={free_port()}",
        f"transport.metrics_port={free_port()}",
    ]
    single = ["job.trainer.tasks_per_node=1", "trainer.global_batch_size=2"]
    overrides = [*single, "transport.bind_address=127.0.0.1", *ports, *sets]
    args = ["resolve", "tiny", "--job-dir", str(job_dir), "--slurm-job-id", JOB_ID]
    for item in overrides:
        args += ["--set", item]
    done = launch(args)  # a manual sbatch's resolve step: it also writes the payload pickle
    assert done.returncode == 0, done.stderr
    assert (job_dir / SUBMITIT_DIRNAME / f"{JOB_ID}_submitted.pkl").exists()
    return job_dir


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    """The workers a test starts; any still running at its end (a failed assertion) are killed with
    their process groups, so no component outlives the test."""
    workers: list[subprocess.Popen[str]] = []
    yield workers
    for worker in workers:
        if worker.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=30)


def _worker(
    component: str, job_dir: Path, fake: FakeSlurm, started: list[subprocess.Popen[str]]
) -> subprocess.Popen[str]:
    env = {
        **fake.environ(),
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_NODELIST_HET_GROUP_0": "localhost",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "localhost",
        "SLURMD_NODENAME": "localhost",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": "1",
    }
    command = [sys.executable, "-m", "launcher.worker", "--component", component, "--job-dir", str(job_dir), "--probe"]
    worker = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    started.append(worker)
    return worker


def _result(job_dir: Path, component: str) -> tuple[str, object]:
    task = task_index(component, 0, trainer_world_size=1)
    path = job_dir / SUBMITIT_DIRNAME / f"{JOB_ID}_{task}_result.pkl"
    with path.open("rb") as handle:
        return pickle.load(handle)


@pytest.fixture
def fake(tmp_path: Path) -> FakeSlurm:
    return FakeSlurm(tmp_path / "fake-slurm")


def test_both_components_run_and_leave_result_files(tmp_path: Path, fake: FakeSlurm, started: list) -> None:
    job_dir = _job(tmp_path)
    workers = {name: _worker(name, job_dir, fake, started) for name in ("capture", "trainer")}
    outputs = {name: w.communicate(timeout=240)[0] for name, w in workers.items()}
    assert all(w.returncode == 0 for w in workers.values()), outputs
    for name in ("capture", "trainer"):
        status, result = _result(job_dir, name)
        assert status == "success" and result["component"] == name and result["exit_code"] == 0, result  # type: ignore[index]
    assert "[worker trainer/0 task 0 on " in outputs["trainer"] and "finished in" in outputs["trainer"]
    assert (job_dir / "probe" / "trainer_0.json").exists() and (job_dir / "probe" / "capture_0.json").exists()


def test_a_failed_component_leaves_an_error_result_with_its_trace(
    tmp_path: Path, fake: FakeSlurm, started: list
) -> None:
    job_dir = _job(tmp_path, "job.env.DSPARK_PROBE_FAIL=capture")
    workers = {name: _worker(name, job_dir, fake, started) for name in ("capture", "trainer")}
    outputs = {name: w.communicate(timeout=240)[0] for name, w in workers.items()}
    assert workers["capture"].returncode == 1 and workers["trainer"].returncode == 0, outputs
    status, trace = _result(job_dir, "capture")
    assert status == "error" and "capture task 0 exited with code 3" in str(trace)
    # the first task to die names itself the cause, with the resume command
    assert (
        "FAILED (the first task to die): capture rank 0 exited with code 3; resume with `python3 -m launcher "
        in (outputs["capture"])
    ), outputs["capture"]
    assert f"--resume {job_dir}`; log {job_dir}/logs/" in outputs["capture"]
    assert "Traceback" not in outputs["capture"], "a component's failure is one line, not a worker traceback"


def test_the_timeout_signal_makes_task_0_checkpoint_the_payload_and_requeue(
    tmp_path: Path, fake: FakeSlurm, started: list
) -> None:
    job_dir = _job(tmp_path, "job.env.DSPARK_PROBE_HOLD_S=120")
    workers = {name: _worker(name, job_dir, fake, started) for name in ("capture", "trainer")}
    deadline = time.monotonic() + 120
    while not (job_dir / "probe" / "trainer_0.json").exists():  # the probe recorded, then holds
        assert time.monotonic() < deadline and workers["trainer"].poll() is None
        time.sleep(0.5)
    workers["trainer"].send_signal(signal.SIGUSR2)
    output = workers["trainer"].communicate(timeout=120)[0]
    requeues = [c["argv"] for c in fake.calls("scontrol")]
    assert requeues and requeues[0][:2] == ["requeue", JOB_ID], (requeues, output)
    with (job_dir / SUBMITIT_DIRNAME / f"{JOB_ID}_submitted.pkl").open("rb") as handle:
        assert pickle.load(handle).function.requeue_count == 1
    # task 0 stopped its trainer child first, then told the capture it may stop (the stop order)
    assert (job_dir / "capture.stop").exists(), output
    workers["capture"].terminate()
    workers["capture"].communicate(timeout=120)


def test_on_sigterm_to_every_task_the_trainer_stops_first_and_the_capture_after_it(
    tmp_path: Path, fake: FakeSlurm, started: list
) -> None:
    """``scancel`` (or the requeue after the time-out signal) sends SIGTERM to every task at once. The
    capture task keeps its component, and the Mooncake master, serving until the trainer has stopped (it
    takes 3 s here, as a checkpoint would), and stops it only then."""
    job_dir = _job(tmp_path, "job.env.DSPARK_PROBE_HOLD_S=120", "job.env.DSPARK_PROBE_STOP_DELAY_S=3")
    workers = {name: _worker(name, job_dir, fake, started) for name in ("capture", "trainer")}
    deadline = time.monotonic() + 120
    while not all((job_dir / "probe" / f"{name}_0.json").exists() for name in workers):
        assert time.monotonic() < deadline and all(w.poll() is None for w in workers.values())
        time.sleep(0.5)
    for worker in workers.values():
        worker.send_signal(signal.SIGTERM)
    outputs = {name: w.communicate(timeout=120)[0] for name, w in workers.items()}
    stops = job_dir / "probe" / "stops"
    trainer_left = float((stops / "trainer_0.exit").read_text())
    capture_told = float((stops / "capture_0.term").read_text())
    assert capture_told >= trainer_left, (capture_told - trainer_left, outputs)
    assert "the capture keeps serving until the trainer has stopped" in outputs["capture"], outputs["capture"]
    assert "the trainer has ended (capture.stop); stopping the capture component" in outputs["capture"]
    assert all(w.returncode == 128 + signal.SIGTERM for w in workers.values()), outputs


def test_a_capture_task_stops_after_the_grace_when_the_trainer_does_not(
    tmp_path: Path, fake: FakeSlurm, started: list
) -> None:
    """Only the capture task gets SIGTERM and the trainer's never says it stopped (its node is gone):
    the capture waits job.stop_grace_s, not forever."""
    job_dir = _job(
        tmp_path, "job.env.DSPARK_PROBE_HOLD_S=120", "job.env.DSPARK_PROBE_STOP_DELAY_S=0.5", "job.stop_grace_s=2"
    )
    workers = {name: _worker(name, job_dir, fake, started) for name in ("capture", "trainer")}
    capture = workers["capture"]
    deadline = time.monotonic() + 120
    while not all((job_dir / "probe" / f"{name}_0.json").exists() for name in workers):
        assert time.monotonic() < deadline and all(w.poll() is None for w in workers.values())
        time.sleep(0.5)
    signalled = time.time()
    capture.send_signal(signal.SIGTERM)
    output = capture.communicate(timeout=60)[0]
    waited_s = float((job_dir / "probe" / "stops" / "capture_0.term").read_text()) - signalled
    assert 2 <= waited_s < 5, (waited_s, output)
    assert "the trainer has not stopped within job.stop_grace_s = 2 s; stopping the capture component" in output
