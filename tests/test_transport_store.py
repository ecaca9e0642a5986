"""Integration tests of the data plane against a real mooncake_master on loopback (no mocks)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from runtime.recipe.loader import ResolvedRecipe
from runtime.transport.dataplane import open_consumer, open_producer
from runtime.transport.endpoints import Endpoints
from runtime.transport.errors import IdleTimeoutError, MasterStartError, StoreFullError, StoreSetupError
from runtime.transport.loopback import free_port, loopback_endpoints, loopback_master, loopback_recipe, transport_of
from runtime.transport.master import MasterProcess
from runtime.transport.settings import TransportSettings
from runtime.transport.synthetic import SampleShape, synthetic_sample

pytestmark = pytest.mark.mooncake

REPO = Path(__file__).resolve().parent.parent

FAST = [
    "transport.poll_interval_s=0.02",
    "transport.retry_backoff_s=0.05",
    "transport.max_retries=3",
    "transport.heartbeat_interval_s=0.5",
    "transport.wait_log_interval_s=5",
    "transport.connect_timeout_s=20",
    "transport.idle_timeout_s=60",
    "transport.kv_lease_ttl_s=5",
]
ONE_RANK = [
    "job.trainer.tasks_per_node=1",
    "trainer.gradient_accumulation_steps=4",
    "trainer.global_batch_size=4",
    "transport.high_watermark_samples=8",
    "transport.low_watermark_samples=4",
]


@pytest.fixture(scope="module")
def ports() -> tuple[int, int, int]:
    return (free_port(), free_port(), free_port())


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory, ports: tuple[int, int, int]):
    resolved = loopback_recipe(tmp_path_factory.mktemp("master"), ports, FAST + ONE_RANK)
    with loopback_master(resolved) as process:
        yield process


def _plane(tmp_path: Path, ports: tuple[int, int, int], name: str, extra: list[str] | None = None) -> ResolvedRecipe:
    return loopback_recipe(tmp_path, ports, [*FAST, *ONE_RANK, f"transport.store_id={name}", *(extra or [])])


def _sample(g: int, tokens: int, hidden: int = 256, n_aux: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(g)
    return {
        "ids": torch.randint(0, 2048, (tokens,), generator=gen, dtype=torch.int64),
        "mask": (torch.rand(tokens, generator=gen) > 0.5).to(torch.uint8),
        "hs": torch.randn(tokens, n_aux * hidden, generator=gen).to(torch.bfloat16),
        "lhs": torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16),
    }


def test_round_trip_of_all_four_fields_is_exact(master: MasterProcess, tmp_path: Path, ports) -> None:
    resolved = _plane(tmp_path, ports, "roundtrip")
    endpoints = loopback_endpoints(resolved)
    with (
        open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints) as producer,
        open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer,
    ):
        for tokens in (37, 256):
            g = producer.next_to_capture()
            sent = _sample(g, tokens)
            written = producer.commit(g, sent, {"epoch": 0, "row_id": f"row{g}", "T": tokens})
            got = consumer.fetch(g)
            assert got.g == g and got.meta["row_id"] == f"row{g}" and got.meta["T"] == tokens
            for name, tensor in sent.items():
                received = getattr(got, name)
                assert received.dtype == tensor.dtype and received.shape == tensor.shape
                assert torch.equal(received, tensor), name
                assert received.data_ptr() != tensor.data_ptr()
            assert written == got.meta["sample_bytes"] + len(
                json.dumps(got.meta, separators=(",", ":"), sort_keys=True)
            )
            assert got.meta["fields"]["hs"]["bytes"] == tokens * 3 * 256 * 2


def test_recapture_is_an_idempotent_upsert(master: MasterProcess, tmp_path: Path, ports) -> None:
    resolved = _plane(tmp_path, ports, "upsert")
    endpoints = loopback_endpoints(resolved)
    with (
        open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints) as producer,
        open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer,
    ):
        first = _sample(0, 50)
        producer.commit(0, first, {})
        assert torch.equal(consumer.fetch(0).hs, first["hs"])
        producer.commit(0, first, {})  # same content again (a re-capture): still readable, same bytes
        assert torch.equal(consumer.fetch(0).hs, first["hs"])
        other = _sample(99, 80)  # a different size replaces it too (Mooncake's put would keep the old one)
        producer.commit(0, other, {})
        again = consumer.fetch(0)
        assert again.ids.shape == (80,) and torch.equal(again.lhs, other["lhs"])


def _visibility_reader(recipe_path: str, count: int, out_path: str) -> None:
    """Runs in a separate process: poll the five keys of each sample while the producer writes."""
    from runtime.recipe.loader import load_resolved
    from runtime.transport.sample_format import sample_keys
    from runtime.transport.store import StoreClient

    resolved = load_resolved(recipe_path)
    client = StoreClient(
        TransportSettings.from_recipe(resolved.recipe).client(loopback_endpoints(resolved), 0)
    ).connect()
    from runtime.transport.consumer import Consumer

    consumer = Consumer(client, TransportSettings.from_recipe(resolved.recipe).consumer, 0, 1)
    polls = partial_seen = violations = 0
    fetched = []
    for g in range(count):
        keys = sample_keys(resolved.recipe.store_id, g)
        while True:
            flags = client.exist(keys)
            polls += 1
            if flags[-1]:
                violations += not all(flags[:-1])
                break
            partial_seen += any(flags[:-1])
        sample = consumer.fetch(g)  # checks sizes and CRC-32 of every field
        fetched.append([g, int(sample.ids.shape[0]), float(sample.hs.float().sum())])
    Path(out_path).write_text(
        json.dumps({"polls": polls, "partial_seen": partial_seen, "violations": violations, "fetched": fetched})
    )
    client.close()


@pytest.mark.slow
def test_meta_last_a_concurrent_reader_never_sees_meta_without_tensors(
    master: MasterProcess, tmp_path: Path, ports
) -> None:
    resolved = _plane(tmp_path, ports, "visibility", ["transport.high_watermark_samples=16"])
    endpoints = loopback_endpoints(resolved)
    count = 12
    out = tmp_path / "reader.json"
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); "
        "from tests.test_transport_store import _visibility_reader; "
        f"_visibility_reader({str(resolved.path)!r}, {count}, {str(out)!r})"
    )
    with (
        open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints) as producer,
        open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0),
    ):
        reader = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
        sent = {}
        for _ in range(count):
            g = producer.wait_next(timeout_s=30)[0]
            sent[g] = _sample(g, 1024 + 256 * g)  # 1.5-6 MiB of hs each: the writes take a while
            producer.commit(g, sent[g], {})
        assert reader.wait(timeout=120) == 0
    report = json.loads(out.read_text())
    assert report["violations"] == 0
    assert [row[0] for row in report["fetched"]] == list(range(count))
    for g, tokens, hs_sum in report["fetched"]:
        assert tokens == sent[g]["ids"].shape[0]
        assert hs_sum == pytest.approx(float(sent[g]["hs"].float().sum()))
    assert report["polls"] >= count


def test_full_segment_put_fails_with_a_clear_error(master: MasterProcess, tmp_path: Path, ports) -> None:
    resolved = _plane(tmp_path, ports, "full", ["transport.max_retries=1"])
    endpoints = loopback_endpoints(resolved)
    with open_producer(
        transport_of(resolved), resolved.job_dir, endpoints=endpoints, segment_bytes=16 << 20
    ) as producer:  # Mooncake's minimum
        with pytest.raises(StoreFullError, match="no room in the store for sample g=0"):
            producer.commit(0, _sample(0, 12_000), {})  # 18 MB of hs into a 16 MiB segment
        assert producer.stats()["errors"] == 1
        assert producer.next_to_capture() == 0  # the failed g is offered again


def test_setup_error_names_address_port_and_protocol(tmp_path: Path) -> None:
    dead = (free_port(), free_port(), free_port())
    resolved = loopback_recipe(tmp_path, dead, [*FAST, "transport.connect_timeout_s=1"])
    with pytest.raises(StoreSetupError) as info:
        open_consumer(transport_of(resolved), 0, 4, endpoints=loopback_endpoints(resolved))
    message = str(info.value)
    assert f"RPC port 127.0.0.1:{dead[0]} does not accept connections" in message
    assert "transport.connect_timeout_s" in message
    # an address that is not this node's (Mooncake itself would accept it and fail much later)
    loop = loopback_endpoints(resolved)
    foreign = Endpoints(loop.master_address, loop.metadata_url, "10.255.255.1")
    with pytest.raises(StoreSetupError) as info:
        open_consumer(transport_of(resolved), 0, 4, endpoints=foreign)
    message = str(info.value)
    assert "bind address 10.255.255.1 is not an address of this node" in message
    assert f"master 127.0.0.1:{dead[0]}" in message and "protocol tcp" in message


def test_master_start_stop_and_a_busy_port_is_named(tmp_path: Path) -> None:
    ports = (free_port(), free_port(), free_port())
    resolved = loopback_recipe(tmp_path, ports, FAST)
    settings = TransportSettings.from_recipe(resolved.recipe).master("127.0.0.1")
    master = MasterProcess(settings, tmp_path / "m.log").start()
    assert master.check() == ""
    assert master.stop() is not None and master.process.poll() is not None
    with socket.socket() as blocker:
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the stopped master's port is in TIME_WAIT
        blocker.bind(("127.0.0.1", ports[2]))
        blocker.listen()
        with pytest.raises(MasterStartError) as info:
            MasterProcess(settings, tmp_path / "m2.log").start()
    message = str(info.value)
    assert f"port {ports[2]} (transport.metrics_port) on 127.0.0.1 is already in use" in message


GLOG_NOISE = re.compile(r"WARNING|Logging before InitGoogleLogging|^[WE]\d{4} ", re.MULTILINE)
"""A WARNING or ERROR a healthy run must not print: glog's preamble, or a W/E-level glog line."""


def test_a_healthy_master_client_and_status_print_no_warning(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The master's log, a store client's native output (fd 2: a component's native_*.log) and the
    ``runtime.transport status`` console hold no WARNING and no glog W/E line when all is well."""
    import os

    from runtime.transport.loopback import loopback_env

    resolved = loopback_recipe(tmp_path, (free_port(), free_port(), free_port()), [*FAST, *ONE_RANK])
    with (
        loopback_master(resolved, tmp_path / "mooncake_master.log"),
        open_producer(transport_of(resolved), resolved.job_dir, endpoints=loopback_endpoints(resolved)) as producer,
    ):
        producer.heartbeat()
        native = capfd.readouterr().err
        assert "Mounting segment" in native, "the client's INFO lines still reach fd 2"
        status = subprocess.run(
            [sys.executable, "-m", "runtime.transport", "status", "--recipe", str(resolved.path)],
            cwd=REPO,
            env={**os.environ, **loopback_env(resolved), "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert status.returncode == 0 and "producer heartbeat" in status.stdout, status.stderr
    master_log = (tmp_path / "mooncake_master.log").read_text()
    assert "Master service started" in master_log
    for where, text in (("client fd 2", native), ("status stderr", status.stderr), ("master log", master_log)):
        assert not GLOG_NOISE.search(text), f"{where}: {text[-3000:]}"
    assert not re.search(r"^I\d{4} ", status.stderr, re.MULTILINE), status.stderr


def test_held_native_output_keeps_every_line_of_a_failed_setup(capfd: pytest.CaptureFixture[str]) -> None:
    """A healthy setup leaves out its known lookup lines only; a failed one writes all it held."""
    import os

    from runtime.native_log import held_native_output

    lookup = b"E1205 07:14:37.242424 417 transfer_metadata_plugin.cpp:292] GET http://h/m http=404 body: metadata not found\n"
    other = b"E1205 07:14:37.300000 417 real_client.cpp:1] something real\n"
    with held_native_output() as held:
        os.write(2, lookup + other)
        held.healthy = True
    assert capfd.readouterr().err == other.decode()
    with held_native_output():
        os.write(2, lookup + other)
    assert capfd.readouterr().err == (lookup + other).decode()


@pytest.mark.slow
def test_idle_timeout_names_the_sample_and_the_heartbeat_age(master: MasterProcess, tmp_path: Path, ports) -> None:
    resolved = _plane(tmp_path, ports, "idle", ["transport.idle_timeout_s=1.5"])
    endpoints = loopback_endpoints(resolved)
    with open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer:
        with pytest.raises(IdleTimeoutError) as info:
            consumer.fetch(5)
        message = str(info.value)
        assert "(transport.idle_timeout_s = 1.5) for sample g=5 (key idle/s/000000000005/meta)" in message
        assert "its meta (the commit marker) is not in the store yet" in message
        assert "no producer heartbeat in the store" in message
        # now a producer that beat once and then went silent (hung engine)
        with open_producer(
            transport_of(resolved), resolved.job_dir, endpoints=endpoints, auto_heartbeat=False
        ) as producer:
            producer.refresh()  # takes the cursor the trainer published
            producer.heartbeat({"engine": "test"})
            with pytest.raises(IdleTimeoutError) as info:
                consumer.fetch(5)
        message = str(info.value)
        age = float(re.search(r"producer heartbeat ([0-9.]+) s old", message).group(1))
        assert age >= 1.5
        assert "cursor in the store: 0" in message and "window [0, 8)" in message


def _drain(producer, limit: int = 100) -> list[int]:
    """Claim and commit until the producer pauses; returns the g committed."""
    done = []
    while len(done) < limit:
        g = producer.next_to_capture()
        if g is None:
            break
        producer.commit(g, _sample(g, 256), {})
        done.append(g)
    return done


@pytest.mark.slow
def test_producer_pauses_at_high_watermark_and_resumes_below_low(master: MasterProcess, tmp_path: Path, ports) -> None:
    resolved = _plane(tmp_path, ports, "wm_samples")  # high 8, low 4, G 4
    endpoints = loopback_endpoints(resolved)
    with (
        open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints) as producer,
        open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer,
    ):
        assert _drain(producer) == list(range(8))
        stats = producer.stats()
        assert stats["paused"] and stats["resident_samples"] == 8
        for step in range(2):
            for g in consumer.samples_of_step(step):
                consumer.fetch(g)
            consumer.commit_step(step)
            stats_before = producer.stats()
            committed = _drain(producer)
            if step == 0:  # 4 resident is not below the low watermark 4: still paused
                assert committed == [] and producer.stats()["paused"]
                assert stats_before["resident_samples"] == 8  # deletion not yet reconciled
            else:  # nothing resident any more: resumed, refilled the new window [8, 16)
                assert committed == list(range(8, 16))
        assert producer.stats()["cursor"] == 8 and consumer.read_cursor().value == 8


@pytest.mark.slow
def test_producer_pauses_at_byte_watermark_and_resumes_below_low_bytes(
    master: MasterProcess, tmp_path: Path, ports
) -> None:
    # about 528 KB per sample at T=256: pause at the 6th (>= 3.0 MB), resume below 2.0 MB
    extra = [
        "transport.high_watermark_samples=32",
        "transport.low_watermark_samples=16",
        "transport.high_watermark_bytes=3000000",
        "transport.low_watermark_bytes=2000000",
    ]
    resolved = _plane(tmp_path, ports, "wm_bytes", extra)
    endpoints = loopback_endpoints(resolved)
    with (
        open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints) as producer,
        open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer,
    ):
        assert _drain(producer) == list(range(6))
        stats = producer.stats()
        assert stats["paused"] and stats["resident_samples"] == 6 and stats["resident_bytes"] >= 3_000_000
        for g in consumer.samples_of_step(0):
            consumer.fetch(g)
        consumer.commit_step(0)
        assert _drain(producer) == list(range(6, 10))  # 2 left (~1.06 MB) < 2.0 MB: resumed until 6 again
        assert producer.stats()["paused"]


def test_synthetic_samples_are_deterministic() -> None:
    from runtime.recipe import load_recipe

    recipe = load_recipe(REPO / "recipes" / "tiny.yaml").recipe
    shape = SampleShape(recipe.capture.vocab_size, recipe.capture.hidden_size, recipe.num_aux_layers)
    a, b = synthetic_sample(11, shape), synthetic_sample(11, shape)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(synthetic_sample(12, shape)["hs"][:4], a["hs"][:4])


@pytest.mark.slow
def test_consumer_wait_logs_name_the_sample_and_the_producer(
    master: MasterProcess, tmp_path: Path, ports, caplog
) -> None:
    resolved = _plane(tmp_path, ports, "waitlog", ["transport.wait_log_interval_s=0.2", "transport.idle_timeout_s=5"])
    endpoints = loopback_endpoints(resolved)
    with (
        open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints) as producer,
        open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer,
    ):
        timer = threading.Timer(1.0, lambda: producer.commit(producer.next_to_capture(), _sample(0, 20), {}))
        timer.start()
        with caplog.at_level("INFO", logger="dspark.transport.consumer"):
            sample = consumer.fetch(0)
        timer.join()
    assert sample.ids.shape == (20,)
    lines = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert lines and "for sample g=0 (its meta (the commit marker) is not in the store yet)" in lines[0]
    assert "producer heartbeat" in lines[0]


def _transport_status(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python3 -m runtime.transport status ARGS`` from the repository, with ``env``."""
    return subprocess.run(
        [sys.executable, "-m", "runtime.transport", "status", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_cli_master_and_status(tmp_path: Path) -> None:
    import os
    import signal

    from runtime.transport.loopback import loopback_env

    # Two capture nodes: the status shows each capture share's heartbeat.
    sets = [*FAST, *ONE_RANK, "job.capture.nodes=2", "trainer.feature_cache.enabled=true"]
    sets.append(f"trainer.feature_cache.dir={tmp_path / 'cache'}")
    resolved = loopback_recipe(tmp_path, (free_port(), free_port(), free_port()), sets)
    env = {**os.environ, **loopback_env(resolved), "PYTHONPATH": str(REPO)}
    master = subprocess.Popen(
        [sys.executable, "-m", "runtime.transport", "master", "--recipe", str(resolved.path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert "mooncake_master ready" in master.stdout.readline()
        endpoints = loopback_endpoints(resolved)
        with (
            open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints, share=(0, 2)) as producer,
            open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints, share=(1, 2)) as second,
            open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer,
        ):
            consumer.ask_for([5])  # what a trainer rank with a feature cache does for a row it lacks
            for _ in range(3):
                producer.commit(producer.next_to_capture(), _sample(0, 16), {})  # g = 0, 2, 4: share 0's
            producer.heartbeat()
            second.heartbeat()
            # As on the login node (RUNBOOK section 8): none of the job's variables, only its folder,
            # where the master recorded its endpoints.
            login = {k: v for k, v in env.items() if not k.startswith(("DSPARK_", "MC_"))}
            out = _transport_status(["--job", str(resolved.path.parent)], login)
            inside = _transport_status(["--recipe", str(resolved.path)], env)
        assert inside.returncode == 0 and "store tiny: cursor 0" in inside.stdout, inside.stderr[-2000:]
        assert out.returncode == 0, out.stderr[-2000:]
        assert "store tiny: cursor 0 (step 0, by rank 0" in out.stdout
        assert "window [0, 8): 3 committed, first missing g=1" in out.stdout
        shares = [line for line in out.stdout.splitlines() if line.startswith("capture share ")]
        assert [line[:20] for line in shares] == ["capture share 0 of 2", "capture share 1 of 2"], out.stdout
        assert all("producer heartbeat" in line for line in shares) and "resident 3 samples" in shares[0]
        assert "feature cache: 1 sample(s) of the window asked for by trainer ranks" in out.stdout
    finally:
        master.send_signal(signal.SIGTERM)
        assert master.wait(timeout=30) == 0
    # An ended job: one line from its status files, whether its master marked the end or died without a
    # word (nothing answers at its port). The line's words name the path that answers before any store
    # client starts (no time bound here: on a loaded 2-core CI machine the command took 11 s).
    login = {k: v for k, v in env.items() if not k.startswith(("DSPARK_", "MC_"))}
    record_file = resolved.path.parent / "transport" / "endpoints.json"
    for marked in (True, False):
        if not marked:
            record = json.loads(record_file.read_text())
            record.pop("ended_at")
            record_file.write_text(json.dumps(record))
        ended = _transport_status(["--job", str(resolved.path.parent)], login)
        said = "the job has ended" if marked else "no mooncake_master answers at"
        assert ended.returncode == 1 and said in ended.stdout and len(ended.stdout.splitlines()) == 1, ended
        assert "Traceback" not in ended.stderr
    # A job whose master never recorded its endpoints: one line saying so, no traceback.
    record_file.unlink()
    missing = subprocess.run(
        [sys.executable, "-m", "runtime.transport", "status", "--job", str(resolved.path.parent)],
        cwd=REPO,
        env=login,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "has not started its Mooncake master" in missing.stderr, missing.stderr
    assert "Traceback" not in missing.stderr


@pytest.mark.gpu
def test_round_trip_from_and_to_cuda_is_exact(master: MasterProcess, tmp_path: Path, ports) -> None:
    resolved = _plane(tmp_path, ports, "cuda")
    endpoints = loopback_endpoints(resolved)
    with (
        open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints) as producer,
        open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer,
    ):
        for tokens in (64, 2048):
            g = producer.next_to_capture()
            sent = {k: v.cuda() for k, v in _sample(g, tokens).items()}  # D2H through pinned staging
            producer.commit(g, sent, {})
            got = consumer.fetch(g, device="cuda")  # pinned staging, then H2D
            for name, tensor in sent.items():
                received = getattr(got, name)
                assert received.is_cuda and torch.equal(received, tensor), name


def test_a_corrupt_field_is_detected_and_named(master: MasterProcess, tmp_path: Path, ports) -> None:
    from runtime.transport.errors import CorruptSampleError

    resolved = _plane(tmp_path, ports, "corrupt", ["transport.max_retries=1"])
    endpoints = loopback_endpoints(resolved)
    with (
        open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints) as producer,
        open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer,
    ):
        sample = _sample(0, 64)
        producer.commit(producer.next_to_capture(), sample, {})
        bad = sample["lhs"].clone()
        bad[10, 3] += 1  # same size, one value changed, written behind the meta's back
        producer.client.put_tensors(["corrupt/s/000000000000/lhs"], [bad])
        with pytest.raises(CorruptSampleError, match="sample g=0: field lhs differs from what was committed"):
            consumer.fetch(0)


def _owner(client, key: str) -> str:
    replica = client.raw.get_replica_desc(key)[0]
    return replica.get_memory_descriptor().buffer_descriptor.transport_endpoint


@pytest.mark.slow
def test_writers_place_samples_in_the_producer_segment_and_the_cursor_in_rank0s(
    master: MasterProcess, tmp_path: Path, ports
) -> None:
    from runtime.transport.sample_format import sample_keys

    resolved = _plane(tmp_path, ports, "placement")
    endpoints = loopback_endpoints(resolved)
    with (
        open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints) as owner,
        open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer,
        open_producer(
            transport_of(resolved),
            resolved.job_dir,
            endpoints=endpoints,
            segment_bytes=0,
            auto_heartbeat=False,
            start_cursor=None,
        ) as sink,
    ):
        owner.heartbeat()  # names the owner's segment
        for g in range(6):  # like the SGLang sink: a second process-like writer without a segment
            (sink if g % 2 else owner).commit(g, _sample(g, 32), {})
        assert sink.client.preferred_segment == owner.client.hostname
        for g in range(6):
            for key in sample_keys("placement", g):
                assert _owner(consumer.client, key) == owner.client.hostname, key
        assert _owner(consumer.client, "placement/cursor") == consumer.client.hostname
        assert consumer.fetch(3).g == 3


def test_sum16_checksums_from_the_capture_side_are_verified_by_the_reader(
    master: MasterProcess, tmp_path: Path, ports
) -> None:
    from runtime.transport.checksum import sum16_values
    from runtime.transport.errors import CorruptSampleError

    resolved = _plane(tmp_path, ports, "sum16", ["transport.max_retries=1"])
    endpoints = loopback_endpoints(resolved)
    with (
        open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints) as producer,
        open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer,
    ):
        sample = _sample(0, 65)
        checksums = {name: sum16_values(sample[name]) for name in ("hs", "lhs")}
        producer.commit(producer.next_to_capture(), sample, {}, checksums=checksums)
        got = consumer.fetch(0)
        assert got.meta["fields"]["hs"]["sum16"] == list(checksums["hs"]) and got.meta["fields"]["hs"]["crc32"] is None
        assert got.meta["fields"]["ids"]["crc32"] is not None  # fields without one get CRC-32s as before
        for name, tensor in sample.items():
            assert torch.equal(getattr(got, name), tensor), name
        bad = sample["hs"].clone()
        bad[64, 0] = 3.0 if bad[64, 0] != 3.0 else 4.0
        producer.client.put_tensors(["sum16/s/000000000000/hs"], [bad])
        with pytest.raises(CorruptSampleError, match=r"sample g=0: field hs differs .*sum16 checksum on cpu"):
            consumer.fetch(0)


@pytest.mark.gpu
def test_pipelined_cuda_commit_is_exact_and_verified_on_the_gpu(master: MasterProcess, tmp_path: Path, ports) -> None:
    from runtime.capture.commit_pipeline import CommitPipeline

    resolved = _plane(tmp_path, ports, "piped")
    endpoints = loopback_endpoints(resolved)
    with (
        open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints) as producer,
        open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer,
    ):
        pipeline = CommitPipeline(producer, slots=2)
        sent = {}
        try:
            for tokens in (64, 2048, 3000):
                g = producer.next_to_capture()
                sample = _sample(g, tokens)
                sent[g] = sample
                pipeline.submit(g, {**sample, "hs": sample["hs"].cuda(), "lhs": sample["lhs"].cuda()}, {})
            results = pipeline.drain(timeout_s=120)
        finally:
            pipeline.close()
        assert [r.error for r in results] == [None] * 3
        for g, sample in sent.items():
            got = consumer.fetch(g, device="cuda")
            assert got.meta["fields"]["lhs"]["sum16"] is not None
            for name, tensor in sample.items():
                assert torch.equal(getattr(got, name).cpu(), tensor), (g, name)


def test_sample_segment_on_the_trainer_node(master: MasterProcess, tmp_path: Path, ports) -> None:
    """transport.segment_placement: trainer: the producer mounts nothing and waits for rank 0's cursor;
    rank 0 mounts the whole sample segment, so every sample lands there and reads back exactly."""
    from runtime.transport.dataplane import CONTROL_SEGMENT_BYTES

    resolved = _plane(tmp_path, ports, "ontrainer", ["transport.segment_placement=trainer"])
    endpoints = loopback_endpoints(resolved)
    with open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer:
        assert consumer.client.settings.segment_bytes == CONTROL_SEGMENT_BYTES + 256 * 2**20
        with open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints) as producer:
            assert producer.client.settings.segment_bytes == 0 and producer.client.preferred_segment == ""
            for g in range(3):
                sent = _sample(g, 4096)
                producer.commit(g, sent, {})
                assert torch.equal(consumer.fetch(g).hs, sent["hs"])


@pytest.mark.slow
def test_sample_segment_split_over_both_nodes_holds_more_than_either_half(
    master: MasterProcess, tmp_path: Path, ports
) -> None:
    """transport.segment_placement: split: 128 MiB on each side and no write pinning, so five 34 MB
    samples (168 MB, more than the capture node's half) are all stored and read back exactly."""
    resolved = _plane(tmp_path, ports, "split", ["transport.segment_placement=split"])
    endpoints = loopback_endpoints(resolved)
    with (
        open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints) as producer,
        open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as consumer,
    ):
        assert producer.client.settings.segment_bytes == 128 * 2**20 and producer.client.preferred_segment == ""
        sent = {g: _sample(g, 16384) for g in range(5)}
        written = sum(producer.commit(g, sample, {}) for g, sample in sent.items())
        assert written > 128 * 2**20
        for g, sample in sent.items():
            got = consumer.fetch(g)
            assert torch.equal(got.hs, sample["hs"]) and torch.equal(got.lhs, sample["lhs"])


def test_rank0_leaving_before_the_producer_knows_the_run_ended_is_no_warning(
    master: MasterProcess, tmp_path: Path, ports, caplog: pytest.LogCaptureFixture
) -> None:
    """The end of a healthy run when the trainer leaves before the capture loop saw its last step:
    the next beat aimed at rank 0's segment lands elsewhere. With rank 0's cursor gone too, that is
    the run's end, said at INFO; it used to be a WARNING ("not mounted now?") on every such run."""
    import logging

    resolved = _plane(tmp_path, ports, "leaving")
    endpoints = loopback_endpoints(resolved)
    with open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints, auto_heartbeat=False) as producer:
        with open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints, start_cursor=0) as rank0:
            producer.heartbeat()
            assert producer.heartbeat_writer.rank0_segment == rank0.client.hostname, "beats aim at rank 0"
            assert _owner(producer.client, "leaving/heartbeat") == rank0.client.hostname
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dspark"):
            producer.heartbeat()  # rank 0 has left with its segment and the cursor in it
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("trainer rank 0 has left" in r.getMessage() for r in caplog.records), caplog.text
        assert producer.heartbeat_writer.rank0_segment == ""
        assert _owner(producer.client, "leaving/heartbeat") == producer.client.hostname, "beat kept"
