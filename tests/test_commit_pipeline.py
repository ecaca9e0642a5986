"""The pipelined commit path: ``sum16`` checksums, the bounded staging pipeline, its failure rules."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from runtime.capture.commit_pipeline import CommitError, CommitPipeline, staging_layout
from runtime.transport.checksum import CHUNK_WORDS, SUM16_CHUNK_BYTES, sum16_values
from runtime.transport.errors import CorruptSampleError
from runtime.transport.sample_format import (
    build_meta,
    decode_meta,
    describe_field,
    encode_meta,
    field_layouts,
    verify_field,
)


def _reference_sum16(tensor: torch.Tensor) -> tuple[int, ...]:
    """The definition, in plain Python over the bytes (independent of the torch implementation)."""
    data = bytes(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
    out: list[int] = []
    for start in range(0, max(len(data), 1), SUM16_CHUNK_BYTES):
        chunk = data[start : start + SUM16_CHUNK_BYTES]
        words = [chunk[i] | ((chunk[i + 1] if i + 1 < len(chunk) else 0) << 8) for i in range(0, len(chunk), 2)]
        out += [sum(words), sum((i + 1) * w for i, w in enumerate(words))]
    return tuple(out)


def _sample(tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(0, 2048, (tokens,), generator=gen, dtype=torch.int64),
        "mask": (torch.rand(tokens, generator=gen) > 0.5).to(torch.uint8),
        "hs": torch.randn(tokens, 96, generator=gen).to(torch.bfloat16),
        "lhs": torch.randn(tokens, 32, generator=gen).to(torch.bfloat16),
    }


# -- sum16 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_sum16_equals_its_definition_for_every_field_dtype(tokens: int) -> None:
    for name, tensor in _sample(tokens, seed=tokens).items():
        assert sum16_values(tensor) == _reference_sum16(tensor), name  # mask of odd length: a half word


def test_sum16_of_a_view_at_an_odd_byte_offset() -> None:
    base = torch.arange(41, dtype=torch.uint8)
    view = base[3:]  # starts at an odd address: cannot be reinterpreted as int16 in place
    assert sum16_values(view) == _reference_sum16(view.clone())


def test_sum16_sees_a_changed_word_and_two_swapped_words() -> None:
    hs = _sample(64)["hs"]
    original = sum16_values(hs)
    changed = hs.clone()
    changed[5, 7] = changed[5, 7] + 1
    swapped = hs.clone()
    swapped[3, [1, 2]] = hs[3, [2, 1]]
    assert not torch.equal(swapped, hs)
    assert sum16_values(changed) != original
    assert sum16_values(swapped)[0] == original[0] and sum16_values(swapped) != original  # s2 sees the order


def test_sum16_chunks_a_field_above_one_chunk() -> None:
    words = torch.randint(
        -(2**15), 2**15, (CHUNK_WORDS + 5,), dtype=torch.int16, generator=torch.Generator().manual_seed(3)
    )
    values = sum16_values(words)
    assert len(values) == 4
    u = words.to(torch.int64) & 0xFFFF
    weights = torch.arange(1, CHUNK_WORDS + 1, dtype=torch.int64)
    assert values[:2] == (int(u[:CHUNK_WORDS].sum()), int((u[:CHUNK_WORDS] * weights).sum()))
    assert values[2:] == (int(u[CHUNK_WORDS:].sum()), int((u[CHUNK_WORDS:] * weights[:5]).sum()))


def test_a_sum16_field_survives_meta_and_a_corruption_is_named() -> None:
    sample = _sample(33)
    layouts = [
        describe_field(name, t, sum16=sum16_values(t)) if name in ("hs", "lhs") else describe_field(name, t)
        for name, t in sample.items()
    ]
    meta = decode_meta(4, "k/meta", encode_meta(build_meta(4, layouts, {"epoch": 0})))
    parsed = field_layouts(meta)
    assert [la.sum16 is not None for la in parsed] == [False, False, True, True]
    assert [la.crc32 is not None for la in parsed] == [True, True, False, False]
    for layout, tensor in zip(parsed, sample.values(), strict=True):
        verify_field(4, layout, tensor.clone())
    bad = sample["lhs"].clone()
    bad[20, 1] = -bad[20, 1] if bad[20, 1] != 0 else 1.0
    with pytest.raises(CorruptSampleError, match=r"sample g=4: field lhs differs .* chunk at byte 0 \(sum16"):
        verify_field(4, parsed[3], bad)


# -- the pipeline on host tensors ----------------------------------------------------------------


class SlowRecorder:
    """A sink that takes its time and remembers the order and the most samples staged at once."""

    def __init__(self, delay_s: float = 0.05, fail_at: int | None = None) -> None:
        self.delay_s = delay_s
        self.fail_at = fail_at
        self.committed: list[tuple[int, dict[str, torch.Tensor]]] = []

    def commit(self, g, tensors, meta):
        time.sleep(self.delay_s)
        if g == self.fail_at:
            raise OSError(f"store refused g={g}")
        self.committed.append((g, {k: v.clone() for k, v in tensors.items()}))
        return 100 + g


def test_commits_run_in_order_on_the_worker_and_slots_bound_what_is_staged() -> None:
    sink = SlowRecorder(delay_s=0.0)
    gate = threading.Event()
    slow_commit = sink.commit
    sink.commit = lambda g, tensors, meta: (gate.wait(30), slow_commit(g, tensors, meta))[1]
    pipeline = CommitPipeline(sink, slots=2)
    samples = {g: _sample(8, seed=g) for g in range(6)}
    try:
        pipeline.submit(0, samples[0], {"g": 0})
        pipeline.submit(1, samples[1], {"g": 1})
        # Both slots are taken by commits that cannot finish: the submits returned at once (the
        # commits run behind the caller) and a third one waits for a slot.
        assert pipeline.pending() == {0, 1}
        third = threading.Thread(target=pipeline.submit, args=(2, samples[2], {"g": 2}))
        third.start()
        third.join(0.3)
        assert third.is_alive() and pipeline.pending() == {0, 1}
        gate.set()
        third.join(30)
        for g in range(3, 6):
            pipeline.submit(g, samples[g], {"g": g})
            assert len(pipeline.pending()) <= 2
        results = pipeline.drain(timeout_s=30)
    finally:
        gate.set()
        pipeline.close()
    assert [r.g for r in results] == list(range(6)) and all(r.error is None for r in results)
    assert [r.bytes_written for r in results] == [100 + g for g in range(6)]
    assert [g for g, _ in sink.committed] == list(range(6))
    for g, tensors in sink.committed:
        for name, tensor in samples[g].items():
            assert torch.equal(tensors[name], tensor)
    assert pipeline.pending() == set()


def test_a_failed_commit_is_raised_by_the_next_submit_and_by_drain() -> None:
    sink = SlowRecorder(delay_s=0.01, fail_at=1)
    pipeline = CommitPipeline(sink, slots=1)
    try:
        pipeline.submit(0, _sample(4), {})
        pipeline.submit(1, _sample(4), {})
        deadline = time.monotonic() + 10
        while pipeline.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(CommitError, match="committing sample g=1 failed: store refused g=1"):
            pipeline.submit(2, _sample(4), {})
        results = pipeline.completed()
        assert [(r.g, r.error is None) for r in results] == [(0, True), (1, False)]
        with pytest.raises(CommitError, match="g=1"):
            pipeline.raise_if_failed()
    finally:
        pipeline.close()
    assert [g for g, _ in sink.committed] == [0]


def test_a_blocked_submit_notices_a_failure_instead_of_waiting_for_ever() -> None:
    release = threading.Event()

    class Stuck:
        def commit(self, g, tensors, meta):
            if g == 0:
                release.wait(10)
                raise OSError("gone")
            return 1

    pipeline = CommitPipeline(Stuck(), slots=1)
    try:
        pipeline.submit(0, _sample(4), {})
        threading.Timer(0.2, release.set).start()
        with pytest.raises(CommitError, match="g=0 failed: gone"):
            pipeline.submit(1, _sample(4), {})  # waits for the only slot, then sees the failure
    finally:
        pipeline.close()


def test_staging_layout_aligns_fields_and_uses_python_ints() -> None:
    offsets, total = staging_layout(
        {"hs": ((65_536, 5 * 7_168), torch.bfloat16), "lhs": ((65_536, 7_168), torch.bfloat16)}
    )
    assert offsets == {"hs": 0, "lhs": 65_536 * 5 * 7_168 * 2}
    assert total == 65_536 * 6 * 7_168 * 2 > 2**32
    with pytest.raises(ValueError, match="at least one staging slot"):
        CommitPipeline(SlowRecorder(), slots=0)


# -- on a GPU ---------------------------------------------------------------------------------


class ChecksumRecorder(SlowRecorder):
    accepts_checksums = True

    def commit(self, g, tensors, meta, checksums=None):
        self.checksums = getattr(self, "checksums", {})
        self.checksums[g] = dict(checksums or {})
        for name, tensor in tensors.items():
            assert tensor.device.type == "cpu" and (name in ("ids", "mask") or tensor.is_pinned()), name
        return super().commit(g, tensors, meta)


@pytest.mark.gpu
def test_device_samples_are_staged_exactly_with_checksums_from_the_gpu() -> None:
    sink = ChecksumRecorder(delay_s=0.0)
    pipeline = CommitPipeline(sink, slots=2)
    sent = {}
    try:
        for g, tokens in enumerate((1, 37, 4096, 9000)):
            sample = _sample(tokens, seed=g)
            sample["hs"] = sample["hs"].cuda()
            sample["lhs"] = sample["lhs"].cuda()[:, :]  # a view is fine
            sent[g] = {k: v.cpu() for k, v in sample.items()}
            pipeline.submit(g, sample, {})
            del sample  # the staging stream keeps the memory alive (record_stream)
        results = pipeline.drain(timeout_s=60)
    finally:
        pipeline.close()
    assert [r.g for r in results] == [0, 1, 2, 3] and all(r.error is None for r in results)
    for g, tensors in sink.committed:
        for name, tensor in sent[g].items():
            assert torch.equal(tensors[name], tensor), (g, name)
        assert set(sink.checksums[g]) == {"hs", "lhs"}
        for name in ("hs", "lhs"):
            assert sink.checksums[g][name] == _reference_sum16(sent[g][name]) == sum16_values(sent[g][name].cuda())


def test_request_stop_finishes_the_commit_in_progress_and_skips_the_queued_ones() -> None:
    gate = threading.Event()
    committed: list[int] = []

    class StopsDuringFirst:
        def commit(self, g, tensors, meta):
            pipeline.request_stop()  # as SIGTERM does while sample 0 is being written
            gate.wait(30)
            committed.append(g)
            return 1

    pipeline = CommitPipeline(StopsDuringFirst(), slots=3)
    try:
        for g in range(3):
            pipeline.submit(g, _sample(4), {})
        gate.set()
        results = pipeline.drain(timeout_s=30)
    finally:
        pipeline.close()
    assert committed == [0]
    assert [(r.g, r.skipped, r.error) for r in results] == [(0, False, None), (1, True, None), (2, True, None)]


@pytest.mark.parametrize("sink", ["host", "host-sync"])
def test_capture_bench_quick_runs_both_commit_paths_on_cpu(sink: str) -> None:
    from tools.bench.capture import PRESETS, run

    lines: list[str] = []
    result = run(PRESETS["quick"], None, sink, 1, log=lines.append)
    slots = PRESETS["quick"].batch_size if sink == "host" else 0
    assert f"sink {sink}, {slots} commit staging slots" in lines[0]
    assert result["capture_tokens_per_s"] > 0 and result["forward_tokens_per_s"] > 0
    assert 0.0 <= result["outside_forward_share"] < 1.0
    assert any(line.startswith("ratio capture time / forward time") for line in lines)


def test_the_smoke_nan_injection_drops_the_device_checksums_of_the_poisoned_sample() -> None:
    from runtime.capture.gate import NanInjectingSink

    seen: dict[int, tuple[torch.Tensor, dict | None]] = {}

    class Producer:
        accepts_checksums = True

        def commit(self, g, tensors, meta, checksums=None):
            seen[g] = (tensors["hs"], checksums)
            return 1

    sink = NanInjectingSink(Producer(), g=1)
    assert sink.accepts_checksums  # the pipeline still computes device checksums for the others
    sample = _sample(4)
    sums = {"hs": sum16_values(sample["hs"]), "lhs": sum16_values(sample["lhs"])}
    for g in (0, 1):
        sink.commit(g, sample, {}, checksums=sums)
    assert seen[0][1] == sums and torch.equal(seen[0][0], sample["hs"])
    assert seen[1][1] is None and bool(seen[1][0].isnan().all())  # CRC-32s of the NaN bytes, not stale sums
