"""The idle-gap arithmetic of ``tools/bench/gpu_gaps.py`` (the profiler part needs a GPU)."""

from __future__ import annotations

import pytest

from tools.bench.gpu_gaps import gaps_of


def test_busy_time_is_the_union_of_overlapping_spans_and_gaps_name_the_ops_inside() -> None:
    spans = [(0.0, 10.0), (5.0, 20.0), (30.0, 40.0), (38.0, 45.0), (100.0, 101.0)]
    ops = [(21.0, "aten::item"), (25.0, "cudaStreamSynchronize"), (50.0, "aten::mm"), (2.0, "inside busy")]
    busy_us, gaps = gaps_of(spans, ops, window=(0.0, 101.0))
    assert busy_us == pytest.approx(20.0 + 15.0 + 1.0)
    assert [(g.start_us, g.end_us) for g in gaps] == [(45.0, 100.0), (20.0, 30.0)]  # longest first
    assert gaps[0].cpu_ops == ("aten::mm",)
    assert gaps[1].cpu_ops == ("aten::item", "cudaStreamSynchronize")
    assert gaps[0].length_us == 55.0


def test_the_window_clips_spans_and_counts_leading_idle_time() -> None:
    busy_us, gaps = gaps_of([(-5.0, 3.0), (8.0, 12.0)], [], window=(0.0, 10.0))
    assert busy_us == pytest.approx(3.0 + 2.0)
    assert [(g.start_us, g.end_us) for g in gaps] == [(3.0, 8.0)]
