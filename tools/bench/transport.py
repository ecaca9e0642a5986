"""Data-plane benchmark: per-sample put + get of K3-shaped samples through a real Mooncake store.

The layout is production's: this process is the producer (its client owns the global segment, so
its puts take Mooncake's same-process copy path) and a second process is a trainer rank that
reads over TCP (loopback here, the network between nodes in production). Every number is also
given as a ratio to a memcpy of the same bytes timed in the same run, and each sample's latency
is broken down into where the time goes: client setup (once), serialisation (CRC-32 per field +
meta JSON), buffer registration, the put, the get, destination allocation (first-touch page
faults), checksum verification and, with ``--device cuda``, the device<->pinned-host copies.

Besides the production path it times the choices that move the numbers: a put from a process that
does NOT own the segment (TCP instead of the local copy), one batched get of the four fields vs
four single gets, fresh vs reused destination buffers, and the raw loopback TCP bandwidth between
two processes (the ceiling of any TCP transfer on this machine).

    python3 -m tools.bench.transport                       # T = 256, 1024, 3072 at H = 7168
    python3 -m tools.bench.transport --tokens 1024,8192,65536 --reps 3 --device cuda   # H200 box

K3 shapes: n_aux = 5, H = 7,168, so one token is 86,025 bytes and T = 65,536 is 5.25 GiB. On a
small machine the benchmark scales T (never H); ``--hidden`` exists to scale H if memory says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from runtime.user_errors import exit_without_package  # noqa: E402

try:  # a stock python3 instead of the venv's: one line, not a traceback
    import torch

    from runtime.transport.endpoints import Endpoints
    from runtime.transport.loopback import free_port
    from runtime.transport.master import MasterProcess, MasterSettings
    from runtime.transport.sample_format import build_meta, byte_view, crc32_chunks, describe_field, encode_meta
    from runtime.transport.settings import ClientSettings
    from runtime.transport.store import StoreClient
except ModuleNotFoundError as _missing:
    exit_without_package(_missing, "tools.bench.transport")

FIELDS = ("ids", "mask", "hs", "lhs")
GB = 1e9
MIB = 2**20


def median_time(fn: Callable[[], Any], reps: int, before: Callable[[], Any] | None = None) -> float:
    """Median wall time of ``reps`` calls of ``fn`` (``before`` runs untimed ahead of each)."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_sample(tokens: int, hidden: int, n_aux: int, device: str) -> dict[str, torch.Tensor]:
    """A K3-shaped sample (random values; the transport does not care)."""
    gen = torch.Generator().manual_seed(tokens)
    sample = {
        "ids": torch.randint(0, 163_840, (tokens,), generator=gen, dtype=torch.int64),
        "mask": torch.ones(tokens, dtype=torch.uint8),
        "hs": torch.empty(tokens, n_aux * hidden, dtype=torch.bfloat16).normal_(generator=gen),
        "lhs": torch.empty(tokens, hidden, dtype=torch.bfloat16).normal_(generator=gen),
    }
    return {k: v.to(device) for k, v in sample.items()}


def nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor."""
    return t.numel() * t.element_size()


def client_settings(endpoints: Endpoints, segment_bytes: int, local_buffer_bytes: int) -> ClientSettings:
    """Bench clients: the recipe defaults that matter, explicit."""
    return ClientSettings(
        endpoints=endpoints,
        segment_bytes=segment_bytes,
        local_buffer_bytes=local_buffer_bytes,
        transfer_timeout_s=300,
        max_retries=2,
        retry_backoff_s=0.2,
        connect_timeout_s=30,
    )


# ---------------------------------------------------------------------------------------------
# the reader process (a trainer rank)
# ---------------------------------------------------------------------------------------------


def reader_main(master: str, metadata: str, device: str) -> int:
    """Serve timing commands from stdin (JSON lines) as a separate process without a segment."""
    endpoints = Endpoints(master, metadata, "127.0.0.1")
    client = StoreClient(client_settings(endpoints, 0, 64 * MIB), name="reader").connect()
    print(json.dumps({"ready": True, "setup_s": client.setup_s}), flush=True)
    reused: dict[str, torch.Tensor] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        out = reader_command(client, cmd, device, reused)
        print(json.dumps(out), flush=True)
    client.close()
    return 0


def reader_command(client: StoreClient, cmd: dict[str, Any], device: str, reused: dict[str, torch.Tensor]) -> dict:
    """Time one get variant (or a remote put) and return the medians."""
    keys, shapes, dtypes, reps = cmd["keys"], cmd["shapes"], cmd["dtypes"], cmd["reps"]
    torch_dtypes = [getattr(torch, d) for d in dtypes]
    sizes = [
        int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size()
        for s, d in zip(shapes, torch_dtypes, strict=True)
    ]
    store = client.raw
    if cmd["op"] == "put_remote":
        src = [torch.ones(s, dtype=d) for s, d in zip(shapes, torch_dtypes, strict=True)]
        with client.registered([byte_view(t) for t in src]):

            def put() -> None:
                codes = store.batch_upsert_from(keys, [t.data_ptr() for t in src], sizes)
                assert all(c == 0 for c in codes), codes

            put()  # the first put pays for fresh allocations in the owner's segment; time warm ones
            return {"put_s": median_time(put, reps)}
    phases: dict[str, list[float]] = {k: [] for k in ("alloc_s", "get_s", "verify_s", "h2d_s", "total_s")}
    for _ in range(reps):
        t0 = time.perf_counter()
        if cmd["op"] == "get_fresh":  # the Consumer's CPU path: fresh tensors the caller owns
            dst = [torch.empty(s, dtype=d) for s, d in zip(shapes, torch_dtypes, strict=True)]
            for t in dst:
                byte_view(t).fill_(0)  # first touch, as a consumer writing into new memory pays it
        else:  # reused registered buffers (the Consumer's CUDA path stages through these)
            key = "pinned" if device == "cuda" else "host"
            dst = []
            for name, s, d in zip(FIELDS, shapes, torch_dtypes, strict=True):
                need = int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size()
                buf = reused.get(f"{key}/{name}")
                if buf is None or buf.numel() < need:
                    buf = torch.empty(need, dtype=torch.uint8, pin_memory=(device == "cuda"))
                    buf.fill_(0)
                    reused[f"{key}/{name}"] = buf
                dst.append(buf[:need].view(d).view(s))
        t1 = time.perf_counter()
        ptrs = [byte_view(t).data_ptr() for t in dst]  # not registered: TCP needs none (as in the runtime)
        t2 = time.perf_counter()
        if cmd["op"] == "get_single":
            codes = [store.get_into(k, p, s) for k, p, s in zip(keys, ptrs, sizes, strict=True)]
        else:
            codes = store.batch_get_into(keys, ptrs, sizes)
        t3 = time.perf_counter()
        assert list(codes) == sizes, codes
        crcs = [list(crc32_chunks(t)) for t in dst]
        t4 = time.perf_counter()
        assert crcs == cmd["crcs"], "bytes differ from what was put"
        h2d = 0.0
        if device == "cuda":
            on_gpu = [t.to("cuda", non_blocking=True) for t in dst]
            torch.cuda.synchronize()
            h2d = time.perf_counter() - t4
            del on_gpu
        phases["alloc_s"].append(t1 - t0)
        phases["get_s"].append(t3 - t2)
        phases["verify_s"].append(t4 - t3)
        phases["h2d_s"].append(h2d)
        phases["total_s"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in phases.items()}


# ---------------------------------------------------------------------------------------------
# raw TCP ceiling
# ---------------------------------------------------------------------------------------------


def raw_tcp_bandwidth(num_bytes: int, reps: int) -> float:
    """Bytes/s of one TCP stream between two processes on loopback (the ceiling of any TCP path)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    chunk = 4 * MIB
    code = (
        "import socket,sys\n"
        f"c=socket.create_connection(('127.0.0.1',{port})); b=memoryview(bytearray({chunk}))\n"
        f"for _ in range({reps}):\n"
        f"    left={num_bytes}\n"
        "    while left>0:\n"
        "        left-=c.send(b[:min(len(b),left)])\n"
        "c.recv(1)\n"
    )
    sender = subprocess.Popen([sys.executable, "-c", code])
    conn, _ = server.accept()
    buf = bytearray(num_bytes)
    view = memoryview(buf)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        got = 0
        while got < num_bytes:
            got += conn.recv_into(view[got:], min(chunk, num_bytes - got))
        times.append(time.perf_counter() - start)
    conn.send(b"x")
    sender.wait()
    conn.close()
    server.close()
    return num_bytes / statistics.median(times)


# ---------------------------------------------------------------------------------------------
# the producer side and the report
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def reader_process(endpoints: Endpoints, device: str) -> Iterator[Callable[[dict], dict]]:
    """A reader subprocess and a function that sends it one command and returns its answer."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tools.bench.transport",
            "--role",
            "reader",
            "--master",
            endpoints.master_address,
            "--metadata",
            endpoints.metadata_url,
            "--device",
            device,
        ],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"},
    )
    hello = json.loads(proc.stdout.readline())

    def ask(cmd: dict) -> dict:
        proc.stdin.write(json.dumps(cmd) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the reader process died; rerun with stderr visible")
        return json.loads(line)

    ask.setup_s = hello["setup_s"]  # type: ignore[attr-defined]
    try:
        yield ask
    finally:
        with contextlib.suppress(Exception):
            proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            proc.stdin.flush()
        proc.wait(timeout=30)


def bench_size(tokens: int, args: argparse.Namespace, producer: StoreClient, ask: Callable[[dict], dict]) -> dict:
    """All measurements for one sample size."""
    reps = args.reps
    sample = make_sample(tokens, args.hidden, args.aux, args.device)
    total = sum(nbytes(t) for t in sample.values())
    row: dict[str, Any] = {"tokens": tokens, "sample_bytes": total}

    # baseline: memcpy of the same bytes into a warm destination, timed next to every measured
    # operation (the machine may be shared: adjacent timings keep the ratio honest), and once into
    # fresh memory (first-touch page faults)
    host = [t if t.device.type == "cpu" else t.cpu() for t in sample.values()]
    warm = [torch.empty_like(t) for t in host]
    memcpy_times: list[float] = []

    def memcpy() -> None:
        start = time.perf_counter()
        for target, source in zip(warm, host, strict=True):
            target.copy_(source)
        memcpy_times.append(time.perf_counter() - start)

    memcpy()
    memcpy_times.clear()
    start = time.perf_counter()
    for target, source in zip([torch.empty_like(t) for t in host], host, strict=True):
        target.copy_(source)
    row["memcpy_cold_s"] = time.perf_counter() - start

    # producer side: device -> pinned host (GPU runs), serialisation, registration, put
    if args.device == "cuda":
        pinned = [torch.empty_like(t, device="cpu", pin_memory=True) for t in sample.values()]

        def d2h() -> None:
            for p, t in zip(pinned, sample.values(), strict=True):
                p.copy_(t, non_blocking=True)
            torch.cuda.synchronize()

        row["d2h_s"] = median_time(d2h, reps)
        host = pinned
    start = time.perf_counter()
    layouts = [describe_field(name, t) for name, t in zip(FIELDS, host, strict=True)]
    meta = encode_meta(build_meta(0, layouts, {"T": tokens}))
    row["serialise_s"] = time.perf_counter() - start
    row["meta_bytes"] = len(meta)
    views = [byte_view(t) for t in host]

    def register_cycle() -> None:  # what registration costs this client (the runtime does it for RDMA only)
        for view in views:
            producer.raw.register_buffer(view.data_ptr(), view.numel())
        for view in views:
            producer.raw.unregister_buffer(view.data_ptr())

    row["register_s"] = median_time(register_cycle, reps, before=memcpy)
    keys = [f"bench/{tokens}/{name}" for name in FIELDS]
    start = time.perf_counter()
    producer.put_tensors(keys, host, what=f"T={tokens}")
    producer.put_bytes(f"bench/{tokens}/meta", meta)
    row["put_cold_s"] = time.perf_counter() - start  # first put: fresh segment pages
    row["put_s"] = median_time(lambda: producer.put_tensors(keys, host, what=f"T={tokens}"), reps, before=memcpy)

    # reader side (the other process, over TCP)
    cmd = {
        "keys": keys,
        "shapes": [list(t.shape) for t in host],
        "dtypes": [str(t.dtype).split(".")[1] for t in host],
        "crcs": [list(la.crc32) for la in layouts],
        "reps": reps,
    }
    for op in ("get_fresh", "get_reused", "get_single"):
        memcpy()
        row[op] = ask({**cmd, "op": op})
        memcpy()
    remote_keys = [f"bench/{tokens}/remote/{name}" for name in FIELDS]
    memcpy()
    row["put_remote_s"] = ask({**cmd, "keys": remote_keys, "op": "put_remote"})["put_s"]
    memcpy()
    producer.remove([*keys, f"bench/{tokens}/meta", *remote_keys])
    row["memcpy_s"] = statistics.median(memcpy_times)
    row["memcpy_spread"] = [min(memcpy_times), max(memcpy_times)]
    return row


def report(rows: list[dict], setup: dict, tcp_bps: float, args: argparse.Namespace) -> str:
    """The tables (markdown)."""

    def gbps(num_bytes: int, seconds: float) -> str:
        return f"{num_bytes / seconds / GB:.2f}"

    def ratio(row: dict, seconds: float) -> str:
        return f"{row['memcpy_s'] / seconds:.2f}"

    lines = [
        f"K3-shaped samples: n_aux {args.aux}, H {args.hidden} ({args.aux * args.hidden * 2 + args.hidden * 2 + 9} "
        f"bytes/token); device {args.device}; {args.reps} reps, medians; loopback TCP.",
        "memcpy = median of warm copies of the same bytes timed next to each measured operation "
        "(min..max per row in the JSON); ratio = memcpy time / operation time.",
        f"Client setup: producer (owns the segment) {setup['producer_s'] * 1e3:.0f} ms, reader "
        f"{setup['reader_s'] * 1e3:.0f} ms (once per process). Raw loopback TCP between two processes: "
        f"{tcp_bps / GB:.2f} GB/s.",
        "",
        "| T | MiB | memcpy GB/s | put GB/s (ratio) | put cold GB/s | get GB/s (ratio) | put+get ratio | "
        "per-sample ms (put+get path) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        n = r["sample_bytes"]
        get = r["get_reused"]["get_s"]
        path_s = r["serialise_s"] + r["put_s"] + r["get_fresh"]["total_s"] + r.get("d2h_s", 0.0)
        lines.append(
            f"| {r['tokens']} | {n / MIB:.0f} | {gbps(n, r['memcpy_s'])} | {gbps(n, r['put_s'])} "
            f"({ratio(r, r['put_s'])}) | {gbps(n, r['put_cold_s'])} | {gbps(n, get)} ({ratio(r, get)}) | "
            f"{r['memcpy_s'] / (r['put_s'] + get):.2f} | {path_s * 1e3:.0f} |"
        )
    lines += [
        "",
        "Where the time goes per sample (ms; producer: serialise = CRC-32 of every field + meta JSON, register "
        "= register+unregister of the four buffers (RDMA only: the runtime skips it on TCP, so it is not in the "
        "path total), put = one batch_upsert_from into its own segment; reader: alloc "
        "= fresh destination incl. first-touch faults, get = one batch_get_into over TCP, verify = CRC-32; "
        "d2h/h2d only with --device cuda):",
        "",
        "| T | serialise | register | put | put cold | d2h | alloc | get | verify | h2d | memcpy | memcpy cold |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        g = r["get_fresh"]
        lines.append(
            f"| {r['tokens']} | {r['serialise_s'] * 1e3:.1f} | {r['register_s'] * 1e3:.2f} | {r['put_s'] * 1e3:.1f} | "
            f"{r['put_cold_s'] * 1e3:.1f} | {r.get('d2h_s', 0.0) * 1e3:.1f} | {g['alloc_s'] * 1e3:.1f} | "
            f"{g['get_s'] * 1e3:.1f} | {g['verify_s'] * 1e3:.1f} | {g['h2d_s'] * 1e3:.1f} | "
            f"{r['memcpy_s'] * 1e3:.1f} | {r['memcpy_cold_s'] * 1e3:.1f} |"
        )
    lines += [
        "",
        "Choices (GB/s, ratio to memcpy): put by the segment owner (local copy) vs by another process (TCP); one "
        "batched get of the four fields vs four single gets; reused vs fresh destination:",
        "",
        "| T | put owner | put other process | get batched reused | get single reused | get fresh (incl. alloc) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        n = r["sample_bytes"]
        fresh = r["get_fresh"]["alloc_s"] + r["get_fresh"]["get_s"]
        lines.append(
            f"| {r['tokens']} | {gbps(n, r['put_s'])} ({ratio(r, r['put_s'])}) | {gbps(n, r['put_remote_s'])} "
            f"({ratio(r, r['put_remote_s'])}) | {gbps(n, r['get_reused']['get_s'])} "
            f"({ratio(r, r['get_reused']['get_s'])}) | {gbps(n, r['get_single']['get_s'])} "
            f"({ratio(r, r['get_single']['get_s'])}) | {gbps(n, fresh)} ({ratio(r, fresh)}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="python3 -m tools.bench.transport", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="256,1024,3072", help="comma-separated T values")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--aux", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw numbers here")
    parser.add_argument("--role", choices=("bench", "reader"), default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--metadata", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.role == "reader":
        return reader_main(args.master, args.metadata, args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here; skipping (run it on the GPU machine)")
        return 0
    tokens = [int(t) for t in args.tokens.split(",")]
    per_token = args.aux * args.hidden * 2 + args.hidden * 2 + 9
    largest = max(tokens) * per_token
    # two sample sets (owner's and the remote put) plus the meta and headroom
    segment = max(64 * MIB, int(2.2 * largest) + 64 * MIB)
    settings = MasterSettings(
        host="127.0.0.1",
        rpc_port=free_port(),
        metadata_http_port=free_port(),
        metrics_port=free_port(),
        kv_lease_ttl_s=300,
        eviction_high_watermark_ratio=0.95,
    )
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    with MasterProcess(settings, log_dir / f"bench_transport_master_{os.getpid()}.log") as master:
        endpoints = master.settings.endpoints_for_clients
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        producer = StoreClient(client_settings(endpoints, segment, 64 * MIB), name="producer").connect()
        try:
            with reader_process(endpoints, args.device) as ask:
                setup = {"producer_s": producer.setup_s, "reader_s": ask.setup_s}  # type: ignore[attr-defined]
                rows = []
                for t in tokens:
                    print(f"T={t} ({t * per_token / MIB:.0f} MiB) ...", file=sys.stderr, flush=True)
                    rows.append(bench_size(t, args, producer, ask))
        finally:
            producer.close()
    tcp = raw_tcp_bandwidth(min(largest, 256 * MIB), args.reps)
    print(report(rows, setup, tcp, args))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "setup": setup, "raw_tcp_Bps": tcp}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
