"""The capture component against a real mooncake_master on loopback: window fill, refill after the
cursor moves, clean stop on SIGTERM, the run's end. No mocks: real engine, real producer, real store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.capture.engine_embedded import EmbeddedEngine
from runtime.capture.producer import CaptureLoop, CaptureSource
from runtime.capture.setup import data_setup, embedded_settings
from runtime.recipe.loader import ResolvedRecipe
from runtime.shared.contracts import META_FIELD, sample_key
from runtime.shared.data_files import sha256_file, write_manifest, write_rows
from runtime.shared.prompt_order import PromptOrder
from runtime.transport.dataplane import open_consumer, open_producer
from runtime.transport.loopback import (
    free_port,
    loopback_endpoints,
    loopback_env,
    loopback_master,
    loopback_recipe,
    transport_of,
)
from runtime.transport.master import port_in_use
from runtime.transport.sample_format import sample_keys
from tests.conftest import REPO_ROOT
from tests.support.tiny_moe import save_tiny_moe_target, tiny_moe_config

pytestmark = pytest.mark.mooncake

NUM_ROWS = 40
FAST = [
    "transport.poll_interval_s=0.05",
    "transport.retry_backoff_s=0.05",
    "transport.heartbeat_interval_s=0.5",
    "transport.wait_log_interval_s=5",
    "transport.connect_timeout_s=60",
    "transport.idle_timeout_s=60",
    "capture.progress_interval_s=1",
    "capture.batch_size=4",
]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3-MoE with the tiny recipe's shape (hidden 256, 8 layers, vocab 2048), small experts."""
    config = tiny_moe_config(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=8,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return save_tiny_moe_target(tmp_path_factory.mktemp("target"), config)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gen = torch.Generator().manual_seed(4)
    rows = []
    for index in range(NUM_ROWS):
        length = int(torch.randint(10, 60, (1,), generator=gen))
        ids = torch.randint(4, 2048, (length,), generator=gen).tolist()
        rows.append({"id": f"row-{index}", "input_ids": ids, "loss_mask": [0] * 5 + [1] * (length - 5)})
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    write_rows(path, rows)
    write_manifest(path, {"sha256": sha256_file(path), "rows": NUM_ROWS})
    return path


def _resolve(tmp_path: Path, target: Path, data_file: Path, extra: list[str] | None = None) -> ResolvedRecipe:
    ports = (free_port(), free_port(), free_port())
    return loopback_recipe(
        tmp_path / "job",
        ports,
        [
            *FAST,
            f"capture.target_path={target}",
            f"data.train_path={data_file}",
            f"data.num_rows={NUM_ROWS}",
            "data.expected_sha256=manifest",
            f"transport.store_id=capture-{tmp_path.name}",
            *(extra or []),
        ],
    )


def _present(client, store_id: str, gs: range) -> list[bool]:
    return client.exist([sample_key(store_id, g, META_FIELD) for g in gs])


def _wait_until(condition, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the capture process exited ({proc.returncode}) while waiting for {what}")
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.mark.slow
def test_producer_fills_the_window_and_refills_after_the_cursor_moves(
    tmp_path: Path, target: Path, data_file: Path
) -> None:
    resolved = _resolve(tmp_path, target, data_file)
    recipe = resolved.recipe
    high = recipe.transport.high_watermark_samples
    store_id = recipe.store_id
    log_path = tmp_path / "capture.log"
    env = {**os.environ, **loopback_env(resolved), "PYTHONPATH": str(REPO_ROOT)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.capture", "--recipe", str(resolved.path)],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    consumer = None
    try:
        _wait_until(lambda: port_in_use("127.0.0.1", recipe.transport.master_rpc_port), 60, "the master", proc)
        consumer = open_consumer(
            transport_of(resolved), 0, recipe.trainer_world_size, endpoints=loopback_endpoints(resolved)
        )
        _wait_until(lambda: all(_present(consumer.client, store_id, range(high))), 180, f"samples 0..{high - 1}", proc)
        time.sleep(1.0)
        assert not any(_present(consumer.client, store_id, range(high, high + 8))), (
            "the window must stop at the high watermark"
        )

        # The samples are the prompt order's rows, and their features are the target's.
        order = PromptOrder(NUM_ROWS, recipe.trainer.effective_prompt_seed, recipe.trainer.epochs)
        rows = [line for line in data_file.read_text().splitlines()]
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        for g in (0, 5, high - 1):
            sample = consumer.fetch(g)
            slot = order.locate(g)
            assert sample.meta["row_index"] == slot.row_index and sample.meta["epoch"] == slot.epoch
            assert f'"id":"{sample.meta["row_id"]}"' in rows[slot.row_index]
            with torch.no_grad():
                out = model(input_ids=sample.ids[None], output_hidden_states=True)
            expected_hs = torch.cat([out.hidden_states[i + 1][0] for i in recipe.capture.aux_layer_ids], -1)
            torch.testing.assert_close(sample.hs.float(), expected_hs.to(torch.bfloat16).float(), rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(
                sample.lhs.float(), out.hidden_states[-1][0].to(torch.bfloat16).float(), rtol=2e-2, atol=2e-2
            )
            assert sample.hs.dtype == torch.bfloat16 and sample.mask.dtype == torch.uint8

        # The heartbeat is written every heartbeat_interval_s: under load it may trail the store by a sample.
        def heartbeat_counts_the_window() -> bool:
            heartbeat = consumer.read_heartbeat()
            return heartbeat is not None and heartbeat.stats["capture"]["captured_samples"] >= high

        _wait_until(heartbeat_counts_the_window, 60, f"a heartbeat that counts {high} captured samples", proc)

        # The trainer consumed three global steps: resident samples fall below the low watermark (16),
        # so the producer resumes, drops the consumed ones and captures the next ones.
        cursor = 3 * recipe.trainer.global_batch_size
        consumer.publish_cursor(cursor)
        _wait_until(
            lambda: all(_present(consumer.client, store_id, range(cursor, cursor + high))),
            180,
            f"samples {cursor}..{cursor + high - 1} after the cursor moved to {cursor}",
            proc,
        )
        _wait_until(
            lambda: not any(_present(consumer.client, store_id, range(cursor))), 30, "consumed samples removed", proc
        )

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if consumer is not None:
            consumer.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text(errors="replace")
    assert "received SIGTERM" in text and "capture stopped" in text, text[-3000:]
    assert "samples/s" in text and "tokens/s" in text and "ETA" in text
    assert not port_in_use("127.0.0.1", recipe.transport.master_rpc_port), "the owned master stops with the capture"


def _loop(resolved: ResolvedRecipe, producer, stop_after: int | None = None) -> tuple[CaptureLoop, list[int]]:
    committed: list[int] = []
    stop = threading.Event()
    engine = EmbeddedEngine(embedded_settings(resolved))

    class CountingSink:
        """The producer itself; the count stands in for a SIGTERM arriving mid-batch."""

        def commit(self, g, tensors, meta):
            written = producer.commit(g, tensors, meta)
            committed.append(g)
            if stop_after is not None and len(committed) == stop_after:
                stop.set()
                engine.request_stop()
            return written

    engine.sink = CountingSink()
    engine.start()
    loop = CaptureLoop(producer, engine, CaptureSource.open(data_setup(resolved)), engine.max_batch, 1.0, stop)
    return loop, committed


def test_stop_mid_batch_leaves_no_half_written_sample(tmp_path: Path, target: Path, data_file: Path) -> None:
    resolved = _resolve(tmp_path, target, data_file)
    store_id = resolved.recipe.store_id
    with loopback_master(resolved):
        producer = open_producer(transport_of(resolved), resolved.job_dir, endpoints=loopback_endpoints(resolved))
        try:
            loop, committed = _loop(resolved, producer, stop_after=6)
            assert loop.run() == "stopped"
            loop.engine.close()
            assert committed == [0, 1, 2, 3, 4, 5]
            assert not producer.window.in_flight, "claimed but uncaptured samples are given back"
            for g in range(24):
                flags = producer.client.exist(sample_keys(store_id, g))
                assert all(flags) if g < 6 else not any(flags), f"sample {g}: {flags}"
        finally:
            producer.close()


@pytest.mark.slow
def test_the_loop_ends_when_the_cursor_passes_the_last_sample(tmp_path: Path, target: Path, data_file: Path) -> None:
    # max_steps 2 x G 8: the run has 16 samples, fewer than the window (32) could hold.
    resolved = _resolve(tmp_path, target, data_file, ["trainer.max_steps=2"])
    store_id = resolved.recipe.store_id
    with loopback_master(resolved):
        producer = open_producer(transport_of(resolved), resolved.job_dir, endpoints=loopback_endpoints(resolved))
        try:
            loop, committed = _loop(resolved, producer)
            result: list[str] = []
            thread = threading.Thread(target=lambda: result.append(loop.run()))
            thread.start()
            _wait_until(lambda: len(committed) >= 16, 120, "the run's 16 samples")
            time.sleep(1.0)
            assert sorted(committed) == list(range(16)), "nothing past the run's last sample is captured"
            assert not any(producer.client.exist([sample_key(store_id, g, META_FIELD) for g in range(16, 32)]))
            consumer = open_consumer(
                transport_of(resolved), 0, resolved.recipe.trainer_world_size, endpoints=loopback_endpoints(resolved)
            )
            consumer.publish_cursor(16)
            thread.join(timeout=30)
            consumer.close()
            assert result == ["finished"]
            loop.engine.close()
        finally:
            producer.close()


WAKE_SCRIPT = """
import os, signal, sys, threading, time
from runtime.capture.producer import stop_on_signals, wait_for_stop

stop = threading.Event()
# A thread started before the main thread blocks SIGTERM keeps it unblocked, as CUDA's and Mooncake's
# threads do: the kernel hands the process's SIGTERM to it, not to the main thread.
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
with stop_on_signals(stop, lambda: None):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    started = time.monotonic()
    if sys.argv[1] == "bare":
        stop.wait(3.0)
    else:
        wait_for_stop(stop)
    print(f"{stop.is_set()} {time.monotonic() - started:.2f}")
"""


@pytest.mark.parametrize("how", ["bare", "polled"])
def test_the_finished_capture_sees_a_sigterm_that_another_thread_received(how: str) -> None:
    """The capture's last wait (every sample consumed, the master kept up until the supervisor's
    SIGTERM) wakes for a signal the kernel delivered to another thread; a bare Event.wait() does not,
    which on a GPU left the capture to the supervisor's SIGKILL 30 s later."""
    done = subprocess.run(
        [sys.executable, "-c", WAKE_SCRIPT, how], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    woke, seconds = done.stdout.split()
    if how == "bare":  # the premise: the signal reached the process (the handler ran once the wait timed
        # out), but it did not wake the waiting main thread
        assert woke == "True" and float(seconds) >= 2.9, done.stdout
    else:
        assert woke == "True" and float(seconds) < 2.0, done.stdout
