"""Issue 15, item 3: no silent hangs. A stopped (SIGSTOP) mooncake_master must not hold a waiting
trainer rank past ``transport.idle_timeout_s``; Mooncake's -901 has a name; a store call that does
not return is abandoned at its deadline without piling up threads."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from runtime.transport.dataplane import open_consumer, open_producer
from runtime.transport.deadline import DeadlineCaller, StoreUnresponsiveError
from runtime.transport.endpoints import Endpoints
from runtime.transport.errors import OBJECT_NOT_FOUND, TRANSIENT_CODES, IdleTimeoutError, TransportError, code_name
from runtime.transport.loopback import loopback_endpoints, loopback_master, loopback_recipe, transport_of
from runtime.transport.settings import ClientSettings
from runtime.transport.store import StoreClient
from tests.conftest import free_port

IDLE_TIMEOUT_S = 8
SLACK_S = 6.0
"""Heartbeat and cursor reads for the message are bounded at 2 s each, plus scheduling."""


def test_rpc_timeout_has_a_name_and_is_retried() -> None:
    assert code_name(-901) == "RPC_TIMEOUT (-901)"
    assert -901 in TRANSIENT_CODES


def test_deadline_caller_gives_up_and_does_not_pile_up_threads() -> None:
    caller = DeadlineCaller("test")
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(StoreUnresponsiveError, match="has not answered 'stuck call'"):
        caller.call(release.wait, 0.3, "stuck call")
    assert time.monotonic() - started < 2.0
    before = threading.active_count()
    for _ in range(5):  # the stuck call is waited for, not joined by new ones
        with pytest.raises(StoreUnresponsiveError):
            caller.call(lambda: 1, 0.05, "next call")
    assert threading.active_count() == before
    release.set()
    assert caller.call(lambda: 42, 1.0, "after") == 42
    with pytest.raises(KeyError):
        caller.call(lambda: {}["missing"], 1.0, "raises")


class _BlockingNativeStore:
    """Stands in for Mooncake's native client at its boundary: ``get_size`` blocks until released,
    and ``close`` records when it ran (Mooncake frees the client there)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.closed_while_in_call = False
        self.in_call = False
        self.closes = 0

    def get_size(self, key: str) -> int:
        self.in_call = True
        self.entered.set()
        self.release.wait(10)
        self.in_call = False
        return OBJECT_NOT_FOUND

    def close(self) -> None:
        self.closed_while_in_call |= self.in_call
        self.closes += 1


def test_closing_a_client_with_a_call_in_flight_closes_it_after_the_call() -> None:
    """CI crashed (segfault) when a consumer's close ran beside a heartbeat read stuck on a stopped
    master: the close must wait for the call, and a call after the close must be refused."""
    endpoints = Endpoints("127.0.0.1:1", "http://127.0.0.1:2/metadata", "127.0.0.1")  # never dialled
    client = StoreClient(ClientSettings(endpoints=endpoints, max_retries=0), name="test client")
    native = _BlockingNativeStore()
    client._store = native
    reader = threading.Thread(target=lambda: client.get_bytes("heartbeat"), daemon=True)
    reader.start()
    assert native.entered.wait(5)
    client.close()  # returns at once: the read is still in flight
    assert native.closes == 0
    with pytest.raises(TransportError, match="after close"):
        client.get_bytes("cursor")
    native.release.set()
    reader.join(5)
    assert not reader.is_alive()
    assert native.closes == 1 and not native.closed_while_in_call
    client.close()  # a second close is a no-op
    assert native.closes == 1


@pytest.mark.slow
@pytest.mark.mooncake
def test_stopped_master_fails_the_wait_within_idle_timeout(tmp_path: Path) -> None:
    ports = (free_port(), free_port(), free_port())
    resolved = loopback_recipe(
        tmp_path,
        ports,
        [
            "job.trainer.tasks_per_node=1",
            "trainer.gradient_accumulation_steps=4",
            "trainer.global_batch_size=4",
            "transport.high_watermark_samples=8",
            "transport.low_watermark_samples=4",
            f"transport.idle_timeout_s={IDLE_TIMEOUT_S}",
            "transport.poll_interval_s=0.05",
            "transport.wait_log_interval_s=2",
            "transport.connect_timeout_s=20",
        ],
    )
    with loopback_master(resolved) as master:
        endpoints = loopback_endpoints(resolved)
        with (
            open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints),
            open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer,
        ):
            os.kill(master.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(IdleTimeoutError) as err:
                    consumer.fetch(0)
                took = time.monotonic() - started
            finally:
                os.kill(master.pid, signal.SIGCONT)
    print(f"stopped master: the wait failed after {took:.1f} s (idle_timeout_s {IDLE_TIMEOUT_S})")
    assert took < IDLE_TIMEOUT_S + SLACK_S, f"waited {took:.0f} s"
    message = str(err.value)
    assert "has not answered" in message and "mooncake_master stopped, overloaded or unreachable" in message


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stopped_trainer_rank_is_named_and_the_others_stop_within_idle_timeout(tmp_path: Path) -> None:
    """Before: the other ranks sat in the gradient all-reduce for idle_timeout + 600 s without a line."""
    from runtime.trainer.peer_watch import BEAT_INTERVAL_S, EXIT_PEER_LOST
    from tests.support.trainer_runs import make_inputs, make_run, start, wait_all

    idle_timeout_s = 20
    target, samples = make_inputs(tmp_path)
    run = make_run(
        tmp_path,
        "stopped-rank",
        world_size=2,
        target=target,
        samples=samples,
        overrides=[
            f"transport.idle_timeout_s={idle_timeout_s}",
            "trainer.global_batch_size=4",
            "trainer.epochs=1000",
            "trainer.log_every_steps=1",
        ],
    )
    ranks = start(run, free_port())
    try:
        deadline = time.monotonic() + 240
        while not run.metrics() and time.monotonic() < deadline and all(r.poll() is None for r in ranks):
            time.sleep(0.2)
        assert run.metrics(), "the run never finished a step"
        os.kill(ranks[1].pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        ranks[0].wait(timeout=idle_timeout_s + 60)
        waited_s = time.monotonic() - stopped_at
    finally:
        os.kill(ranks[1].pid, signal.SIGCONT)
        ranks[1].kill()
    done = wait_all(ranks, timeout_s=30)
    assert done.codes[0] == EXIT_PEER_LOST, done.text()[-4000:]
    # Silence counts from the last beat rank 0 saw, which came up to one beat interval (plus the
    # watcher's own sleep) before the SIGSTOP: rank 0 may give up that much before idle_timeout_s.
    assert idle_timeout_s - 2 * BEAT_INTERVAL_S <= waited_s < idle_timeout_s + 30, waited_s
    log = done.logs[0]
    assert "rank 1 silent for" in log, log[-3000:]  # named while it waits
    assert "rank 1 has been silent for" in log and "transport.idle_timeout_s" in log, log[-3000:]
