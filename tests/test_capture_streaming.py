"""The embedded engine with routed experts streamed from host memory (capture.expert_streaming):
captures are byte-identical to the same engine with every expert resident, with and without
expert parallelism, and a budget that cannot hold the streaming buffers is refused at start."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

engine_embedded = pytest.importorskip("runtime.capture.engine_embedded")

from runtime.capture.embedded_settings import StreamedExperts  # noqa: E402
from runtime.capture.engine import CaptureRequest  # noqa: E402
from runtime.capture.model_loading import ExpertParallelLoader  # noqa: E402
from tests.support.tiny_moe import (  # noqa: E402
    save_tiny_moe_target,
    tiny_moe_capture_settings,
    tiny_moe_config,
    tiny_moe_requests,
)

AUX_LAYERS = (0, 2)


@pytest.fixture(scope="module")
def moe_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_moe_target(tmp_path_factory.mktemp("moe_target"), tiny_moe_config(num_hidden_layers=4))


def _settings(target: Path, devices: tuple[str, ...], expert_parallel: int, streaming=None):
    return tiny_moe_capture_settings(target, AUX_LAYERS, devices, expert_parallel, expert_streaming=streaming)


def _features(settings, loader=None) -> tuple[list, list]:
    engine = engine_embedded.EmbeddedEngine(settings, model_loader=loader)
    engine.start()
    try:
        requests = tiny_moe_requests()
        per_call = engine.max_batch
        features = [f for i in range(0, len(requests), per_call) for f in engine.features(requests[i : i + per_call])]
        return features, engine.expert_stores
    finally:
        engine.close()


MOST_ON_HOST = StreamedExperts(resident_fraction=0.25)


@pytest.mark.parametrize("expert_parallel", [1, 2])
def test_streamed_capture_is_byte_identical_to_resident(moe_target: Path, expert_parallel: int) -> None:
    devices = ("cpu",) * expert_parallel
    plain = _settings(moe_target, devices, expert_parallel)
    streamed = _settings(moe_target, devices, expert_parallel, MOST_ON_HOST)
    loaders = (None, None)
    if expert_parallel > 1:
        loaders = (ExpertParallelLoader.for_settings(plain), ExpertParallelLoader.for_settings(streamed))
    expected, no_stores = _features(plain, loaders[0])
    got, stores = _features(streamed, loaders[1])
    assert no_stores == [] and len(stores) == expert_parallel
    for store in stores:
        assert (store.split.resident_layers, store.split.streamed_layers) == (1, 3)
        assert store.stats.copies >= 3 and store.stats.acquires >= 4
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a.hs, b.hs) and torch.equal(a.lhs, b.lhs)


def test_a_budget_too_small_for_the_buffers_fails_the_engine_start(moe_target: Path) -> None:
    streaming = StreamedExperts(gpu_budget_bytes=1000)
    engine = engine_embedded.EmbeddedEngine(_settings(moe_target, ("cpu",), 1, streaming))
    with pytest.raises(engine_embedded.EngineError, match="gpu_budget_bytes is 0.00 GB per GPU, below the 2"):
        engine.start()


@pytest.mark.gpu
def test_cuda_capture_with_streamed_experts_is_byte_identical(moe_target: Path) -> None:
    streaming = StreamedExperts(resident_fraction=0.25, prefetch_layers=2)
    plain = dataclasses.replace(_settings(moe_target, ("cuda:0",), 1), compute_dtype="bfloat16")
    expected, _ = _features(plain)
    got, stores = _features(dataclasses.replace(plain, expert_streaming=streaming))
    (store,) = stores
    assert store.pinned and store.split.num_buffers == 3 and store.stats.misses == 1
    for a, b in zip(got, expected, strict=True):
        assert a.hs.is_cuda and torch.equal(a.hs, b.hs) and torch.equal(a.lhs, b.lhs)


def test_tiny_target_captures_are_byte_identical_with_most_experts_streamed(tiny_assets: Path) -> None:
    from runtime.recipe import load_recipe

    c = load_recipe(Path(__file__).resolve().parent.parent / "recipes" / "tiny.yaml").recipe.capture
    plain = engine_embedded.EmbeddedSettings(
        target_path=tiny_assets / "target",
        aux_layer_ids=tuple(c.aux_layer_ids),
        hidden_size=c.hidden_size,
        pad_id=c.special_tokens.pad_id,
        compute_dtype=c.compute_dtype,
        devices=("cpu",),
        batch_size=1,
    )
    rows = [json.loads(line) for line in (tiny_assets / "data" / "train.jsonl").read_text().splitlines()[:3]]
    requests = [
        CaptureRequest(
            g=g, epoch=0, row_index=g, row_id=str(g), input_ids=tuple(r["input_ids"]), loss_mask=tuple(r["loss_mask"])
        )
        for g, r in enumerate(rows)
    ]
    outputs = []
    for streaming in (None, MOST_ON_HOST):
        engine = engine_embedded.EmbeddedEngine(dataclasses.replace(plain, expert_streaming=streaming))
        engine.start()
        outputs.append([engine.features([r])[0] for r in requests])
        if streaming is not None:
            (store,) = engine.expert_stores
            assert (store.split.resident_layers, store.split.streamed_layers) == (2, 6)
        engine.close()
    for a, b in zip(*outputs, strict=True):
        assert torch.equal(a.hs, b.hs) and torch.equal(a.lhs, b.lhs)
