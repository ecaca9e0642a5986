"""The embedded engine's features against an independent transformers forward."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.capture.embedded_settings import EmbeddedSettings, EngineError, pick_devices
from runtime.capture.engine import CaptureRequest
from runtime.capture.engine_embedded import EmbeddedEngine
from runtime.capture.hidden_states import HiddenStateCapture
from runtime.capture.model_loading import load_hf_decoder
from runtime.capture.sample_meta import sample_tensors
from tests.support.tiny_moe import save_tiny_moe_target, tiny_moe_config

VOCAB, HIDDEN, LAYERS = 300, 64, 4
AUX = (0, 2)
LENGTHS = (37, 5, 64, 1)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Qwen3-MoE checkpoint (random weights are fine for exactness tests)."""
    config = tiny_moe_config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return save_tiny_moe_target(tmp_path_factory.mktemp("target"), config)


def _settings(target: Path, **changes) -> EmbeddedSettings:
    base = EmbeddedSettings(
        target_path=target,
        aux_layer_ids=AUX,
        hidden_size=HIDDEN,
        pad_id=0,
        compute_dtype="float32",
        devices=("cpu",),
        batch_size=4,
        target_revision="test-rev",
    )
    return dataclasses.replace(base, **changes)


def _requests(lengths=LENGTHS, seed: int = 1) -> list[CaptureRequest]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g, length in enumerate(lengths):
        ids = tuple(torch.randint(1, VOCAB, (length,), generator=gen).tolist())
        mask = tuple(int(i >= length // 2) for i in range(length))
        out.append(CaptureRequest(g=100 + g, epoch=1, row_index=g, row_id=f"row-{g}", input_ids=ids, loss_mask=mask))
    return out


@pytest.fixture(scope="module")
def engine(target: Path):
    engine = EmbeddedEngine(_settings(target))
    engine.start()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference(target: Path):
    """An independently loaded CausalLM, capturing the lm_head input (the definition of lhs)."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    seen: dict[str, torch.Tensor] = {}
    model.lm_head.register_forward_pre_hook(lambda module, args: seen.__setitem__("lm_head_input", args[0]))
    return model, seen


def _reference_forward(reference, ids: torch.Tensor, attention: torch.Tensor | None):
    model, seen = reference
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
    hs = torch.cat([out.hidden_states[i + 1] for i in AUX], dim=-1)
    return hs, seen["lm_head_input"]


def test_fp32_features_equal_an_independent_forward_of_the_padded_batch(engine: EmbeddedEngine, reference) -> None:
    requests = _requests()
    features = engine.features(requests)
    ids, attention = engine.replicas[0].pad([r.input_ids for r in requests])
    assert attention is not None and bool((attention == 0).any()), "the batch must actually be padded"
    hs, lhs = _reference_forward(reference, ids, attention)
    for row, (request, feature) in enumerate(zip(requests, features, strict=True)):
        length = len(request.input_ids)
        assert feature.hs.shape == (length, len(AUX) * HIDDEN) and feature.lhs.shape == (length, HIDDEN)
        assert torch.equal(feature.hs, hs[row, :length]), f"hs of row {row} differs"
        assert torch.equal(feature.lhs, lhs[row, :length]), f"lhs of row {row} differs"


def test_padding_and_its_mask_are_decided_on_the_host(engine: EmbeddedEngine) -> None:
    replica = engine.replicas[0]
    ids, mask = replica.pad([(5, 6, 7), (8, 9)])
    assert ids.tolist() == [[5, 6, 7], [8, 9, engine.settings.pad_id]]
    assert mask is not None and mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    ids, mask = replica.pad([(5, 6), (8, 9)])
    assert ids.tolist() == [[5, 6], [8, 9]] and mask is None  # no padding: no mask (the fast causal path)


def test_fp32_features_match_each_sample_forwarded_alone(engine: EmbeddedEngine, reference) -> None:
    # Alone means another GEMM row count, so CPU BLAS may round differently: equal up to fp32 rounding.
    requests = _requests()
    for request, feature in zip(requests, engine.features(requests), strict=True):
        hs, lhs = _reference_forward(reference, torch.tensor([request.input_ids]), None)
        torch.testing.assert_close(feature.hs, hs[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(feature.lhs, lhs[0], rtol=1e-5, atol=1e-5)


def test_layer_ids_are_layer_outputs_and_lhs_is_post_norm(engine: EmbeddedEngine, reference) -> None:
    request = _requests((20,))[0]
    feature = engine.features([request])[0]
    model, _ = reference
    with torch.no_grad():
        out = model(input_ids=torch.tensor([request.input_ids]), output_hidden_states=True)
    # hs block k is decoder layer AUX[k]'s output, not its input ...
    assert torch.equal(feature.hs[:, :HIDDEN], out.hidden_states[AUX[0] + 1][0])
    assert not torch.allclose(feature.hs[:, :HIDDEN], out.hidden_states[AUX[0]][0])
    # ... and lhs went through the final RMSNorm: unit RMS before its weight.
    rms = (feature.lhs / model.model.norm.weight).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-3, atol=1e-3)


def test_samples_in_one_batch_never_mix(engine: EmbeddedEngine) -> None:
    a, b = _requests((30, 18), seed=2)
    c = dataclasses.replace(b, input_ids=tuple((t + 7) % VOCAB for t in b.input_ids))
    with_b = engine.features([a, b])[0]
    with_c = engine.features([a, c])[0]
    # The neighbour changes how many tokens each expert's GEMM sees, hence fp32 rounding (~1e-7), but
    # nothing of its content may reach sample a: a leak through attention or padding would be O(1).
    torch.testing.assert_close(with_b.hs, with_c.hs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(with_b.lhs, with_c.lhs, rtol=1e-5, atol=1e-5)
    changed = engine.features([dataclasses.replace(a, input_ids=(5, *a.input_ids[1:])), b])[0]
    assert (changed.lhs[1:] - with_b.lhs[1:]).abs().max() > 1e-2, "the test must be able to see a change"


def test_contract_tensors_and_meta(engine: EmbeddedEngine, target: Path) -> None:
    committed: list[tuple[int, dict, dict]] = []

    class Recorder:
        def commit(self, g, tensors, meta):
            committed.append((g, dict(tensors), dict(meta)))
            return sum(t.numel() * t.element_size() for t in tensors.values())

    requests = _requests()
    engine.sink = Recorder()
    try:
        refs = engine.capture(requests)
        expected = engine.features(requests)
    finally:
        engine.sink = None
    assert [r.g for r in refs] == [r.g for r in requests] == [c[0] for c in committed]
    for request, (g, tensors, meta), feature, ref in zip(requests, committed, expected, refs, strict=True):
        length = len(request.input_ids)
        assert tensors["ids"].dtype == torch.int64 and tensors["ids"].tolist() == list(request.input_ids)
        assert tensors["mask"].dtype == torch.uint8 and tensors["mask"].tolist() == list(request.loss_mask)
        assert tensors["hs"].dtype == torch.bfloat16 and tensors["hs"].shape == (length, len(AUX) * HIDDEN)
        assert tensors["lhs"].dtype == torch.bfloat16 and tensors["lhs"].shape == (length, HIDDEN)
        assert torch.equal(tensors["hs"], feature.hs.to(torch.bfloat16))
        assert torch.equal(tensors["lhs"], feature.lhs.to(torch.bfloat16))
        assert meta["g"] == g and meta["epoch"] == 1 and meta["row_id"] == request.row_id
        assert meta["row_index"] == request.row_index and meta["num_tokens"] == length
        assert meta["hidden_size"] == HIDDEN and meta["aux_layer_ids"] == list(AUX)
        assert meta["engine"] == "embedded" and meta["target_revision"] == "test-rev"
        assert ref.bytes_written == length * (8 + 1 + 2 * HIDDEN * (len(AUX) + 1))


def test_request_stop_ends_a_capture_between_samples(target: Path) -> None:
    committed: list[int] = []
    engine = EmbeddedEngine(_settings(target), sink=None)

    class StopAfterTwo:
        def commit(self, g, tensors, meta):
            committed.append(g)
            if len(committed) == 2:
                engine.request_stop()  # as the SIGTERM handler does
            return 1

    engine.sink = StopAfterTwo()
    engine.start()
    try:
        refs = engine.capture(_requests())
    finally:
        engine.close()
    assert [r.g for r in refs] == committed == [100, 101]


def test_bf16_forward_on_cpu_is_close_to_fp32(target: Path, engine: EmbeddedEngine) -> None:
    bf16 = EmbeddedEngine(_settings(target, compute_dtype="bfloat16"))
    bf16.start()
    try:
        requests = _requests()
        for low, high in zip(bf16.features(requests), engine.features(requests), strict=True):
            assert low.hs.dtype == torch.bfloat16
            torch.testing.assert_close(low.lhs.float(), high.lhs, rtol=0.1, atol=0.1)
    finally:
        bf16.close()


def test_data_parallel_replicas_split_the_batch(target: Path, engine: EmbeddedEngine) -> None:
    parallel = EmbeddedEngine(_settings(target, devices=("cpu", "cpu"), batch_size=2))
    parallel.start()
    try:
        assert parallel.max_batch == 4 and parallel.replicas[0].base is not parallel.replicas[1].base
        requests = _requests()
        got = parallel.features(requests)
        expected = engine.features(requests[:2]) + engine.features(requests[2:])
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a.hs, b.hs) and torch.equal(a.lhs, b.lhs)
        with pytest.raises(ValueError, match="exceeds 4"):
            parallel.features(_requests((3,) * 5))
    finally:
        parallel.close()


def test_bad_settings_fail_with_the_recipe_field(target: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(target)
    with pytest.raises(ValueError, match=r"capture.aux_layer_ids contains 3.*last one \(3\) is not allowed"):
        HiddenStateCapture(model, [1, LAYERS - 1])
    with pytest.raises(EngineError, match=f"capture.hidden_size is 128.*set capture.hidden_size: {HIDDEN}"):
        EmbeddedEngine(_settings(target, hidden_size=128)).start()
    with pytest.raises(EngineError, match="capture.target_path .* has no config.json"):
        load_hf_decoder(_settings(tmp_path), "cpu")
    with pytest.raises(EngineError, match="capture.expert_parallel is 2"):
        load_hf_decoder(_settings(target, expert_parallel=2), "cpu")
    assert pick_devices("cpu", None) == ["cpu"] and pick_devices("cpu", 3) == ["cpu"] * 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on a machine without a GPU")
def test_cuda_requested_without_a_gpu() -> None:
    with pytest.raises(EngineError, match="capture.device is 'cuda' but no CUDA GPU"):
        pick_devices("cuda", None)


@pytest.mark.gpu
def test_gpu_bf16_capture_matches_a_reference_forward(target: Path) -> None:
    devices = tuple(pick_devices("auto", None))
    assert devices[0].startswith("cuda")
    gpu = EmbeddedEngine(_settings(target, compute_dtype="bfloat16", devices=devices, batch_size=2))
    gpu.start()
    try:
        requests = _requests((37, 5, 64, 1) * len(devices))[: gpu.max_batch]
        features = gpu.features(requests)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).to(devices[0]).eval()
        for index in range(0, len(requests), 2):
            chunk = requests[index : index + 2]
            ids, attention = gpu.replicas[0].pad([r.input_ids for r in chunk])
            with torch.no_grad():
                out = model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
            for row, request in enumerate(chunk):
                length = len(request.input_ids)
                feature = features[index + row]
                assert feature.hs.dtype == torch.bfloat16 and feature.hs.device.type == "cuda"
                expected = torch.cat([out.hidden_states[i + 1][row, :length] for i in AUX], -1)
                torch.testing.assert_close(feature.hs.to(devices[0]), expected, rtol=2e-2, atol=2e-2)
        tensors = sample_tensors(requests[0], features[0])
        assert tensors["hs"].dtype == torch.bfloat16
    finally:
        gpu.close()


def test_pipelined_commits_equal_the_synchronous_ones(target: Path) -> None:
    """The same samples, byte for byte and in the same order, with 2 staging slots as without any;
    ``capture`` returns what finished, ``pending`` names the rest, ``flush`` waits for them."""

    class Recorder:
        def __init__(self) -> None:
            self.committed: list[tuple[int, dict, dict]] = []

        def commit(self, g, tensors, meta):
            self.committed.append((g, {k: v.clone() for k, v in tensors.items()}, dict(meta)))
            return 10 + g

    batches = [_requests(seed=1), [dataclasses.replace(r, g=r.g + 10) for r in _requests((9, 20), seed=2)]]
    recorded = {}
    for slots in (0, 2):
        sink = Recorder()
        engine = EmbeddedEngine(_settings(target, commit_staging_slots=slots), sink)
        engine.start()
        try:
            refs = [ref for batch in batches for ref in engine.capture(batch)]
            assert engine.pending() <= {r.g for batch in batches for r in batch}
            refs += engine.flush()
            assert engine.pending() == set() and engine.flush() == []
        finally:
            engine.close()
        assert [r.g for r in refs] == [r.g for batch in batches for r in batch]
        assert [r.bytes_written for r in refs] == [10 + r.g for r in refs]
        recorded[slots] = sink.committed
    assert [c[0] for c in recorded[0]] == [c[0] for c in recorded[2]]
    for (_, sync_tensors, sync_meta), (_, piped_tensors, piped_meta) in zip(recorded[0], recorded[2], strict=True):
        assert sync_meta == piped_meta
        for name, tensor in sync_tensors.items():
            assert torch.equal(piped_tensors[name], tensor), name


def test_a_failed_pipelined_commit_stops_the_next_capture(target: Path) -> None:
    from runtime.capture.commit_pipeline import CommitError

    class Refuses:
        def commit(self, g, tensors, meta):
            raise OSError(f"store full at g={g}")

    engine = EmbeddedEngine(_settings(target, commit_staging_slots=1), Refuses())
    engine.start()
    try:
        with pytest.raises(CommitError, match="committing sample g=100 failed: store full at g=100"):
            engine.capture(_requests())
            engine.flush()
        with pytest.raises(CommitError, match="g=100"):
            engine.capture(_requests())
    finally:
        engine.close()
