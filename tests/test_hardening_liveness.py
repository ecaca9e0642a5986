"""Issue 15, item 4: liveness messages. A trainer rank logs what it waits for (logging is configured
in the trainer process). The producer's heartbeat lives in trainer rank 0's segment, so it outlives a
hung or dead producer (the producer's own segment stops answering and leaves the store with it), and
the timeout message names the producer, its last heartbeat's age and the likely cause."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from runtime.recipe.loader import ResolvedRecipe
from runtime.shared.contracts import heartbeat_key
from runtime.transport.dataplane import open_consumer, open_producer
from runtime.transport.endpoints import Endpoints
from runtime.transport.errors import IdleTimeoutError, TransportError
from runtime.transport.liveness import Heartbeat
from runtime.transport.loopback import loopback_endpoints, loopback_env, loopback_master, loopback_recipe, transport_of
from runtime.transport.settings import TransportSettings
from runtime.transport.store import StoreClient
from tests.conftest import free_port
from tests.support.trainer_runs import BASE_OVERRIDES, Run, launch, make_inputs

pytestmark = pytest.mark.mooncake

REPO = Path(__file__).resolve().parent.parent
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
FAST_FAILURES = ["transport.client_ttl_s=2", "transport.retry_backoff_s=0.05", "transport.max_retries=2"]


def _spawn(resolved: ResolvedRecipe, log_name: str, args: list[str]) -> subprocess.Popen[bytes]:
    """A synthetic data-plane process (runtime.transport.synthetic) on loopback, logging to the job folder."""
    env = {**os.environ, **loopback_env(resolved), "PYTHONPATH": str(REPO)}
    log = open(resolved.job_dir / log_name, "ab")  # noqa: SIM115 (the child holds it)
    cmd = [sys.executable, "-m", "runtime.transport.synthetic", *args, "--recipe", str(resolved.path)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _stored_beat(client: StoreClient, store_id: str) -> Heartbeat | None:
    """The heartbeat as it is in the store, read with a bare client (not through a Consumer); None
    while it is absent or unreadable (its segment's owner just died, the master restarts)."""
    try:
        raw = client.get_bytes(heartbeat_key(store_id))
    except TransportError:
        return None
    return Heartbeat.decode(raw) if raw is not None else None


def _wait_for(
    what: str, condition: Callable[[], bool], timeout_s: float = 90.0, context: Callable[[], str] = lambda: ""
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:.0f} s; {context()}")
        time.sleep(0.1)


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[tuple[ResolvedRecipe, Endpoints]]:
    resolved = loopback_recipe(
        tmp_path,
        (free_port(), free_port(), free_port()),
        [*ONE_RANK, *FAST_FAILURES, "transport.idle_timeout_s=4", "transport.wait_log_interval_s=1"],
    )
    with loopback_master(resolved):
        yield resolved, loopback_endpoints(resolved)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_stopped_or_killed_producer_process_is_named_with_its_heartbeat_age(
    plane: tuple[ResolvedRecipe, Endpoints], sig: signal.Signals, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the heartbeat lived in the producer's own segment, so a hung producer's heartbeat
    became unreadable and then left the store with the segment (``client_ttl_s``): a rank that had
    not read it before could only say 'no producer heartbeat in the store'."""
    resolved, endpoints = plane
    store_id = resolved.recipe.store_id
    with open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer:
        producer = _spawn(resolved, "producer.log", ["produce", "--max-g", "0"])  # beats, captures nothing
        try:

            def beating_into_rank0() -> bool:
                beat = _stored_beat(consumer.client, store_id)
                if beat is None or beat.pid != producer.pid:
                    return False
                return consumer.client.segment_of(heartbeat_key(store_id)) == consumer.client.hostname

            _wait_for(
                "the producer process never put its heartbeat into trainer rank 0's segment",
                beating_into_rank0,
                context=lambda: (resolved.job_dir / "producer.log").read_text()[-3000:],
            )
            os.kill(producer.pid, sig)
            time.sleep(2.5)  # past client_ttl_s: a killed producer's segment has left the store
            # This rank never read the heartbeat before the producer stopped.
            with caplog.at_level("INFO", logger="dspark.transport.consumer"), pytest.raises(IdleTimeoutError) as err:
                consumer.fetch(0)
        finally:
            if producer.poll() is None:
                os.kill(producer.pid, signal.SIGCONT)
                producer.kill()
            producer.wait(timeout=30)
    message = str(err.value)
    assert f"the producer (pid {producer.pid} on host {socket.gethostname()}) has not beaten for" in message, message
    silence_s = float(re.search(r"has not beaten for ([0-9.]+) s", message).group(1))
    assert silence_s >= 4, message  # at least the 4 s this rank waited, plus the 2.5 s before
    assert "it is hung, stopped (SIGSTOP) or dead; look at the capture log" in message, message
    assert re.search(r"producer heartbeat [0-9.]+ s old", message), message
    waits = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert waits and "has not beaten for" in waits[-1], waits


@pytest.mark.slow
def test_a_live_producer_is_named_with_what_it_does(plane: tuple[ResolvedRecipe, Endpoints]) -> None:
    resolved, endpoints = plane
    with (
        open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer,
        open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints) as producer,
    ):
        producer.refresh()  # takes the cursor (and rank 0's segment) the trainer published
        producer.heartbeat()
        with pytest.raises(IdleTimeoutError) as err:
            consumer.fetch(100)  # far beyond the window [0, 8)
    message = str(err.value)
    assert f"the producer (pid {os.getpid()} on host {socket.gethostname()}) is alive (last heartbeat" in message
    assert "but has not committed g=100: g=100 is beyond its window [0, 8)" in message, message


@pytest.mark.slow
def test_a_closed_producer_and_a_lost_heartbeat_are_named(plane: tuple[ResolvedRecipe, Endpoints]) -> None:
    resolved, endpoints = plane
    with open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer:
        with open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints) as producer:
            producer.heartbeat()
            beat = consumer.read_heartbeat()
            assert beat is not None, "the consumer saw the producer alive once"
        # a clean shutdown leaves a last beat that says so, in rank 0's segment
        with pytest.raises(IdleTimeoutError) as err:
            consumer.fetch(0)
        closed = str(err.value)
        # the store lost the heartbeat (a master restart empties it): what this rank saw last is the evidence
        consumer.client.remove([heartbeat_key(resolved.recipe.store_id)])
        with pytest.raises(IdleTimeoutError) as err:
            consumer.fetch(0)
        vanished = str(err.value)
    assert f"the producer (pid {beat.pid} on host {beat.host}) shut down" in closed, closed
    assert "its last heartbeat says it closed" in closed and "CLOSED" in closed
    assert "heartbeat vanished from the store" in vanished, vanished
    assert f"producer pid {beat.pid} on {beat.host}" in vanished and " s old" in vanished
    assert "mooncake_master most likely restarted" in vanished


@pytest.mark.slow
def test_the_producer_keeps_beating_through_rank0_and_master_restarts(tmp_path: Path) -> None:
    """Rank 0 killed (its segment dead, then gone), a new rank 0 (a new segment), the master restarted
    (the store empty): the producer's heartbeat thread survives all three and follows rank 0."""
    resolved = loopback_recipe(
        tmp_path,
        (free_port(), free_port(), free_port()),
        [*ONE_RANK, *FAST_FAILURES, "transport.idle_timeout_s=120"],
    )
    store_id = resolved.recipe.store_id
    key = heartbeat_key(store_id)
    with loopback_master(resolved) as master:
        endpoints = loopback_endpoints(resolved)
        settings = TransportSettings.from_recipe(resolved.recipe).client(endpoints, 0)
        with (
            StoreClient(settings, name="reader").connect() as reader,
            open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints, start_cursor=None) as producer,
        ):

            def beats_on(what: str, segment: str | None = None) -> None:
                """The sequence advances (and, if given, the heartbeat is in ``segment``)."""
                first = _stored_beat(reader, store_id)

                def advanced() -> bool:
                    with contextlib.suppress(TransportError):
                        producer.refresh()  # what the capture loop does between batches
                    beat = _stored_beat(reader, store_id)
                    moved = beat is not None and (first is None or beat.sequence > first.sequence + 1)
                    return moved and (segment is None or reader.segment_of(key) == segment)

                _wait_for(f"no heartbeat {what}", advanced, timeout_s=60)
                assert producer.heartbeat_writer.thread is not None and producer.heartbeat_writer.thread.is_alive()

            rank0 = _spawn(resolved, "rank0.log", ["train", "--state-dir", str(tmp_path / "state"), "--steps", "1"])
            try:

                def rank0_known() -> bool:
                    with contextlib.suppress(TransportError):
                        producer.refresh()  # reads the cursor, which names rank 0's segment
                    return bool(producer.heartbeat_writer.rank0_segment)

                _wait_for(
                    "rank 0 never published its segment in the cursor",
                    rank0_known,
                    context=lambda: (resolved.job_dir / "rank0.log").read_text()[-3000:],
                )
                segment_of_rank0 = producer.heartbeat_writer.rank0_segment
                assert segment_of_rank0
                beats_on("in the first rank 0's segment", segment_of_rank0)
                rank0.kill()
            finally:
                rank0.kill()
                rank0.wait(timeout=30)
            beats_on("after rank 0 was killed")

            def rank0_forgotten() -> bool:
                with contextlib.suppress(TransportError):
                    producer.refresh()
                return producer.heartbeat_writer.rank0_segment == ""

            # its cursor went with its segment: beats stop aiming at the gone segment (no warning per beat)
            _wait_for("the producer kept aiming at the dead rank 0's segment", rank0_forgotten, timeout_s=60)
            with open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer:
                beats_on("in the new rank 0's segment", consumer.client.hostname)
                master.stop()
                master.start()
                consumer.publish_cursor(0)  # a waiting rank 0 republishes a missing cursor by itself
                beats_on("after the master restarted", consumer.client.hostname)


@pytest.mark.slow
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
