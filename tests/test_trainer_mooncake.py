"""The trainer on the real data plane: a mooncake_master on loopback, the transport's synthetic
producer process, and two ``python3 -m runtime.trainer`` ranks over gloo reading through Mooncake
(the default sample source); then a restart that resumes from its checkpoint and republishes the
cursor while the producer keeps running."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.transport.loopback import loopback_env, loopback_recipe
from runtime.transport.master import MasterProcess
from runtime.transport.settings import TransportSettings
from tests.support.trainer_runs import BASE_OVERRIDES, REPO_ROOT, Run, launch, make_inputs

pytestmark = [pytest.mark.mooncake, pytest.mark.distributed]

TRANSPORT = [
    "transport.poll_interval_s=0.05",
    "transport.heartbeat_interval_s=0.5",
    "transport.wait_log_interval_s=5",
    "transport.connect_timeout_s=30",
    "transport.idle_timeout_s=120",
]


@pytest.mark.slow
def test_trainer_reads_samples_through_mooncake_and_resumes(tmp_path: Path, port_factory) -> None:
    target, _ = make_inputs(tmp_path / "inputs", count=0)
    ports = (port_factory(), port_factory(), port_factory())
    checkpoints = tmp_path / "checkpoints"
    shapes = [o for o in BASE_OVERRIDES if not o.startswith("trainer.sample_source")]
    common = [
        *shapes,
        *TRANSPORT,
        f"capture.target_path={target}",
        "job.trainer.tasks_per_node=2",
        "trainer.gradient_accumulation_steps=2",
        "trainer.global_batch_size=4",
        "transport.high_watermark_samples=8",
        "transport.low_watermark_samples=4",
        f"trainer.checkpoint.dir={checkpoints}",
        "trainer.checkpoint.every_steps=2",
    ]
    first = loopback_recipe(tmp_path / "first", ports, [*common, "trainer.max_steps=2"])
    env = loopback_env(first)
    master = MasterProcess(
        TransportSettings.from_recipe(first.recipe).master("127.0.0.1"), tmp_path / "master.log"
    ).start()
    producer_log = open(tmp_path / "producer.log", "wb")  # noqa: SIM115 (the child holds it)
    producer = subprocess.Popen(
        [sys.executable, "-m", "runtime.transport.synthetic", "produce", "--recipe", str(first.path)],
        cwd=REPO_ROOT,
        env={**os.environ, **env, "PYTHONPATH": str(REPO_ROOT)},
        stdout=producer_log,
        stderr=subprocess.STDOUT,
    )
    try:
        run = Run(first.job_dir, first.path, checkpoints, 2)
        result = launch(run, port_factory(), env_extra=env)
        assert result.ok, result.text() + (tmp_path / "producer.log").read_text()[-3000:]
        assert [m["step"] for m in run.metrics()] == [1, 2]
        assert run.state(2)["cursor"] == 8

        second = loopback_recipe(
            tmp_path / "second", ports, [*common, "trainer.max_steps=4", "trainer.checkpoint.resume_from=auto"]
        )
        run2 = Run(second.job_dir, second.path, checkpoints, 2)
        result = launch(run2, port_factory(), env_extra=env)
        assert result.ok, result.text() + (tmp_path / "producer.log").read_text()[-3000:]
        assert "resume (resume_from auto" in result.logs[0]
        metrics = run2.metrics()
        assert [m["step"] for m in metrics] == [3, 4] and [m["cursor"] for m in metrics] == [12, 16]
        assert all(m["tokens"] > 0 and m["loss"] == m["loss"] for m in metrics)
        assert run2.state(4)["cursor"] == 16
    finally:
        producer.kill()
        producer.wait()
        producer_log.close()
        master.stop()
