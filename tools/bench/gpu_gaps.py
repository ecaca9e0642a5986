"""Where a GPU sits idle: run a callable under the torch profiler, then report the busy time of the
GPU (the union of every kernel and copy on every stream), the idle gaps between them, and for each
long gap the CPU ops that began while the GPU waited (an ``aten::item`` or a
``cudaStreamSynchronize`` there names a host sync; Python work shows as the absence of ops).

Used by the benchmarks' ``--trace`` options; a chrome trace (gzip) is written beside the summary
for a closer look (chrome://tracing or https://ui.perfetto.dev).
"""

from __future__ import annotations

import gzip
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GAP_REPORT_MIN_US = 200.0
"""Gaps shorter than this are counted but not listed one by one."""


@dataclass(frozen=True)
class Gap:
    """One stretch without any GPU work."""

    start_us: float
    end_us: float
    cpu_ops: tuple[str, ...]
    """Names of the CPU ops that began inside the gap, in order (first few)."""

    @property
    def length_us(self) -> float:
        """Its length."""
        return self.end_us - self.start_us


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def gaps_of(
    device_spans: list[tuple[float, float]], cpu_ops: list[tuple[float, str]], window: tuple[float, float]
) -> tuple[float, list[Gap]]:
    """Busy microseconds of the GPU inside ``window`` and its idle gaps there (longest first).
    ``device_spans``: (start, end) of every kernel/copy; ``cpu_ops``: (start, name) of CPU ops."""
    busy = [(max(s, window[0]), min(e, window[1])) for s, e in _merge(device_spans) if e > window[0] and s < window[1]]
    busy_us = sum(e - s for s, e in busy)
    edges = [window[0]] + [x for span in busy for x in span] + [window[1]]
    ops = sorted(cpu_ops)
    gaps = []
    for start, end in zip(edges[0::2], edges[1::2], strict=True):
        if end - start <= 0:
            continue
        inside = tuple(name for t, name in ops if start <= t < end)
        gaps.append(Gap(start, end, inside[:8]))
    gaps.sort(key=lambda g: -g.length_us)
    return busy_us, gaps


def trace_gpu_gaps(fn: Callable[[], Any], device: Any, out_dir: Path, label: str, top: int = 25) -> dict[str, float]:
    """Profile one call of ``fn`` on ``device``; write ``<label>_gaps.txt`` and ``<label>_trace.json.gz``
    under ``out_dir``; return wall, busy and idle milliseconds."""
    import time

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - t0) * 1e3
    events = prof.events()
    spans, ops = [], []
    for event in events:
        rng = event.time_range
        if getattr(event, "device_type", None) == DeviceType.CUDA:
            spans.append((float(rng.start), float(rng.end)))
        else:
            ops.append((float(rng.start), event.name))
    if not spans:
        raise RuntimeError("the profiler saw no GPU work")
    window = (min(s for s, _ in spans), max(e for _, e in spans))
    busy_us, gaps = gaps_of(spans, ops, window)
    span_us = window[1] - window[0]
    long_gaps = [g for g in gaps if g.length_us >= GAP_REPORT_MIN_US]
    lines = [
        f"{label}: wall {wall_ms:.1f} ms; GPU from first to last kernel {span_us / 1e3:.1f} ms, busy {busy_us / 1e3:.1f} ms "
        f"({100 * busy_us / span_us:.1f}%), idle {(span_us - busy_us) / 1e3:.1f} ms in {len(gaps)} gaps, "
        f"{sum(g.length_us for g in long_gaps) / 1e3:.1f} ms of it in {len(long_gaps)} gaps >= {GAP_REPORT_MIN_US:.0f} us",
        "longest gaps (ms from the first kernel; CPU ops that began inside):",
    ]
    for gap in gaps[:top]:
        lines.append(
            f"  {gap.length_us / 1e3:7.2f} ms at {(gap.start_us - window[0]) / 1e3:9.1f}: "
            + ", ".join(gap.cpu_ops)[:220]
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{label}_gaps.txt").write_text("\n".join(lines) + "\n")
    raw = out_dir / f"{label}_trace.json"
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(out_dir / f"{label}_trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    print("\n".join(lines[:2] + lines[2:14]), flush=True)
    return {"wall_ms": wall_ms, "busy_ms": busy_us / 1e3, "idle_ms": (span_us - busy_us) / 1e3}
