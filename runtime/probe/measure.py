"""The site facts ``--probe`` measures inside an allocation (``runtime/probe/__main__.py`` calls these).

- host memory available on the node: ``MemAvailable`` (the probe asks Slurm for a small ``--mem``,
  so its own cgroup limit says nothing of what the job's ``--mem`` will get);
- the most memory a job may ask of one such node: the smallest of what Slurm allows (the node's
  ``RealMemory``, ``MaxMemPerNode`` of the partition and of the cluster, from ``scontrol``) and the
  node's ``MemTotal``;
- aggregate pinned host-to-device bandwidth with every GPU of the node copying at once (one CUDA
  stream and one pinned buffer per GPU, all started together): the per-GPU rate streaming gets
  when all eight GPUs stream their experts;
- the cold read rate of a disk: a file written there, synced and dropped from the page cache
  (``posix_fadvise(DONTNEED)``), read back by 8 threads as the feature cache's reader does;
- a Mooncake put and get of one object into the client's own segment through a private
  ``mooncake_master`` on loopback (the capture side's commit is such a put).

Each returns the value and a sentence saying how it was measured; :class:`Skipped` says why a
measurement cannot run here (no CUDA device, ...).
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

GIB = 2**30
MIB = 2**20
READ_THREADS = 8
"""Threads reading the file back (the feature cache's reader uses 8)."""
REPEATS = 3


class Skipped(Exception):
    """A measurement that cannot run here; the message says why."""


def _meminfo_bytes(field: str) -> int:
    """One ``/proc/meminfo`` field in bytes."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    return int(meminfo[field].split()[0]) * 1024


def host_memory_available_bytes() -> tuple[int, str]:
    """Bytes of host memory available on this node, and how that was read. The probe's own cgroup
    limit (its small ``--mem``) is named, not applied: the job's ``--mem`` is another."""
    available = _meminfo_bytes("MemAvailable")
    how = f"MemAvailable of /proc/meminfo ({available / GIB:,.1f} GiB)"
    limit = _cgroup_room_bytes()
    if limit is not None and limit < available:
        how += f"; the probe's own cgroup allows {limit / GIB:,.1f} GiB more (its --mem, not the job's)"
    return available, how


def gpus_per_node() -> tuple[int, str]:
    """GPUs this task sees: CUDA's count, else the devices Slurm handed it (``CUDA_VISIBLE_DEVICES``)."""
    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        count = 0
    if count:
        return count, f"{count} CUDA device(s) visible to torch"
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible:
        return len(visible), f"{len(visible)} device(s) in CUDA_VISIBLE_DEVICES (Slurm's GRES; torch sees no CUDA here)"
    raise Skipped("no CUDA device and no CUDA_VISIBLE_DEVICES here")


def _scontrol_fields(*args: str) -> dict[str, str]:
    """``KEY=VALUE`` fields of one ``scontrol show ... -o`` line; empty when scontrol cannot answer."""
    import shutil
    import subprocess

    if not shutil.which("scontrol"):
        return {}
    try:
        done = subprocess.run(["scontrol", "show", *args, "-o"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return {}
    if done.returncode != 0:
        return {}
    return dict(item.split("=", 1) for item in done.stdout.split() if "=" in item)


def _slurm_mib(value: str | None) -> int | None:
    """A Slurm memory figure in MiB (``524288``, ``UNLIMITED``, ``0``: none)."""
    if value is None or not value.isdigit() or int(value) == 0:
        return None
    return int(value)


def node_memory_cap_gib(environ: dict[str, str] | None = None) -> tuple[int, str]:
    """GiB one job may ask of this node (``--mem``): the smallest of the node's ``RealMemory``, the
    partition's and the cluster's ``MaxMemPerNode`` (``scontrol``) and the node's ``MemTotal``."""
    env = os.environ if environ is None else environ
    bounds: dict[str, int] = {"MemTotal of /proc/meminfo": _meminfo_bytes("MemTotal") // MIB}
    node = env.get("SLURMD_NODENAME")
    if node:
        found = _slurm_mib(_scontrol_fields("node", node).get("RealMemory"))
        if found:
            bounds[f"Slurm RealMemory of {node}"] = found
    partition = env.get("SLURM_JOB_PARTITION")
    if partition:
        found = _slurm_mib(_scontrol_fields("partition", partition).get("MaxMemPerNode"))
        if found:
            bounds[f"MaxMemPerNode of partition {partition}"] = found
    if node:
        config = _scontrol_fields("config")
        found = _slurm_mib(config.get("MaxMemPerNode"))
        if found:
            bounds["the cluster's MaxMemPerNode"] = found
    smallest = min(bounds, key=lambda name: bounds[name])
    cap_gib = bounds[smallest] // 1024
    shown = ", ".join(f"{name} {value / 1024:,.1f} GiB" for name, value in bounds.items())
    how = f"{cap_gib} GiB, the smallest of: {shown}"
    if not node:
        how += " (not in a Slurm job: Slurm's own limits were not read)"
    return cap_gib, how


def _cgroup_room_bytes() -> int | None:
    """The cgroup v2 (or v1) memory limit less current use, None without a limit."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit_text = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text.isdigit() and int(limit_text) < 2**60:
            return max(0, int(limit_text) - usage)
    return None


def h2d_gbps_per_gpu(bytes_per_gpu: int) -> tuple[float, str]:
    """GB/s per GPU of pinned host-to-device copies with every visible GPU copying at once."""
    import torch

    if not torch.cuda.is_available():
        raise Skipped("no CUDA device here")
    gpus = torch.cuda.device_count()
    sources = [torch.empty(bytes_per_gpu, dtype=torch.uint8, pin_memory=True).fill_(1) for _ in range(gpus)]
    targets = [torch.empty(bytes_per_gpu, dtype=torch.uint8, device=f"cuda:{i}") for i in range(gpus)]
    streams = [torch.cuda.Stream(device=i) for i in range(gpus)]

    def copy_all() -> None:
        for target, source, stream in zip(targets, sources, streams, strict=True):
            with torch.cuda.stream(stream):
                target.copy_(source, non_blocking=True)
        for stream in streams:
            stream.synchronize()

    copy_all()  # warm-up: contexts, first touch
    seconds = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        copy_all()
        seconds.append(time.perf_counter() - start)
    aggregate = gpus * bytes_per_gpu / statistics.median(seconds) / 1e9
    name = torch.cuda.get_device_name(0)
    return aggregate / gpus, (
        f"{gpus} x {name} copying {bytes_per_gpu / GIB:.2f} GiB of pinned host memory each, all at once: "
        f"{aggregate:,.1f} GB/s together, median of {REPEATS}"
    )


def cold_read_gbps(folder: Path, size_bytes: int) -> tuple[float, str]:
    """GB/s of reading a freshly written file in ``folder`` back from the disk (page cache dropped)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".dspark_probe_read_{os.getpid()}"
    block = os.urandom(8 * MIB)
    try:
        with open(path, "wb") as out:
            for offset in range(0, size_bytes, len(block)):
                out.write(block[: min(len(block), size_bytes - offset)])
            out.flush()
            os.fsync(out.fileno())
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            part = -(-size_bytes // READ_THREADS)

            def read_part(index: int) -> int:
                done, offset, end = 0, index * part, min(size_bytes, (index + 1) * part)
                while offset < end:
                    data = os.pread(fd, min(16 * MIB, end - offset), offset)
                    if not data:
                        break
                    done += len(data)
                    offset += len(data)
                return done

            start = time.perf_counter()
            with ThreadPoolExecutor(READ_THREADS) as pool:
                read = sum(pool.map(read_part, range(READ_THREADS)))
            seconds = time.perf_counter() - start
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    rate = read / seconds / 1e9
    return rate, (
        f"{read / MIB:,.0f} MiB written to {folder}, synced, dropped from the page cache (posix_fadvise), read back "
        f"by {READ_THREADS} threads: {rate:.2f} GB/s (a file system that ignores the advice reads from memory)"
    )


def store_put_get_gbps(object_bytes: int, log_dir: Path) -> tuple[float, float, str]:
    """GB/s of a Mooncake put and a get of one ``object_bytes`` object into and out of the client's
    own segment, through a private master on loopback (free ports, stopped afterwards)."""
    import torch

    from runtime.recipe.fit.slurm_request import PROBE_EVICTION_WATERMARK, probe_segment_bytes
    from runtime.transport.loopback import LOOPBACK, free_port
    from runtime.transport.master import MasterProcess, MasterSettings
    from runtime.transport.settings import ClientSettings
    from runtime.transport.store import StoreClient

    settings = MasterSettings(
        host=LOOPBACK,
        rpc_port=free_port(),
        metadata_http_port=free_port(),
        metrics_port=free_port(),
        kv_lease_ttl_s=60,
        eviction_high_watermark_ratio=PROBE_EVICTION_WATERMARK,
    )
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
    source = torch.ones(object_bytes, dtype=torch.uint8)
    target = torch.empty(object_bytes, dtype=torch.uint8).fill_(0)
    with MasterProcess(settings, log_dir / "probe_mooncake_master.log") as master:
        client_settings = ClientSettings(
            endpoints=master.settings.endpoints_for_clients,
            segment_bytes=probe_segment_bytes(2, object_bytes),  # a removed object may linger a moment
            local_buffer_bytes=64 * MIB,
            transfer_timeout_s=60,
            max_retries=2,
            retry_backoff_s=0.2,
            connect_timeout_s=30,
        )
        with StoreClient(client_settings, name="probe").connect() as client:
            puts, gets = [], []
            for index in range(REPEATS + 1):
                key = f"dspark-probe/{index}"
                start = time.perf_counter()
                client.put_tensors([key], [source], what="the probe object")
                put_s = time.perf_counter() - start
                start = time.perf_counter()
                client.get_into_tensors([key], [target], what="the probe object")
                get_s = time.perf_counter() - start
                client.remove([key])
                if index:  # the first pays for fresh allocations
                    puts.append(put_s)
                    gets.append(get_s)
    if not bool(torch.equal(source, target)):
        raise RuntimeError("the object read back differs from the one put")
    put_rate = object_bytes / statistics.median(puts) / 1e9
    get_rate = object_bytes / statistics.median(gets) / 1e9
    return (
        put_rate,
        get_rate,
        (
            f"one {object_bytes / MIB:,.0f} MiB object put into and read from the client's own segment through a "
            f"private mooncake_master on loopback: put {put_rate:.2f} GB/s, get {get_rate:.2f} GB/s, median of {REPEATS}"
        ),
    )
