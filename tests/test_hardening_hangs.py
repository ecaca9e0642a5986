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
from runtime.transport.errors import TRANSIENT_CODES, IdleTimeoutError, code_name
from runtime.transport.loopback import loopback_master, loopback_recipe
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
        endpoints = Endpoints.loopback(resolved.recipe)
        with (
            open_producer(resolved, endpoints=endpoints),
            open_consumer(resolved, 0, 1, endpoints=endpoints, start_cursor=0) as consumer,
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
