"""Issue 15, item 4: liveness messages. A trainer rank logs what it waits for (logging is configured
in the trainer process), and when the producer's heartbeat vanishes with its segment the message
names the producer, its last heartbeat age and the likely cause."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from runtime.transport.dataplane import open_consumer, open_producer
from runtime.transport.endpoints import Endpoints
from runtime.transport.errors import IdleTimeoutError
from runtime.transport.loopback import loopback_env, loopback_master, loopback_recipe
from tests.conftest import free_port
from tests.support.trainer_runs import BASE_OVERRIDES, Run, launch, make_inputs

pytestmark = pytest.mark.mooncake

ONE_RANK = [
    "job.trainer.tasks_per_node=1",
    "trainer.gradient_accumulation_steps=4",
    "trainer.global_batch_size=4",
    "transport.high_watermark_samples=8",
    "transport.low_watermark_samples=4",
    "transport.poll_interval_s=0.05",
    "transport.heartbeat_interval_s=0.5",
    "transport.connect_timeout_s=20",
]


def test_vanished_heartbeat_names_the_producer_and_its_age(tmp_path: Path) -> None:
    ports = (free_port(), free_port(), free_port())
    resolved = loopback_recipe(
        tmp_path, ports, [*ONE_RANK, "transport.idle_timeout_s=6", "transport.wait_log_interval_s=1"]
    )
    with loopback_master(resolved):
        endpoints = Endpoints.loopback(resolved.recipe)
        with open_consumer(resolved, 0, 1, endpoints=endpoints, start_cursor=0) as consumer:
            with open_producer(resolved, endpoints=endpoints) as producer:
                producer.heartbeat()
                beat = consumer.read_heartbeat()
                assert beat is not None, "the consumer saw the producer alive once"
            # the producer is gone: its segment (and the heartbeat in it) went with it
            deadline = time.monotonic() + 30
            while consumer.read_heartbeat() is not None and time.monotonic() < deadline:
                time.sleep(0.2)
            with pytest.raises(IdleTimeoutError) as err:
                consumer.fetch(0)
    message = str(err.value)
    assert "heartbeat vanished from the store" in message, message
    assert f"producer pid {beat.pid} on {beat.host}" in message and " s old" in message
    assert "most likely hung or died" in message


@pytest.mark.distributed
def test_trainer_process_logs_what_it_waits_for(tmp_path: Path, port_factory) -> None:
    target, _ = make_inputs(tmp_path / "inputs", count=0)
    ports = (port_factory(), port_factory(), port_factory())
    shapes = [o for o in BASE_OVERRIDES if not o.startswith("trainer.sample_source")]
    resolved = loopback_recipe(
        tmp_path / "job",
        ports,
        [
            *shapes,
            *ONE_RANK,
            f"capture.target_path={target}",
            "transport.idle_timeout_s=6",
            "transport.wait_log_interval_s=1",
            "trainer.max_steps=1",
        ],
    )
    with loopback_master(resolved):  # no producer: rank 0 waits for g=0 and must say so
        result = launch(
            Run(resolved.job_dir, resolved.path, tmp_path / "ckpt", 1),
            port_factory(),
            env_extra=loopback_env(resolved),
            timeout_s=180,
        )
    log = result.logs[0]
    assert not result.ok
    assert "[rank 0 dspark.transport.consumer] rank 0 waiting" in log and "for sample g=0" in log, log[-3000:]
    assert "transport.idle_timeout_s" in log
