"""Benchmarks of the SGLang capture sink's two costs, each as a ratio against a baseline timed in
the same run.

- ``commit`` (CPU, needs ``mooncake_master``): the sink commits through a Mooncake client without
  a segment of its own (it lives in SGLang's scheduler process), so every put travels over loopback
  TCP into the segment the capture component's producer mounted. Baseline: the segment owner's own
  commit of the same sample (Mooncake's same-process memcpy path). Reports GB/s of both.
- ``stage`` (GPU): device rows -> pinned host on the sink's side stream (``HostStager``) vs a plain
  ``tensor.cpu()`` (pageable, on the compute stream), and vs 0.5.23's JSON path (``.cpu().tolist()``,
  timed on a small slice and given per token).

Examples::

    python3 -m tools.bench.sglang_sink --mode commit --tokens 65536 --hidden 256 --repeats 3
    python3 -m tools.bench.sglang_sink --mode stage --tokens 65536        # K3 widths, on a GPU
    python3 -m tools.bench.sglang_sink --quick                            # tiny shapes, proves it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

GB = 10**9
REPO = Path(__file__).resolve().parents[2]


def _sample(tokens: int, hidden: int, num_aux: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        "ids": torch.arange(tokens, dtype=torch.int64, device=device),
        "mask": torch.ones(tokens, dtype=torch.uint8, device=device),
        "hs": torch.randn(tokens, num_aux * hidden, generator=gen, device=device).to(torch.bfloat16),
        "lhs": torch.randn(tokens, hidden, generator=gen, device=device).to(torch.bfloat16),
    }


def _nbytes(sample: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sample.values())


# ----------------------------------------------------------------------------------------------
# commit: non-owner client (the sink) vs the segment owner (the producer)
# ----------------------------------------------------------------------------------------------

SINK_CHILD = r"""
import json, sys, time
from runtime.recipe.loader import load_resolved
from runtime.transport.loopback import transport_of
from runtime.transport.dataplane import open_producer
from tools.bench.sglang_sink import _sample
resolved = load_resolved(sys.argv[1])
tokens, hidden, aux, repeats = (int(v) for v in sys.argv[2:6])
sample = _sample(tokens, hidden, aux)
times = []
with open_producer(transport_of(resolved), resolved.job_dir, segment_bytes=0, auto_heartbeat=False, start_cursor=None) as sink:
    for i in range(repeats):
        t0 = time.perf_counter()
        sink.commit(1, sample, {"bench": "sink"})
        times.append(time.perf_counter() - t0)
print("RESULT " + json.dumps(times), flush=True)
"""


def bench_commit(tokens: int, hidden: int, num_aux: int, repeats: int) -> None:
    """Sink-side commit (no segment, separate process) vs the owner's commit of the same sample."""
    from runtime.transport.dataplane import open_producer
    from runtime.transport.loopback import (
        free_port,
        loopback_endpoints,
        loopback_env,
        loopback_master,
        loopback_recipe,
        transport_of,
    )

    sample = _sample(tokens, hidden, num_aux)
    size = _nbytes(sample)
    segment = max(4 * size, 256 * 2**20)
    with tempfile.TemporaryDirectory(prefix="bench-sink-") as tmp:
        resolved = loopback_recipe(
            Path(tmp),
            (free_port(), free_port(), free_port()),
            [
                "transport.store_id=bench",
                f"transport.global_segment_bytes={segment}",
                f"transport.store_cap_bytes={int(segment * 0.95)}",
                f"transport.local_buffer_bytes={64 * 2**20}",
                "transport.connect_timeout_s=30",
            ],
        )
        env = {**os.environ, **loopback_env(resolved), "PYTHONPATH": str(REPO)}
        os.environ.update(loopback_env(resolved))
        with (
            loopback_master(resolved),
            open_producer(
                transport_of(resolved),
                resolved.job_dir,
                endpoints=loopback_endpoints(resolved),
                start_cursor=None,
                auto_heartbeat=False,
            ) as owner,
        ):
            owner_times = []
            for _ in range(repeats + 1):  # the first put touches fresh segment pages: not counted
                t0 = time.perf_counter()
                owner.commit(0, sample, {"bench": "owner"})
                owner_times.append(time.perf_counter() - t0)
            proc = subprocess.run(
                [sys.executable, "-c", SINK_CHILD, str(resolved.path), str(tokens), str(hidden), str(num_aux),
                 str(repeats + 1)],
                env=env, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"sink child failed:\n{proc.stderr[-3000:]}")
            sink_times = json.loads(lines[-1][7:])
    owner_s = statistics.median(owner_times[1:])
    sink_s = statistics.median(sink_times[1:])
    print(f"commit of one sample: T={tokens}, H={hidden}, {num_aux} aux layers, {size / GB:.3f} GB (CRC-32 included)")
    print(f"  owner (baseline, same-process segment): {owner_s:.3f} s  {size / owner_s / GB:.2f} GB/s")
    print(f"  sink (no segment, other process, TCP):  {sink_s:.3f} s  {size / sink_s / GB:.2f} GB/s")
    print(f"  ratio sink/owner throughput: {owner_s / sink_s:.2f}x")


# ----------------------------------------------------------------------------------------------
# stage: side-stream pinned staging vs .cpu() vs the JSON path
# ----------------------------------------------------------------------------------------------


def _cuda_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_stage(tokens: int, hidden: int, num_aux: int, repeats: int) -> None:
    """HostStager vs tensor.cpu() vs .cpu().tolist() for one sample's hs + lhs."""
    from runtime.capture.sglang_sink import HostStager

    if not torch.cuda.is_available():
        print("stage: skipped (needs a CUDA GPU)")
        return
    sample = _sample(tokens, hidden, num_aux, device="cuda")
    rows = {"hs": sample["hs"], "lhs": sample["lhs"]}
    size = sum(t.numel() * t.element_size() for t in rows.values())
    stager = HostStager()
    stager.stage(rows)  # pins the buffer once (not counted)
    staged_s = _cuda_time(lambda: stager.stage(rows), repeats)
    plain_s = _cuda_time(lambda: {k: v.cpu() for k, v in rows.items()}, repeats)
    slice_tokens = min(tokens, 256)
    json_s = _cuda_time(lambda: [v[:slice_tokens].cpu().tolist() for v in rows.values()], repeats)
    json_full_s = json_s * tokens / slice_tokens
    print(f"stage one sample's hs + lhs to host: T={tokens}, H={hidden}, {num_aux} aux layers, {size / GB:.3f} GB")
    print(f"  side-stream pinned (HostStager): {staged_s:.3f} s  {size / staged_s / GB:.1f} GB/s")
    print(f"  baseline tensor.cpu() (pageable): {plain_s:.3f} s  {size / plain_s / GB:.1f} GB/s")
    print(f"  0.5.23 JSON path .cpu().tolist(): {json_full_s:.1f} s (extrapolated from {slice_tokens} tokens)")
    print(f"  ratio pinned vs .cpu(): {plain_s / staged_s:.2f}x; vs .tolist(): {json_full_s / staged_s:.0f}x")


def main(argv: list[str] | None = None) -> int:
    """CLI: ``--mode commit|stage`` (repeatable), shapes, ``--quick``."""
    parser = argparse.ArgumentParser(prog="python3 -m tools.bench.sglang_sink")
    parser.add_argument("--mode", action="append", choices=["commit", "stage"])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=None, help="default: 7168 for stage, 256 for commit")
    parser.add_argument("--num-aux", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, both modes")
    args = parser.parse_args(argv)
    modes = args.mode or (["commit", "stage"])
    if args.quick:
        args.tokens, args.repeats = 4096, 2
    for mode in modes:
        if mode == "commit":
            bench_commit(args.tokens, args.hidden or (64 if args.quick else 256), args.num_aux, args.repeats)
        else:
            bench_stage(args.tokens, args.hidden or (1024 if args.quick else 7168), args.num_aux, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
