"""The server-side capture sink (runtime/capture/sglang_sink.py) without SGLang: ragged slicing of a
packed batch, int64 offsets on virtual K3 shapes, refusals, TP rank gating, and commits to a real
mooncake_master on loopback read back by a real consumer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.capture import sglang_sink as sink_mod
from runtime.capture.sglang_sink import (
    CaptureSink,
    CaptureSinkError,
    HostStager,
    SinkSettings,
    capture_from_sglang,
    close_sinks,
    flush_sinks,
    row_span,
    slice_rows,
    split_packed,
    staging_layout,
)
from runtime.capture.sglang_wire import CaptureTicket, WireError, encode_loss_mask
from runtime.recipe.sizes import SampleSize
from runtime.transport.loopback import loopback_endpoints, transport_of

K3_T, K3_H, K3_AUX = 65536, 7168, 5
H, LAYERS = 256, (1, 3, 5)


def _ticket(g: int, mask: list[int], store: str = "tiny", layers: tuple[int, ...] = LAYERS, hidden: int = H):
    return CaptureTicket(g, 0, g + 100, f"row-{g}", encode_loss_mask(mask), store, layers, hidden)


def _packed(lengths: list[int], width: int, seed: int = 0) -> torch.Tensor:
    """A packed batch whose rows hold (request index, row within the request, column) patterns."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sum(lengths), width, generator=gen).to(torch.bfloat16)


class RecordingProducer:
    """Stands in for the data-plane producer at its API boundary (unit tests only)."""

    def __init__(self) -> None:
        self.commits: list[tuple[int, dict[str, torch.Tensor], dict[str, Any]]] = []

    def commit(self, g: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> int:
        self.commits.append((g, {k: v.clone() for k, v in tensors.items()}, dict(meta)))
        return sum(t.numel() * t.element_size() for t in tensors.values())


def _settings(kind: str = "mooncake") -> SinkSettings:
    return SinkSettings(kind, "tiny", LAYERS, H, "tiny-v1", "0.5.23")


# ----------------------------------------------------------------------------------------------
# slicing and offsets
# ----------------------------------------------------------------------------------------------


def test_ragged_requests_slice_out_of_the_packed_batch_as_views() -> None:
    lengths = [3, 1, 7, 2]
    packed = torch.arange(sum(lengths) * 4).reshape(-1, 4)
    parts = split_packed(packed, lengths)
    starts = [0, 3, 4, 11]
    for part, start, n in zip(parts, starts, lengths, strict=True):
        assert part.shape == (n, 4)
        assert torch.equal(part, packed[start : start + n])
        assert part.data_ptr() == packed[start].data_ptr()  # a view, no copy
    with pytest.raises(CaptureSinkError, match="sum to 12 rows, the packed batch has 13"):
        split_packed(packed, [3, 1, 7, 1])


def test_int64_offsets_on_a_virtual_k3_batch() -> None:
    # Three 64K samples packed into one batch, never allocated (meta device).
    rows = 3 * K3_T + 17
    packed = torch.empty(rows, K3_AUX * K3_H, dtype=torch.bfloat16, device="meta")
    start = 2 * K3_T
    part = slice_rows(packed, start, K3_T + 17)
    assert part.shape == (K3_T + 17, K3_AUX * K3_H)
    assert part.storage_offset() == start * K3_AUX * K3_H == 4_697_620_480
    assert part.storage_offset() > 2**31
    assert row_span(start, K3_T + 17, rows) == (start, rows)
    with pytest.raises(CaptureSinkError, match="outside the packed batch"):
        slice_rows(packed, start, K3_T + 18)
    with pytest.raises(CaptureSinkError, match="outside the packed batch"):
        row_span(-1, 5, rows)


def test_staging_layout_of_a_64k_k3_sample_is_exact_and_aligned() -> None:
    shapes = {"hs": ((K3_T, K3_AUX * K3_H), torch.bfloat16), "lhs": ((K3_T, K3_H), torch.bfloat16)}
    offsets, total = staging_layout(shapes)
    size = SampleSize(K3_T, K3_AUX, K3_H)
    assert offsets == {"hs": 0, "lhs": size.hs_bytes}
    assert size.hs_bytes == 4_697_620_480 > 2**31 and size.hs_bytes % 64 == 0
    assert total == size.feature_bytes
    odd = staging_layout({"a": ((3,), torch.uint8), "b": ((5,), torch.int64)})
    assert odd == ({"a": 0, "b": 64}, 104)


# ----------------------------------------------------------------------------------------------
# tickets and refusals
# ----------------------------------------------------------------------------------------------


def test_ticket_round_trip_and_bad_payloads() -> None:
    ticket = _ticket(7, [0, 1, 1, 0])
    assert CaptureTicket.from_payload(ticket.to_payload()) == ticket
    assert ticket.num_tokens == 4
    payload = ticket.to_payload()
    for key, value, message in [
        ("format", "v0", "dspark_capture.format"),
        ("g", -1, "dspark_capture.g must be a non-negative integer"),
        ("loss_mask", "01x", "dspark_capture.loss_mask"),
        ("aux_layer_ids", [], "dspark_capture.aux_layer_ids"),
        ("store_id", "", "dspark_capture.store_id"),
    ]:
        with pytest.raises(WireError, match=message):
            CaptureTicket.from_payload({**payload, key: value})
    with pytest.raises(WireError, match="loss_mask values must be 0 or 1, found 2"):
        encode_loss_mask([0, 1, 2])


def test_sink_refuses_what_would_store_the_wrong_sample() -> None:
    sink = CaptureSink(_settings(), RecordingProducer())
    mask = [0, 1, 1, 1, 0]
    ids = list(range(5))
    aux, last = _packed([5], 3 * H), _packed([5], H, seed=1)

    def refuse(match: str, **kw: Any) -> None:
        args = dict(ticket=_ticket(3, mask), input_ids=ids, aux_rows=aux, last_rows=last)
        args.update(kw)
        with pytest.raises(CaptureSinkError, match=match):
            sink.capture(**args)

    refuse("came from the prefix cache", num_cached_tokens=2)
    refuse("prefilled 4 tokens but the loss mask has 5", input_ids=ids[:4])
    refuse(r"aux hidden states are \(5, 512\), expected \(5, 768\)", aux_rows=aux[:, : 2 * H])
    refuse(r"final hidden states are \(4, 256\)", last_rows=last[:4])
    refuse("are torch.float16, the capture contract stores torch.bfloat16", aux_rows=aux.half())
    refuse("ticket is for store 'other'", ticket=_ticket(3, mask, store="other"))
    refuse(r"aux layers \[1, 3\], the recipe says \[1, 3, 5\]", ticket=_ticket(3, mask, layers=(1, 3)))
    assert sink.producer.commits == []


# ----------------------------------------------------------------------------------------------
# commits and TP gating
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("commit_slots", [0, 2], ids=["synchronous", "pipelined"])
def test_a_float32_server_is_rounded_to_the_bf16_contract_like_the_embedded_engine(commit_slots: int) -> None:
    gen = torch.Generator().manual_seed(4)
    aux, last = torch.randn(6, 3 * H, generator=gen), torch.randn(6, H, generator=gen)
    producer = RecordingProducer()
    sink = CaptureSink(_settings(), producer, commit_slots=commit_slots)
    try:
        receipt = sink.capture(ticket=_ticket(5, [1] * 6), input_ids=list(range(6)), aux_rows=aux, last_rows=last)
        if sink.pipeline is not None:
            assert receipt["status"] == "queued"
            assert [r.error for r in sink.pipeline.drain(timeout_s=30)] == [None]
        else:
            assert receipt["status"] == "committed"
    finally:
        if sink.pipeline is not None:
            sink.pipeline.close()
    assert receipt["fields"]["lhs"]["dtype"] == "bfloat16"
    ((_, tensors, _),) = producer.commits
    assert torch.equal(tensors["hs"], aux.to(torch.bfloat16)) and torch.equal(tensors["lhs"], last.to(torch.bfloat16))


def test_only_the_output_rank_commits_and_every_rank_reports_the_same_shapes() -> None:
    lengths = [4, 9, 2]
    aux, last = _packed(lengths, 3 * H, seed=2), _packed(lengths, H, seed=3)
    masks = [[0, 1, 1, 0], [1] * 9, [0, 1]]
    ids = [list(range(10 * i, 10 * i + n)) for i, n in enumerate(lengths)]
    starts = [0, 4, 13]
    leader, follower = RecordingProducer(), RecordingProducer()
    sinks = {True: CaptureSink(_settings(), leader), False: CaptureSink(_settings(), follower)}
    for rank_commits, sink in sinks.items():
        for i, (start, n) in enumerate(zip(starts, lengths, strict=True)):
            receipt = sink.capture(
                ticket=_ticket(20 + i, masks[i]),
                input_ids=ids[i],
                aux_rows=slice_rows(aux, start, n),
                last_rows=slice_rows(last, start, n),
                is_commit_rank=rank_commits,
                patch="kimi_k3_dspark_sglang_0.5.23/2",
            )
            assert receipt["status"] == ("committed" if rank_commits else "skipped")
            assert receipt["g"] == 20 + i and receipt["num_tokens"] == n
            assert receipt["fields"]["hs"] == {"dtype": "bfloat16", "shape": [n, 3 * H], "bytes": n * 3 * H * 2}
            assert receipt["keys"][0] == f"tiny/s/{20 + i:012d}/ids" and receipt["keys"][-1].endswith("/meta")
    assert follower.commits == []
    assert [g for g, _, _ in leader.commits] == [20, 21, 22]
    for i, (g, tensors, meta) in enumerate(leader.commits):
        start, n = starts[i], lengths[i]
        assert tensors["ids"].dtype == torch.int64 and tensors["ids"].tolist() == ids[i]
        assert tensors["mask"].dtype == torch.uint8 and tensors["mask"].tolist() == masks[i]
        assert torch.equal(tensors["hs"], aux[start : start + n])
        assert torch.equal(tensors["lhs"], last[start : start + n])
        assert meta["row_id"] == f"row-{g}" and meta["row_index"] == g + 100 and meta["num_tokens"] == n
        assert meta["engine"] == "sglang" and meta["aux_layer_ids"] == list(LAYERS)
        assert meta["capture_patch"] == "kimi_k3_dspark_sglang_0.5.23/2" and meta["target_revision"] == "tiny-v1"


def test_a_pipelined_sink_queues_commits_in_order_and_reports_a_failed_one() -> None:
    lengths = [4, 9, 2]
    aux, last = _packed(lengths, 3 * H, seed=4), _packed(lengths, H, seed=5)

    class FailsAt21(RecordingProducer):
        def commit(self, g, tensors, meta):
            if g == 21:
                raise OSError("segment full")
            return super().commit(g, tensors, meta)

    producer = FailsAt21()
    sink = CaptureSink(_settings(), producer, commit_slots=2)
    try:
        receipts = []
        start = 0
        for i, n in enumerate(lengths[:2]):
            receipts.append(
                sink.capture(
                    ticket=_ticket(20 + i, [1] * n),
                    input_ids=list(range(n)),
                    aux_rows=slice_rows(aux, start, n),
                    last_rows=slice_rows(last, start, n),
                )
            )
            start += n
        assert [r["status"] for r in receipts] == ["queued", "queued"]
        assert receipts[0]["bytes_written"] == 4 * (8 + 1 + 4 * H * 2)
        sink.pipeline.drain(timeout_s=30)
        assert [g for g, _, _ in producer.commits] == [20]
        assert torch.equal(producer.commits[0][1]["hs"], aux[:4])
        with pytest.raises(
            CaptureSinkError, match="sample g=22 not queued: .*committing sample g=21 failed: segment full"
        ):
            sink.capture(ticket=_ticket(22, [1, 1]), input_ids=[1, 2], aux_rows=aux[13:], last_rows=last[13:])
    finally:
        sink.pipeline.close()


def test_discard_sink_checks_and_describes_without_committing() -> None:
    sink = CaptureSink(SinkSettings("discard", None, None, None, None, None))
    receipt = sink.capture(
        ticket=_ticket(5, [1, 1, 0]), input_ids=[1, 2, 3], aux_rows=_packed([3], 3 * H), last_rows=_packed([3], H)
    )
    assert receipt["status"] == "discarded" and receipt["bytes_written"] == 0
    assert receipt["store_id"] == "tiny" and receipt["fields"]["lhs"]["shape"] == [3, H]


def test_capture_from_sglang_reports_missing_hidden_states_clearly() -> None:
    with pytest.raises(CaptureSinkError, match="kept no aux hidden states; launch with --enable-return-aux"):
        capture_from_sglang(
            sink_kind="discard", recipe_path=None, request=_ticket(1, [1]).to_payload(), input_ids=[5],
            num_cached_tokens=0, aux_hidden_states=None, last_hidden_states=_packed([1], H), start=0,
            num_tokens=1, is_commit_rank=True,
        )  # fmt: skip
    with pytest.raises(CaptureSinkError, match="mooncake needs --dspark-capture-recipe"):
        sink_mod.open_sink("mooncake", None, True)


# ----------------------------------------------------------------------------------------------
# a real Mooncake master
# ----------------------------------------------------------------------------------------------


@pytest.mark.mooncake
def test_commits_land_in_a_real_mooncake_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.transport.dataplane import open_consumer, open_producer
    from runtime.transport.loopback import free_port, loopback_env, loopback_master, loopback_recipe
    from runtime.transport.sample_format import sample_keys

    resolved = loopback_recipe(
        tmp_path,
        (free_port(), free_port(), free_port()),
        [
            "transport.store_id=sinktest",
            "transport.kv_lease_ttl_s=5",
            "transport.connect_timeout_s=20",
            "transport.poll_interval_s=0.05",
            "job.trainer.tasks_per_node=1",
            "trainer.gradient_accumulation_steps=4",
            "trainer.global_batch_size=4",
            "transport.high_watermark_samples=8",
            "transport.low_watermark_samples=4",
        ],
    )
    for key, value in loopback_env(resolved).items():
        monkeypatch.setenv(key, value)
    endpoints = loopback_endpoints(resolved)
    lengths = [37, 120]
    aux, last = _packed(lengths, 3 * H, seed=11), _packed(lengths, H, seed=12)
    masks = [[i % 2 for i in range(n)] for n in lengths]
    ids = [list(range(1000, 1000 + n)) for n in lengths]
    with (
        loopback_master(resolved),
        open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints, start_cursor=0) as producer,
    ):
        claimed = [producer.next_to_capture(), producer.next_to_capture()]
        assert claimed == [0, 1]
        try:
            start = 0
            for g, n in zip(claimed, lengths, strict=True):
                ticket = CaptureTicket(g, 0, g, f"row-{g}", encode_loss_mask(masks[g]), "sinktest", LAYERS, H)
                common = dict(
                    sink_kind="mooncake", recipe_path=str(resolved.path), request=ticket.to_payload(),
                    input_ids=ids[g], num_cached_tokens=0, aux_hidden_states=aux, last_hidden_states=last,
                    start=start, num_tokens=n, patch="test-patch",
                )  # fmt: skip
                skipped = capture_from_sglang(**common, is_commit_rank=False)
                assert skipped["status"] == "skipped"
                assert producer.client.exist(sample_keys("sinktest", g)) == [False] * 5
                receipt = capture_from_sglang(**common, is_commit_rank=True)
                # capture.commit_staging_slots defaults to one batch: commits run behind the receipt
                assert receipt["status"] == "queued" and receipt["bytes_written"] > n * 4 * H * 2
                start += n
            flush_sinks(timeout_s=60)
            producer.refresh()
            assert set(producer.window.resident) == {0, 1} and not producer.window.in_flight
            with open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints) as consumer:
                start = 0
                for g, n in enumerate(lengths):
                    got = consumer.fetch(g)
                    assert got.ids.tolist() == ids[g] and got.mask.tolist() == masks[g]
                    assert torch.equal(got.hs, aux[start : start + n]) and torch.equal(got.lhs, last[start : start + n])
                    assert got.meta["engine"] == "sglang" and got.meta["row_id"] == f"row-{g}"
                    assert got.meta["capture_patch"] == "test-patch" and got.meta["fields"]["hs"]["crc32"] is not None
                    start += n
        finally:
            close_sinks()


# ----------------------------------------------------------------------------------------------
# GPU: the side-stream staging
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_side_stream_staging_copies_device_rows_into_reused_pinned_memory() -> None:
    device = torch.device("cuda")
    stager = HostStager()
    gen = torch.Generator(device=device).manual_seed(0)
    for tokens in (4096, 1024, 8192):
        packed = torch.randn(tokens + 100, 5 * 1024, device=device, generator=gen).to(torch.bfloat16)
        final = torch.randn(tokens + 100, 1024, device=device, generator=gen).to(torch.bfloat16)
        # queue more work on the producing stream: the copy must wait for the rows, not for this
        busy = torch.randn(4096, 4096, device=device, generator=gen)
        for _ in range(4):
            busy = busy @ busy / 64.0
        rows = slice_rows(packed, 100, tokens)
        host = stager.stage({"hs": rows, "lhs": slice_rows(final, 100, tokens), "ids": torch.arange(tokens)})
        assert host["hs"].is_pinned() and host["hs"].device.type == "cpu"
        assert torch.equal(host["hs"], rows.cpu()) and torch.equal(host["lhs"], final[100:].cpu())
        assert host["ids"].device.type == "cpu"
    assert stager.capacity_bytes == 8192 * 6 * 1024 * 2  # grew once, to the largest sample
