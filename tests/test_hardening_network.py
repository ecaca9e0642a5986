"""Issue 15, item 1: every listener we start binds the configured bind address (loopback here).

The Mooncake master (RPC, metrics), the HTTP metadata service next to it, the trainer's rendezvous
store and gloo's pair sockets are checked with psutil while they run, and the metadata service's
protocol (what Mooncake clients speak) is exercised for real.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import psutil
import pytest

from runtime.transport.loopback import loopback_master, loopback_recipe
from runtime.transport.metadata_server import MetadataServer
from tests.conftest import free_port

REPO = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"


def listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on."""
    return {
        (c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN
    }


@pytest.mark.mooncake
def test_master_and_metadata_service_listen_only_on_the_bind_address(tmp_path: Path) -> None:
    ports = (free_port(), free_port(), free_port())
    resolved = loopback_recipe(tmp_path, ports)
    with loopback_master(resolved) as master:
        assert master.metadata_process is not None, "the metadata service runs next to the master"
        found = listeners(master.pid) | listeners(master.metadata_process.pid)
    assert {port for _, port in found} >= set(ports), found
    assert {address for address, _ in found} == {LOOPBACK}, f"a listener is not on {LOOPBACK}: {found}"


def test_metadata_service_speaks_mooncakes_protocol_and_refuses_wildcards() -> None:
    server = MetadataServer(LOOPBACK, 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]

        def call(method: str, key: str, body: bytes | None = None) -> tuple[int, bytes]:
            conn = http.client.HTTPConnection(LOOPBACK, port, timeout=5)
            conn.request(method, f"/metadata?key={key}", body=body)
            resp = conn.getresponse()
            return resp.status, resp.read()

        assert call("GET", "mooncake/ram/a")[0] == 404
        assert call("PUT", "mooncake/ram/a", b'{"x": 1}')[0] == 200
        assert call("GET", "mooncake/ram/a") == (200, b'{"x": 1}')
        assert call("DELETE", "mooncake/ram/a")[0] == 200
        assert call("DELETE", "mooncake/ram/a")[0] == 404
        assert call("GET", "")[0] == 400
    finally:
        server.shutdown()
        server.server_close()
    for wildcard in ("", "0.0.0.0", "::"):
        with pytest.raises(ValueError, match="every interface"):
            MetadataServer(wildcard, 0)


RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import psutil, torch, torch.distributed as dist
    from runtime.trainer.distributed import init_process_group
    from runtime.trainer.settings import RunSettings

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    settings = RunSettings(
        rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"), param_dtype=torch.float32,
        reduce_dtype=torch.float32, attention_backend="sdpa", num_rows=1, total_steps=1, chunk_rows=1,
        job_dir=Path("."), checkpoint_dir=Path("."), data_digest="", smoke=False,
        master_addr="127.0.0.1", master_port=port, bind_address="127.0.0.1",
    )
    init_process_group(settings, 60)
    t = torch.ones(1)
    dist.all_reduce(t)
    found = sorted({c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN})
    dist.barrier()
    print(json.dumps({"sum": t.item(), "listen": found}))
    dist.destroy_process_group()
    """
)


@pytest.mark.distributed
def test_trainer_rendezvous_and_gloo_listen_only_on_the_bind_address() -> None:
    port = free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(rank), str(port)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    for rank, (out, err) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, err[-3000:]
        record = json.loads(out.strip().splitlines()[-1])
        assert record["sum"] == 2.0
        assert record["listen"] == [LOOPBACK], f"rank listens on {record['listen']}"


def _rank0_settings(port: int) -> object:
    import torch

    from runtime.trainer.settings import RunSettings

    return RunSettings(
        rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), param_dtype=torch.float32,
        reduce_dtype=torch.float32, attention_backend="sdpa", num_rows=1, total_steps=1, chunk_rows=1,
        job_dir=REPO, checkpoint_dir=REPO, data_digest="x", smoke=False, master_port=port,
    )  # fmt: skip


def test_a_held_rendezvous_port_is_named_unless_torchruns_agent_serves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime as dt

    import torch.distributed as dist

    from runtime.trainer.distributed import rendezvous_store

    port = free_port()
    # Another process's store holds the port (under torchrun: the elastic agent's).
    holder = dist.TCPStore(LOOPBACK, port, None, True, timeout=dt.timedelta(seconds=10), wait_for_workers=False)
    holder.set("from-the-holder", "1")
    settings = _rank0_settings(port)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(RuntimeError, match=rf"cannot listen on {LOOPBACK}:{port}.*job.master_port"):
        rendezvous_store(settings, 10.0)  # type: ignore[arg-type]
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    joined = rendezvous_store(settings, 10.0)  # type: ignore[arg-type]
    assert joined.get("from-the-holder") == b"1"  # a client of the holder's store, not a second server
