"""The feature cache's read rate on this node against a plain read of the same files, same run.

``plan.cache_read_gbps`` is the rate at which later epochs read a sample back from
``trainer.feature_cache`` (the trainer node's local disk); the plan's run time and trainer idle
fraction follow from it, and the recipes carry an assumed value. This measures it where the trainer
will run: it writes ``--rows`` entries of the recipe's largest sample through the cache's own write
path (``FeatureCache.store``), then, per repeat, drops them from the page cache and times

- ``raw``: a plain read of the entry files into host buffers by as many threads, in chunks of the
  same size, as the cache's entry reader uses (what the disk gives them), and
- ``cache``: ``FeatureCache.load`` of each entry onto ``--device`` as the trainer's prefetch thread
  calls it (safetensors read, copy to the device, every field's checksum verified there).

It prints both rates, the ratio cache / raw, and the value to put in the recipe. Pages are dropped
with ``fsync`` + ``POSIX_FADV_DONTNEED`` and the share still resident is counted with ``mincore``
before each timed read: a file system that keeps the pages (some network and overlay file systems
do) is reported as a warm read, not passed off as the disk's rate.

Examples::

    python3 -m tools.bench.feature_cache --dir /local/nvme/dspark_cache --device cuda   # the trainer node
    python3 -m tools.bench.feature_cache --dir /local/nvme/dspark_cache --tokens 16384 --rows 4
    python3 -m tools.bench.feature_cache --quick                                        # CPU, small: the tool runs

The entries are removed at the end (``--keep`` leaves them). The cache folder's digest is the
bench's own, so a real run's entries in the same ``--dir`` are never read or touched.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from runtime.user_errors import exit_without_package

try:  # a stock python3 instead of the venv's: one line, not a traceback
    import torch

    from runtime.files import atomic_write_text
    from runtime.recipe import load_recipe
    from runtime.recipe.fit.store_budget import largest_sample
    from runtime.recipe.sizes import SampleSize
    from runtime.recipe.units import format_bytes
    from runtime.shared.contracts import CapturedSample
    from runtime.trainer.entry_reader import CHUNK_BYTES, READ_THREADS
    from runtime.trainer.feature_cache import FeatureCache
    from runtime.transport.checksum import sum16_values
    from runtime.transport.sample_format import build_meta, describe_field
except ModuleNotFoundError as _missing:
    exit_without_package(_missing, "tools.bench.feature_cache")

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIGEST = "feature-cache-bench".ljust(64, "0")
"""The digest the bench's entries are filed under (its own folder in ``--dir``)."""
FILL_BLOCK_BYTES = 16 * 2**20


@dataclass
class Setup:
    """What was written and where."""

    recipe: str
    tokens: int
    rows: int
    reps: int
    device: str
    folder: str
    sample_bytes: int
    file_bytes: int


@dataclass
class Rep:
    """One repeat: both timed reads and the share of pages resident before each."""

    raw_s: float
    cache_s: float
    raw_resident_share: float
    cache_resident_share: float


def sample_of(row: int, tokens: int, num_aux: int, hidden: int, device: torch.device) -> CapturedSample:
    """One entry of the recipe's shape; the feature fields tile a random block (the bytes' values do
    not change read rates), with the checksums the capture would record: ``sum16`` computed on
    ``device`` for every field, as the capture's GPU commit path does."""
    gen = torch.Generator().manual_seed(row)
    block = torch.randint(-(2**15), 2**15, (FILL_BLOCK_BYTES // 2,), generator=gen, dtype=torch.int16)

    def feature(width: int) -> torch.Tensor:
        words = tokens * width
        return block.repeat(-(-words // block.numel()))[:words].view(torch.bfloat16).view(tokens, width)

    fields = {
        "ids": torch.randint(0, 2**17, (tokens,), generator=gen, dtype=torch.int64),
        "mask": torch.ones(tokens, dtype=torch.uint8),
        "hs": feature(num_aux * hidden),
        "lhs": feature(hidden),
    }
    layouts = [describe_field(name, t, sum16=sum16_values(t.to(device))) for name, t in fields.items()]
    meta = build_meta(row, layouts, {"g": row, "epoch": 0, "row_index": row})
    return CapturedSample(g=row, meta=meta, **fields)


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_share(paths: list[Path]) -> float:
    """The share of the files' pages in the page cache (``mincore``); NaN where it cannot be read."""
    page = mmap.PAGESIZE
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                return float("nan")
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if _libc.mincore(addr, size, vec) != 0:
                    return float("nan")
                resident += sum(b & 1 for b in vec)
                total += pages
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else float("nan")


def drop_from_page_cache(paths: list[Path]) -> None:
    """Write back and drop the files' pages (clean pages only can be dropped, hence the fsync)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(paths: list[Path], buffers: list[bytearray]) -> int:
    """Read every file with one thread per buffer, each taking every len(buffers)-th chunk of a
    buffer's size (the entry reader's pattern), into those reused host buffers; bytes read."""
    threads, chunk_bytes = len(buffers), len(buffers[0])
    chunks = [(path, offset) for path in paths for offset in range(0, path.stat().st_size, chunk_bytes)]

    def reader(k: int) -> int:
        view = memoryview(buffers[k])
        total = 0
        fds: dict[Path, int] = {}
        try:
            for path, offset in chunks[k::threads]:
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY)
                total += os.preadv(fd, [view], offset)
        finally:
            for fd in fds.values():
                os.close(fd)
        return total

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(reader, range(threads)))


def timed_cache_read(cache: FeatureCache, rows: int, device: torch.device) -> float:
    """Seconds for ``FeatureCache.load`` of every row onto ``device`` (each load verified)."""
    start = time.perf_counter()
    for row in range(rows):
        sample = cache.load(row, g=row, epoch=1, device=device)
        if sample is None:
            raise RuntimeError(f"feature cache entry of row {row} did not verify: {cache.entry_path(row)}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict:
    """Write the entries, time ``--reps`` cold reads of both kinds, remove the entries (unless --keep)."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this machine has no CUDA GPU")
    recipe_path = REPO_ROOT / "recipes" / f"{args.recipe}.yaml"
    recipe = load_recipe(recipe_path).recipe
    tokens = args.tokens or recipe.data.max_length
    size = largest_sample(recipe)
    num_aux, hidden = size.num_aux_layers, size.hidden_size
    sample_bytes = SampleSize(tokens, num_aux, hidden).total_bytes
    root = Path(args.dir) if args.dir else Path(tempfile.gettempdir()) / f"dspark-feature-cache-bench-{os.getpid()}"
    need = args.rows * sample_bytes
    existing = root
    while not existing.exists():  # nothing is created before the space check passes
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if need > free:
        raise SystemExit(
            f"--dir {root}: the bench writes {args.rows} entries of {format_bytes(sample_bytes)} "
            f"({format_bytes(need)}) and the disk has {format_bytes(free)} free; fix: fewer --rows, "
            "fewer --tokens, or another --dir"
        )
    root.mkdir(parents=True, exist_ok=True)
    cache = FeatureCache(root, BENCH_DIGEST).open(args.rows, sample_bytes)
    paths = [cache.entry_path(row) for row in range(args.rows)]
    print(
        f"feature cache bench: {args.rows} entries of {tokens} tokens x ({num_aux} aux + 1) x {hidden} "
        f"({format_bytes(sample_bytes)} each, recipe {args.recipe}) in {cache.folder}, onto {device}",
        flush=True,
    )
    try:
        write_s = 0.0
        for row in range(args.rows):
            sample = sample_of(row, tokens, num_aux, hidden, device)
            start = time.perf_counter()
            cache.store(row, sample)
            write_s += time.perf_counter() - start
            print(f"  wrote entry {row + 1}/{args.rows} ({format_bytes(paths[row].stat().st_size)})", flush=True)
        file_bytes = sum(p.stat().st_size for p in paths)
        buffers = [bytearray(CHUNK_BYTES) for _ in range(READ_THREADS)]
        reps: list[Rep] = []
        for rep in range(args.reps):
            drop_from_page_cache(paths)
            raw_resident = resident_share(paths)
            start = time.perf_counter()
            got = raw_read(paths, buffers)
            raw_s = time.perf_counter() - start
            if got != file_bytes:
                raise RuntimeError(f"read {got} bytes of {file_bytes}")
            drop_from_page_cache(paths)
            cache_resident = resident_share(paths)
            cache_s = timed_cache_read(cache, args.rows, device)
            reps.append(Rep(raw_s, cache_s, raw_resident, cache_resident))
            print(
                f"  repeat {rep + 1}/{args.reps}: raw {file_bytes / raw_s / 1e9:.2f} GB/s, cache "
                f"{file_bytes / cache_s / 1e9:.2f} GB/s (page cache before the reads: {raw_resident:.0%} / "
                f"{cache_resident:.0%} resident)",
                flush=True,
            )
    finally:
        cache.close()
        if not args.keep:
            shutil.rmtree(cache.folder, ignore_errors=True)
            if not args.dir:
                shutil.rmtree(root, ignore_errors=True)
    raw_s = statistics.median(r.raw_s for r in reps)
    cache_s = statistics.median(r.cache_s for r in reps)
    setup = Setup(args.recipe, tokens, args.rows, args.reps, str(device), str(cache.folder), sample_bytes, file_bytes)
    return {
        "format": "dspark-bench-feature-cache-v1",
        "setup": asdict(setup),
        "reps": [asdict(r) for r in reps],
        "write_gbps": file_bytes / write_s / 1e9,
        "raw_gbps": file_bytes / raw_s / 1e9,
        "cache_gbps": file_bytes / cache_s / 1e9,
        "cache_over_raw": raw_s / cache_s,
        "max_resident_share": max(max(r.raw_resident_share, r.cache_resident_share) for r in reps),
        "recipe_sample_bytes": size.total_bytes,
        "recipe_cache_read_gbps": recipe.plan.cache_read_gbps,
    }


def report(result: dict) -> str:
    """What an operator reads: both rates, the ratio, whether the reads were cold, the recipe value."""
    s = result["setup"]
    warm = result["max_resident_share"]
    lines = [
        f"feature cache read on {s['device']}, {s['rows']} entries x {format_bytes(s['sample_bytes'])}, "
        f"median of {s['reps']} (write through FeatureCache.store: {result['write_gbps']:.2f} GB/s)",
        f"  raw read, {READ_THREADS} threads (baseline): {result['raw_gbps']:.2f} GB/s",
        f"  FeatureCache.load (read + copy + verify): {result['cache_gbps']:.2f} GB/s",
        f"  cache / raw = {result['cache_over_raw']:.3f}",
    ]
    if warm != warm or warm > 0.05:  # NaN or pages left behind
        lines.append(
            f"  WARNING: up to {warm:.0%} of the entries' pages were still in memory before a timed read "
            "(the file system kept them): these are warm reads, not the disk's rate"
        )
    seconds = result["recipe_sample_bytes"] / (result["cache_gbps"] * 1e9)
    lines.append(
        f"  recipe {s['recipe']}: plan.cache_read_gbps: {result['cache_gbps']:.1f}  (the recipe says "
        f"{result['recipe_cache_read_gbps']:g}; its largest sample, {format_bytes(result['recipe_sample_bytes'])}, "
        f"reads in {seconds:.3f} s at the measured rate)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="kimi_k3_v1c", help="recipe whose sample shape is written")
    parser.add_argument("--dir", default=None, help="the cache's disk (default: a temporary folder)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per entry (default: data.max_length)")
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--keep", action="store_true", help="leave the entries in --dir")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    parser.add_argument("--quick", action="store_true", help="small entries on the CPU: proves the tool runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.rows, args.reps, args.device = args.tokens or 512, min(args.rows, 2), 2, "cpu"
    if args.rows < 1 or args.reps < 1 or (args.tokens is not None and args.tokens < 1):
        parser.error("--rows, --reps and --tokens must be at least 1")
    result = run(args)
    print(report(result))
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
