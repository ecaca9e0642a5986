"""Unit tests of the data plane's pure parts: window rules, sample format, records, endpoints,
master command line, recipe-time checks. No Mooncake here (the integration tests use a real one)."""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from runtime.recipe import RecipeError, SampleSize, load_recipe
from runtime.shared.contracts import TENSOR_FIELDS, global_sample_index, sample_key
from runtime.transport.consumer import Consumer
from runtime.transport.errors import CorruptSampleError, code_name
from runtime.transport.liveness import Heartbeat
from runtime.transport.master import eviction_ratio
from runtime.transport.records import Cursor
from runtime.transport.sample_format import (
    CRC_CHUNK_BYTES,
    DTYPES,
    SAMPLE_FORMAT,
    build_meta,
    byte_view,
    crc32_chunks,
    decode_meta,
    describe_field,
    encode_meta,
    field_layouts,
    sample_keys,
    tensor_nbytes,
    verify_field,
)
from runtime.transport.settings import TransportSettings
from runtime.transport.window import WindowLimits, WindowState

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny.yaml"
K3 = REPO / "recipes" / "kimi_k3_v1c.yaml"


# ---------------------------------------------------------------------------------------------
# the window
# ---------------------------------------------------------------------------------------------


def _window(high: int = 8, low: int = 4, high_bytes: int = 10**9, low_bytes: int = 10**9 - 1, head: int = 4):
    return WindowState(WindowLimits(high, low, high_bytes, low_bytes, head))


def test_window_claims_missing_g_in_order_from_the_cursor() -> None:
    w = _window()
    assert w.claim(3) == []  # no cursor yet: nothing to capture
    w.observe(10, {11: 100, 13: 100})
    assert w.claim(3) == [10, 12, 14]
    assert w.claim(1) == [15]
    w.release(12)
    assert w.claim(1) == [12]


def test_window_pauses_at_high_sample_watermark_and_resumes_below_low() -> None:
    w = _window(high=8, low=4)
    w.observe(0, {})
    got = w.claim(100)
    assert got == list(range(8)) and w.paused  # 8 in flight reach the high watermark
    for g in got:
        w.committed(g, 10)
    assert w.paused and w.claim(1) == []
    # the trainer consumed and deleted 0..3; cursor 4: 4 resident, not below low 4 -> still paused
    w.observe(4, {g: 10 for g in range(4, 8)})
    assert w.paused and w.claim(1) == []
    w.observe(5, {g: 10 for g in range(5, 8)})  # 3 resident < 4: resume
    assert not w.paused
    assert w.claim(100) == [8, 9, 10, 11, 12]
    assert w.paused and w.transitions == 3


def test_window_pauses_on_bytes_and_resumes_below_low_bytes() -> None:
    w = _window(high=100, low=50, high_bytes=1000, low_bytes=600, head=2)
    w.observe(0, {})
    claimed = []
    while True:
        batch = w.claim(1)
        if not batch:
            break
        claimed += batch
        w.committed(batch[0], 300)
    assert claimed == [0, 1, 2, 3] and w.paused  # 4 x 300 = 1200 >= 1000
    assert "1200 bytes (high 1000, resumes below 600)" in w.pause_reason()
    w.observe(2, {2: 300, 3: 300})  # 600 is not below 600
    assert w.paused
    w.observe(3, {3: 300})
    assert not w.paused and w.claim(1) == [4]


def test_window_head_is_captured_while_paused_below_the_hard_watermark() -> None:
    # hysteresis holds the producer paused (5 resident >= low 4) but the head of the window, the
    # next global step, has a hole: capture it anyway
    w = _window(high=8, low=4, head=4)
    w.observe(0, {g: 1 for g in range(8)})
    assert w.paused
    w.observe(0, {1: 1, 2: 1, 3: 1, 5: 1, 6: 1})
    assert w.paused
    assert w.claim(5) == [0]  # only the head hole, not 4 or 7


def test_window_drops_tail_when_head_has_a_hole_at_the_hard_watermark() -> None:
    # the trainer restarted from an older checkpoint: cursor moved back from 8 to 4; the store
    # holds 8..15 (the old window); the head 4..7 is missing and the high watermark is reached
    w = _window(high=8, low=4, head=4)
    w.observe(8, {g: 1 for g in range(8, 16)})
    w.observe(4, {g: 1 for g in range(8, 16)})
    assert w.head_missing() and w.at_hard_limit()
    victims = w.tail_victims()
    assert victims == [15]  # the farthest one, just enough to get below the high watermark
    w.removed(victims)
    assert w.claim(4) == [4]
    assert w.tail_victims() == [14]


def test_window_garbage_is_what_lies_below_the_cursor() -> None:
    w = _window()
    w.observe(5, {2: 1, 4: 1, 5: 1, 9: 1})
    assert w.garbage() == [2, 4]
    w.removed([2, 4])
    assert sorted(w.resident) == [5, 9]


# ---------------------------------------------------------------------------------------------
# sample format
# ---------------------------------------------------------------------------------------------


def test_k3_sizes_are_exact_int64_without_allocating() -> None:
    tokens, n_aux, hidden = 65_536, 5, 7_168
    hs_bytes = tensor_nbytes((tokens, n_aux * hidden), torch.bfloat16)
    assert hs_bytes == 65_536 * 35_840 * 2 == 4_697_620_480
    assert tokens * n_aux * hidden > 2**31  # the element count alone overflows int32
    lhs_bytes = tensor_nbytes((tokens, hidden), torch.bfloat16)
    size = SampleSize(tokens, n_aux, hidden)
    assert (size.hs_bytes, size.lhs_bytes, size.ids_bytes, size.mask_bytes) == (
        hs_bytes,
        lhs_bytes,
        tensor_nbytes((tokens,), torch.int64),
        tensor_nbytes((tokens,), torch.uint8),
    )
    assert abs(size.feature_bytes / 2**30 - 5.25) < 1e-9  # "a 64K K3 sample is about 5.25 GiB"
    # and the meta a K3 sample would carry round-trips these numbers exactly
    layouts = [
        describe_field(name, torch.empty(0, dtype=dtype), with_checksum=False)
        for name, dtype in (
            ("ids", torch.int64),
            ("mask", torch.uint8),
            ("hs", torch.bfloat16),
            ("lhs", torch.bfloat16),
        )
    ]
    shapes = {"ids": (tokens,), "mask": (tokens,), "hs": (tokens, n_aux * hidden), "lhs": (tokens, hidden)}
    layouts = [
        type(la)(la.name, la.dtype, shapes[la.name], tensor_nbytes(shapes[la.name], DTYPES[la.dtype]), None)
        for la in layouts
    ]
    meta = decode_meta(7, "k", encode_meta(build_meta(7, layouts, {"T": tokens})))
    assert meta["sample_bytes"] == size.ids_bytes + size.mask_bytes + size.feature_bytes
    assert [la.num_bytes for la in field_layouts(meta)] == [la.num_bytes for la in layouts]


def test_byte_view_and_chunk_crcs_of_bf16_are_the_tensor_bytes() -> None:
    t = torch.tensor([[1.0, -2.5], [3.25, 0.0]], dtype=torch.bfloat16)
    view = byte_view(t)
    assert view.dtype == torch.uint8 and view.numel() == 8 and view.data_ptr() == t.data_ptr()
    assert crc32_chunks(t) == crc32_chunks(t.clone()) == (zlib.crc32(bytes(view.numpy())),)
    u = t.clone()
    u[1, 1] = 1.0
    assert crc32_chunks(u) != crc32_chunks(t)
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(t.t())


def test_chunk_crcs_locate_a_corrupt_byte() -> None:
    data = torch.arange(10_000, dtype=torch.int64)  # 80,000 bytes: 3 chunks of 32 KiB
    crcs = crc32_chunks(data, chunk_bytes=32768)
    assert len(crcs) == 3
    assert crcs[1] == zlib.crc32(bytes(byte_view(data)[32768:65536].numpy()))
    layout = describe_field("ids", data, crc32=crcs)
    layout = type(layout)(layout.name, layout.dtype, layout.shape, layout.num_bytes, crcs, 32768)
    verify_field(0, layout, data.clone())
    bad = data.clone()
    bad[5000] += 1  # byte 40,000: the second chunk
    with pytest.raises(
        CorruptSampleError, match="field ids differs from what was committed in the chunk at byte 32768"
    ):
        verify_field(0, layout, bad)
    assert CRC_CHUNK_BYTES == 64 * 2**20


def _layouts(g: int) -> list:
    tensors = {
        "ids": torch.arange(5, dtype=torch.int64) + g,
        "mask": torch.ones(5, dtype=torch.uint8),
        "hs": torch.ones(5, 6, dtype=torch.bfloat16),
        "lhs": torch.ones(5, 2, dtype=torch.bfloat16),
    }
    return [describe_field(name, tensors[name]) for name in TENSOR_FIELDS]


def test_meta_carries_capture_metadata_and_field_layouts() -> None:
    meta = build_meta(3, _layouts(3), {"epoch": 1, "row_id": "r3", "T": 5})
    decoded = decode_meta(3, "key", encode_meta(meta))
    assert decoded["format"] == SAMPLE_FORMAT and decoded["g"] == 3 and decoded["row_id"] == "r3"
    assert decoded["fields"]["hs"] == {
        "dtype": "bfloat16",
        "shape": [5, 6],
        "bytes": 60,
        "crc32": list(_layouts(3)[2].crc32),
        "crc32_chunk_bytes": CRC_CHUNK_BYTES,
    }
    assert field_layouts(decoded)[2] == _layouts(3)[2]
    assert decoded["sample_bytes"] == 40 + 5 + 60 + 20


def test_meta_rejects_reserved_keys_wrong_g_and_bad_stored_forms() -> None:
    with pytest.raises(ValueError, match="reserved"):
        build_meta(3, _layouts(3), {"fields": {}})
    with pytest.raises(ValueError, match="mixed up"):
        build_meta(3, _layouts(3), {"g": 4})
    with pytest.raises(ValueError, match="expected exactly"):
        build_meta(3, _layouts(3)[:3], {})
    with pytest.raises(CorruptSampleError, match="not valid JSON"):
        decode_meta(3, "tiny/s/000000000003/meta", b"{oops")
    with pytest.raises(CorruptSampleError, match="different versions"):
        decode_meta(3, "k", json.dumps({"format": "other/9", "g": 3}).encode())
    with pytest.raises(CorruptSampleError, match="records g=4"):
        decode_meta(3, "k", encode_meta(build_meta(4, _layouts(4), {})))


def test_sample_keys_follow_the_design() -> None:
    assert sample_keys("tiny", 42) == [f"tiny/s/000000000042/{f}" for f in ("ids", "mask", "hs", "lhs", "meta")]
    assert sample_key("k3", 7, "meta") == "k3/s/000000000007/meta"


# ---------------------------------------------------------------------------------------------
# records
# ---------------------------------------------------------------------------------------------


def test_cursor_and_heartbeat_round_trip_and_summary() -> None:
    c = Cursor(128, 1, 100.0, "rank 0")
    assert Cursor.decode(c.encode()) == c
    with pytest.raises(ValueError, match="not a cursor"):
        Cursor.decode(b'{"value": -1}')
    beat = Heartbeat(
        time=1000.0,
        sequence=3,
        pid=7,
        host="cap",
        cursor=128,
        window_end=256,
        resident_samples=5,
        resident_bytes=500,
        in_flight=1,
        paused=True,
        committed_total=9,
        last_commit_time=990.0,
        rate_samples_per_s=0.5,
        errors=1,
        last_error="boom",
        waiting_for="x",
    )
    assert Heartbeat.decode(beat.encode()) == beat
    text = beat.summary(now=1012.0)
    assert "heartbeat 12.0 s old" in text and "window [128, 256)" in text and "PAUSED" in text
    assert "last commit 22.0 s ago" in text and "1 errors, last: boom" in text


def _beat(sequence: int, wall_age_s: float, **changes: object) -> Heartbeat:
    fields: dict[str, object] = dict(
        time=time.time() - wall_age_s,
        sequence=sequence,
        pid=7,
        host="cap",
        cursor=0,
        window_end=8,
        resident_samples=0,
        resident_bytes=0,
        in_flight=0,
        paused=False,
        committed_total=0,
        last_commit_time=None,
        rate_samples_per_s=0.0,
        errors=0,
    )
    fields.update(changes)
    return Heartbeat(**fields)  # type: ignore[arg-type]


def test_a_waiting_rank_ages_the_heartbeat_on_its_own_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stale after 3 intervals; a beat seen arriving is aged by this rank's monotonic clock (the
    producer's clock may be off), one not seen arriving by its own timestamp."""
    from runtime.transport import liveness as liveness_module

    clock = [1000.0]
    monkeypatch.setattr(
        liveness_module, "time", SimpleNamespace(monotonic=lambda: clock[0], time=time.time, sleep=time.sleep)
    )
    recipe = load_recipe(TINY, overrides=["transport.heartbeat_interval_s=2"]).recipe
    settings = TransportSettings.from_recipe(recipe).consumer
    rank = Consumer(None, settings, 0, settings.world_size).liveness  # type: ignore[arg-type]

    old = _beat(1, wall_age_s=100.0)
    rank.observe(old)  # the first beat this rank reads: only its timestamp tells its age
    cause = rank.likely_cause(old, 5)
    assert cause.startswith("the producer (pid 7 on host cap) has not beaten for 100 s (sequence 1;"), cause
    assert "it is hung, stopped (SIGSTOP) or dead; look at the capture log" in cause

    skewed = _beat(2, wall_age_s=50.0)  # the producer's clock is 50 s behind, but it beats
    clock[0] += 1.0
    rank.observe(skewed)
    assert rank.likely_cause(skewed, 5).startswith("the producer (pid 7 on host cap) is alive (last heartbeat 0.0 s")
    clock[0] += 7.0  # the same beat 7 s later: more than 3 intervals of 2 s
    rank.observe(skewed)
    assert "has not beaten for 7 s" in rank.likely_cause(skewed, 5)

    clock[0] += 1.0
    paused = _beat(3, 0.0, paused=True, waiting_for="free space (8 samples resident)", errors=2, last_error="boom")
    rank.observe(paused)
    cause = rank.likely_cause(paused, 5)
    assert "is alive" in cause and "has not committed g=5: it is paused (free space (8 samples resident))" in cause
    assert cause.endswith("; its last error: boom")
    clock[0] += 1.0
    beyond = _beat(4, 0.0)
    rank.observe(beyond)
    assert rank.likely_cause(beyond, 9).endswith("has not committed g=9: g=9 is beyond its window [0, 8)")
    clock[0] += 1.0
    closed = _beat(5, 0.0, closed=True)
    rank.observe(closed)
    assert "the producer (pid 7 on host cap) shut down 0 s ago (its last heartbeat says it closed)" in (
        rank.likely_cause(closed, 5)
    )
    assert "CLOSED" in closed.summary()
    assert Cursor.decode(Cursor(8, 2, 1.0, "rank 0", segment="10.0.0.1:1234").encode()).segment == "10.0.0.1:1234"

    # Several capture nodes: each share's producer is watched on its own and named with its share.
    two = load_recipe(TINY, overrides=["transport.heartbeat_interval_s=2", "job.capture.nodes=2"]).recipe
    settings = TransportSettings.from_recipe(two).consumer
    rank = Consumer(None, settings, 0, settings.world_size).liveness  # type: ignore[arg-type]
    fresh, stale = _beat(1, 0.0, pid=10), _beat(1, 100.0, pid=11)
    rank.observe(fresh, 0)
    rank.observe(stale, 1)
    assert rank.likely_cause(fresh, 4, 0).startswith("the producer of capture share 0 of 2 (pid 10 on host cap) is")
    assert rank.likely_cause(stale, 5, 1).startswith(
        "the producer of capture share 1 of 2 (pid 11 on host cap) has not beaten for 100 s"
    )


# ---------------------------------------------------------------------------------------------
# endpoints, master command line
# ---------------------------------------------------------------------------------------------


def test_endpoints_from_the_launcher_env_contract() -> None:
    recipe = load_recipe(TINY).recipe
    transport = TransportSettings.from_recipe(recipe)
    env = {
        "DSPARK_MOONCAKE_MASTER": "10.0.0.5:50151",
        "DSPARK_MOONCAKE_METADATA": "http://10.0.0.5:18180/metadata",
        "DSPARK_BIND_ADDRESS": "10.0.0.9",
    }
    e = transport.endpoints_from_env(env)
    assert (e.master_host, e.master_rpc_port, e.bind_address) == ("10.0.0.5", 50151, "10.0.0.9")
    e = transport.endpoints_from_env({"DSPARK_CAPTURE_HOST": "10.0.0.5", "DSPARK_BIND_ADDRESS": "10.0.0.9"})
    assert e.metadata_url == f"http://10.0.0.5:{recipe.transport.metadata_http_port}/metadata"
    with pytest.raises(ValueError, match="DSPARK_BIND_ADDRESS is not set"):
        transport.endpoints_from_env({"DSPARK_CAPTURE_HOST": "10.0.0.5"})
    with pytest.raises(ValueError, match="cannot find the Mooncake master"):
        transport.endpoints_from_env({"DSPARK_BIND_ADDRESS": "10.0.0.9"})
    with pytest.raises(ValueError, match="not host:port"):
        transport.endpoints_from_env({**env, "DSPARK_MOONCAKE_MASTER": "10.0.0.5"})


def test_master_command_uses_recipe_values_and_eviction_ratio() -> None:
    recipe = load_recipe(K3).recipe
    settings = TransportSettings.from_recipe(recipe).master("10.1.2.3")
    cmd = settings.command()
    assert cmd[0] == "mooncake_master"
    for flag in (
        "--rpc_address=10.1.2.3",
        "--rpc_port=50051",
        "--enable_http_metadata_server=false",
        "--metrics_host=10.1.2.3",
        "--metrics_port=9003",
        "--default_kv_lease_ttl=300s",
        "--eviction_high_watermark_ratio=0.878906",  # 900 GiB / 1 TiB
        "--client_ttl=10",
    ):
        assert flag in cmd, flag
    assert settings.metadata_command()[-2:] == ["--host=10.1.2.3", "--port=8080"]
    assert eviction_ratio(900 * 2**30, 2**40) == pytest.approx(0.87890625)
    with pytest.raises(ValueError, match="outside"):
        eviction_ratio(2, 1)


def test_error_codes_have_names() -> None:
    assert code_name(-704) == "OBJECT_NOT_FOUND (-704)"
    assert code_name(-12345) == "UNKNOWN (-12345)"


def test_global_sample_index_covers_each_step_exactly_once() -> None:
    world, micro, accum = 4, 1, 32
    seen = sorted(
        global_sample_index(s, m, r, b, world, micro, accum)
        for s in range(3)
        for m in range(accum)
        for r in range(world)
        for b in range(micro)
    )
    assert seen == list(range(3 * 128))


# ---------------------------------------------------------------------------------------------
# recipe-time checks of the data plane
# ---------------------------------------------------------------------------------------------


def _problems(error: RecipeError) -> dict[str, str]:
    return {p.path: p.message for p in error.problems}


def test_in_flight_overshoot_above_store_cap_is_rejected_naming_both_numbers() -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, overrides=["transport.high_watermark_bytes=191MiB", "capture.batch_size=4"])
    message = _problems(info.value)["transport.high_watermark_bytes"]
    assert "191.00 MiB" in message and "4 sample(s) in flight" in message
    assert "store_cap_bytes 192.00 MiB" in message and "193.02 MiB" in message
    load_recipe(TINY, overrides=["transport.high_watermark_bytes=189MiB", "capture.batch_size=4"])  # fits


def test_k3_recipe_watermarks_pass_and_bad_ones_name_both_numbers() -> None:
    load_recipe(K3)
    with pytest.raises(RecipeError) as info:
        load_recipe(K3, overrides=["transport.high_watermark_bytes=600GiB", "transport.low_watermark_bytes=500GiB"])
    message = _problems(info.value)["transport.high_watermark_bytes"]
    assert "600.00 GiB" in message and "trainer.global_batch_size 128" in message
    with pytest.raises(RecipeError) as info:
        load_recipe(K3, overrides=["transport.store_cap_bytes=2TiB"])
    assert "global_segment_bytes 1.00 TiB" in _problems(info.value)["transport.store_cap_bytes"]


def test_free_port_keeps_to_its_workers_range_and_skips_a_taken_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under xdist each worker gets DSPARK_PORT_RANGE (tests/conftest.py): ports come from it in turn,
    never repeated within a process, and one that is taken is skipped."""
    import socket

    from runtime.transport import loopback

    monkeypatch.setenv(loopback.ENV_PORT_RANGE, "24000-24009")
    monkeypatch.setattr(loopback, "_next_in_range", {})
    first = loopback.free_port()
    assert 24000 <= first <= 24009
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        taken = 24000 + (first - 24000 + 1) % 10
        holder.bind(("127.0.0.1", taken))
        ports = [first] + [loopback.free_port() for _ in range(8)]
    assert taken not in ports and len(set(ports)) == 9 and all(24000 <= p <= 24009 for p in ports)
    monkeypatch.setenv(loopback.ENV_PORT_RANGE, "24000")
    with pytest.raises(ValueError, match="write LOW-HIGH"):
        loopback.free_port()


# ---------------------------------------------------------------------------------------------
# `python3 -m runtime.transport status --job DIR`: this job's store, not a later job's on its ports
# ---------------------------------------------------------------------------------------------


class _StoreWithBeat:
    """Stands in for the status command's store client (the boundary): the heartbeats it holds, by key;
    any other key is absent."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects
        self.asked: list[str] = []

    def connect(self, quiet: bool = False) -> _StoreWithBeat:
        return self

    def __enter__(self) -> _StoreWithBeat:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def get_bytes(self, key: str) -> bytes | None:
        self.asked.append(key)
        return self.objects.get(key)

    def exist(self, keys: list[str]) -> list[bool]:
        return [key in self.objects for key in keys]


def _job_with_endpoints(tmp_path: Path, recorder: str = "capture") -> tuple[Path, dict[str, object], str]:
    """A resolved tiny job whose capture recorded its endpoints (this process's pid and host); its store id."""
    from runtime.recipe.loader import write_resolved
    from runtime.transport.endpoints import Endpoints, endpoints_record, record_endpoints

    loaded = load_recipe(TINY)
    job_dir = tmp_path / "job"
    write_resolved(loaded, job_dir, REPO)
    transport = TransportSettings.from_recipe(loaded.recipe)
    record_endpoints(job_dir, Endpoints.on_host(transport.ports, "127.0.0.1", "127.0.0.1"), recorder=recorder)
    record = endpoints_record(job_dir)
    assert record is not None
    return job_dir, record, transport.store_id


def test_status_tells_this_jobs_store_from_a_later_jobs_on_the_same_ports(tmp_path: Path) -> None:
    """The share-0 heartbeat's pid and host against the job folder's endpoints record: the same producer
    is this job's store; another is a later job's, named with both; without a beat, or with a record
    written by a master run by hand (no producer pid to compare), it cannot be told and is not refused."""
    import os
    import socket

    from runtime.shared.contracts import heartbeat_key
    from runtime.transport.__main__ import _another_jobs_store

    job_dir, record, store_id = _job_with_endpoints(tmp_path)
    key = heartbeat_key(store_id, 0)
    ours = _beat(1, 0.0, pid=os.getpid(), host=socket.gethostname())
    assert _another_jobs_store(_StoreWithBeat({key: ours.encode()}), store_id, record) == ""
    later = _beat(1, 0.0, pid=os.getpid() + 1, host=socket.gethostname())
    line = _another_jobs_store(_StoreWithBeat({key: later.encode()}), store_id, record)
    assert line.startswith(f"the store at {record['master_address']} is not this job's: its producer is pid "), line
    assert f"pid {os.getpid() + 1} on {socket.gethostname()}" in line
    assert f"this job's capture was pid {os.getpid()} on {socket.gethostname()}" in line
    elsewhere = _beat(1, 0.0, pid=os.getpid(), host="another-node")  # same pid, other node: not ours either
    assert "is not this job's" in _another_jobs_store(_StoreWithBeat({key: elsewhere.encode()}), store_id, record)
    # only share 0's beat is read; none there: nothing to tell
    share_1 = _StoreWithBeat({heartbeat_key(store_id, 1): later.encode()})
    assert _another_jobs_store(share_1, store_id, record) == "" and share_1.asked == [key]
    assert _another_jobs_store(_StoreWithBeat({key: later.encode()}), store_id, None) == ""
    _, by_hand, _ = _job_with_endpoints(tmp_path / "by_hand", recorder="master")
    untouched = _StoreWithBeat({key: later.encode()})
    assert _another_jobs_store(untouched, store_id, by_hand) == "" and untouched.asked == []


def test_status_refuses_a_later_jobs_store_before_reading_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`status --job DIR` through its entry point, the store client and the master's port mocked: a later
    job's producer in the store ends the command with 1 and that one line, before any cursor is read."""
    import os
    import socket

    from runtime.shared.contracts import cursor_key, heartbeat_key
    from runtime.transport import __main__ as status_command
    from runtime.transport import store as store_module

    for name in ("DSPARK_MOONCAKE_MASTER", "DSPARK_CAPTURE_HOST", "DSPARK_BIND_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    job_dir, _, store_id = _job_with_endpoints(tmp_path)
    store = _StoreWithBeat({heartbeat_key(store_id, 0): _beat(1, 0.0, pid=os.getpid() + 1).encode()})
    monkeypatch.setattr(status_command, "_master_refuses", lambda host, port: "")
    monkeypatch.setattr(store_module, "StoreClient", lambda *args, **kwargs: store)
    assert status_command.main(["status", "--job", str(job_dir)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"job {job_dir}: the store at 127.0.0.1:") and "is not this job's" in out, out
    assert "give that job's folder to look at it" in out
    assert cursor_key(store_id) not in store.asked, "nothing of the other job's store is reported"

    store.objects = {heartbeat_key(store_id, 0): _beat(1, 0.0, pid=os.getpid(), host=socket.gethostname()).encode()}
    store.asked.clear()
    assert status_command.main(["status", "--job", str(job_dir)]) == 0
    out = capsys.readouterr().out
    assert f"store {store_id}: no cursor" in out and "pid " in out, out
