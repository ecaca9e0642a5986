"""Capture through the embedded engine with EP = 2 equals capture with EP = 1 on a tiny MoE target."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
import torch

engine_embedded = pytest.importorskip("runtime.capture.engine_embedded")

from runtime.capture.model_loading import ExpertParallelLoader  # noqa: E402
from runtime.moe.exchange import ExchangeUnavailableError  # noqa: E402
from runtime.moe.exchange_threads import ExchangeTimeoutError  # noqa: E402
from tests.support.tiny_moe import (  # noqa: E402
    save_tiny_moe_target,
    tiny_moe_capture_settings,
    tiny_moe_config,
    tiny_moe_requests,
)

AUX_LAYERS = (0, 1)


@pytest.fixture(scope="module")
def tiny_moe_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_moe_target(tmp_path_factory.mktemp("tiny_moe_target"), tiny_moe_config(num_hidden_layers=3))


def _settings(target: Path, devices: tuple[str, ...], expert_parallel: int) -> engine_embedded.EmbeddedSettings:
    return tiny_moe_capture_settings(target, AUX_LAYERS, devices, expert_parallel)


def test_capture_with_ep2_equals_capture_with_ep1(tiny_moe_target: Path) -> None:
    requests = tiny_moe_requests()
    single = engine_embedded.EmbeddedEngine(_settings(tiny_moe_target, ("cpu",), 1))
    single.start()
    expected = [f for i in range(0, 4, 2) for f in single.features(requests[i : i + 2])]
    single.close()

    settings = _settings(tiny_moe_target, ("cpu", "cpu"), 2)
    loader = ExpertParallelLoader.for_settings(settings)
    sharded = engine_embedded.EmbeddedEngine(settings, model_loader=loader)
    sharded.start()
    got = sharded.features(requests)  # two replicas, two samples each, experts 0-3 / 4-7
    assert [m.experts_per_rank for m in loader.models] == [4, 4] and [m.rank for m in loader.models] == [0, 1]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a.hs, b.hs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.lhs, b.lhs, rtol=1e-5, atol=1e-5)
    sharded.close()


def test_an_idle_replica_takes_part_through_the_idle_step(tiny_moe_target: Path) -> None:
    settings = _settings(tiny_moe_target, ("cpu", "cpu"), 2)
    loader = ExpertParallelLoader(2, 2, rendezvous_timeout_s=60)
    engine = engine_embedded.EmbeddedEngine(settings, model_loader=loader)
    engine.start()
    request = tiny_moe_requests()[0]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        busy = pool.submit(engine.replicas[0].forward, [request.input_ids])
        idle = pool.submit(loader.idle_step, 1, "cpu", torch.float32)
        features = busy.result(timeout=60)[0]
        idle.result(timeout=60)
    reference = engine_embedded.EmbeddedEngine(_settings(tiny_moe_target, ("cpu",), 1))
    reference.start()
    torch.testing.assert_close(features.lhs, reference.features([request])[0].lhs, rtol=1e-5, atol=1e-5)
    reference.close()
    engine.close()


def test_a_replica_that_skips_a_step_fails_clearly_instead_of_hanging(tiny_moe_target: Path) -> None:
    settings = _settings(tiny_moe_target, ("cpu", "cpu"), 2)
    loader = ExpertParallelLoader(2, 2, rendezvous_timeout_s=1.0)
    engine = engine_embedded.EmbeddedEngine(settings, model_loader=loader)
    engine.start()
    with pytest.raises(ExchangeTimeoutError, match="idle step"):
        engine.replicas[0].forward([tiny_moe_requests()[0].input_ids])
    engine.close()


def test_low_latency_backends_are_refused_for_thread_replicas() -> None:
    with pytest.raises(ExchangeUnavailableError, match="--k3-moe-exchange nccl"):
        ExpertParallelLoader(2, 2, exchange_name="deepep")
    with pytest.raises(ValueError, match="must divide the number of capture replicas"):
        ExpertParallelLoader(3, 2)
