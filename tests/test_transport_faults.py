"""Fault tests of the data plane: real processes (synthetic producer, 2-rank gloo trainer, the
master) killed with SIGKILL and restarted. Each asserts that the g consumed by committed steps, in
order, are exactly 0, 1, 2, ... with no gap and no duplicate, and that every sample's bytes were the
ones captured for its g (the synthetic trainer compares them with a regenerated copy)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.recipe.loader import ResolvedRecipe
from runtime.transport.loopback import free_port, loopback_env, loopback_recipe
from runtime.transport.master import MasterProcess
from runtime.transport.settings import TransportSettings

pytestmark = [pytest.mark.mooncake, pytest.mark.distributed]

REPO = Path(__file__).resolve().parent.parent
STEPS = 10
G = 4
OVERRIDES = [
    "job.trainer.tasks_per_node=2",
    "trainer.gradient_accumulation_steps=2",
    f"trainer.global_batch_size={G}",
    "transport.high_watermark_samples=8",
    "transport.low_watermark_samples=4",
    "transport.client_ttl_s=2",
    "transport.kv_lease_ttl_s=5",
    "transport.poll_interval_s=0.05",
    "transport.retry_backoff_s=0.05",
    "transport.max_retries=3",
    "transport.heartbeat_interval_s=0.5",
    "transport.wait_log_interval_s=2",
    "transport.connect_timeout_s=30",
    "transport.idle_timeout_s=90",
]


class Cluster:
    """The master, one synthetic producer and a 2-rank synthetic trainer, as real processes."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.ports = (free_port(), free_port(), free_port())
        self.resolved: ResolvedRecipe = loopback_recipe(tmp_path / "job", self.ports, OVERRIDES)
        self.state_dir = tmp_path / "trainer_state"
        self.env = {**os.environ, **loopback_env(self.resolved), "PYTHONPATH": str(REPO)}
        self.master: MasterProcess | None = None
        self.producer: subprocess.Popen[bytes] | None = None
        self.ranks: list[subprocess.Popen[bytes]] = []
        self.launches = 0

    def start_master(self) -> None:
        settings = TransportSettings.from_recipe(self.resolved.recipe).master("127.0.0.1")
        self.master = MasterProcess(settings, self.tmp / "master.log").start()

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 (the child holds it)
        log.write(f"\n===== launch {self.launches} =====\n".encode())
        log.flush()
        self.launches += 1
        cmd = [sys.executable, "-m", "runtime.transport.synthetic", *args, "--recipe", str(self.resolved.path)]
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def start_producer(self) -> None:
        self.producer = self._spawn("producer", ["produce", "--capture-delay-s", "0.03"], self.env)

    def start_trainer(self) -> None:
        port = free_port()
        self.ranks = []
        for rank in range(2):
            env = {
                **self.env,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            args = [
                "train",
                "--state-dir",
                str(self.state_dir),
                "--steps",
                str(STEPS),
                "--checkpoint-every",
                "2",
                "--step-delay-s",
                "0.1",
                "--collective-timeout-s",
                "60",
            ]
            self.ranks.append(self._spawn(f"rank{rank}", args, env))

    def checkpoint(self) -> dict:
        path = self.state_dir / "checkpoint.json"
        return json.loads(path.read_text()) if path.exists() else {"step": 0, "consumed": []}

    def wait_for_step(self, step: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while self.checkpoint()["step"] < step:
            if time.monotonic() > deadline:
                raise AssertionError(f"no checkpoint at step {step} within {timeout_s} s\n{self.logs()}")
            for proc in self.ranks:
                if proc.poll() not in (None, 0):
                    raise AssertionError(f"a trainer rank died with {proc.returncode}\n{self.logs()}")
            time.sleep(0.1)

    def wait_trainer(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.ranks:
            remaining = max(1.0, deadline - time.monotonic())
            try:
                code = proc.wait(remaining)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"trainer did not finish within {timeout_s} s\n{self.logs()}") from None
            assert code == 0, f"trainer rank exited with {code}\n{self.logs()}"

    def kill(self, proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def logs(self, tail: int = 3000) -> str:
        out = []
        for path in sorted(self.tmp.glob("*.log")):
            text = path.read_text(errors="replace")
            lines = [ln for ln in text.splitlines() if ln[:1] not in ("I", "W") or "dspark" in ln]
            out.append(f"--- {path.name} ---\n" + "\n".join(lines)[-tail:])
        return "\n".join(out)

    def stop(self) -> None:
        for proc in [*self.ranks, self.producer]:
            self.kill(proc)
        if self.master is not None:
            self.master.stop()

    def assert_exact_sequence(self) -> None:
        state = self.checkpoint()
        assert state["step"] == STEPS, self.logs()
        assert state["consumed"] == list(range(STEPS * G)), self.logs()


@pytest.fixture
def cluster(tmp_path: Path):
    c = Cluster(tmp_path)
    c.start_master()
    yield c
    c.stop()


@pytest.mark.slow
def test_no_fault_baseline(cluster: Cluster) -> None:
    cluster.start_producer()
    cluster.start_trainer()
    cluster.wait_trainer()
    cluster.assert_exact_sequence()


@pytest.mark.slow
def test_producer_killed_mid_window_and_restarted(cluster: Cluster) -> None:
    cluster.start_producer()
    cluster.start_trainer()
    cluster.wait_for_step(2)
    cluster.kill(cluster.producer)  # its segment, and every sample in it, leaves the store
    step_at_kill = cluster.checkpoint()["step"]
    time.sleep(0.5)
    cluster.start_producer()  # takes the cursor from the trainer (rank 0's control segment) and refills
    cluster.wait_trainer()
    cluster.assert_exact_sequence()
    assert step_at_kill < STEPS  # the trainer still needed samples only the new producer could give
    assert (cluster.tmp / "producer.log").read_text().count("producer ready") == 2


@pytest.mark.slow
def test_trainer_killed_mid_step_restarts_from_its_last_checkpoint(cluster: Cluster) -> None:
    cluster.start_producer()
    cluster.start_trainer()
    cluster.wait_for_step(3)
    time.sleep(0.25)  # somewhere inside a later step
    cluster.kill(cluster.ranks[1])
    cluster.kill(cluster.ranks[0])  # the job's other rank goes down with it, as under srun
    resumed_at = cluster.checkpoint()["step"]
    cluster.start_trainer()  # republishes the checkpoint's cursor; the producer re-captures deleted samples
    cluster.wait_trainer()
    cluster.assert_exact_sequence()
    rank0 = (cluster.tmp / "rank0.log").read_text()
    assert f"rank 0 ready at step {resumed_at} cursor {resumed_at * G}" in rank0


@pytest.mark.slow
def test_master_killed_and_restarted(cluster: Cluster) -> None:
    cluster.start_producer()
    cluster.start_trainer()
    cluster.wait_for_step(2)
    cluster.master.kill()  # the store is empty after this
    time.sleep(1.0)
    cluster.start_master()  # same ports; clients remount, rank 0 republishes the cursor, the producer refills
    cluster.wait_trainer()
    cluster.assert_exact_sequence()
