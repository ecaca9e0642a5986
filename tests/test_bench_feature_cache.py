"""``tools/bench/feature_cache.py`` on the CPU: it writes real cache entries, reads them back both
ways, reports numbers consistent with its own timings, cleans up only its own folder, and refuses a
disk too small before writing anything. No timed assertions."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from runtime.trainer.feature_cache import FeatureCache
from tests.support.cache_entries import make_sample
from tools.bench import feature_cache as bench


def run_bench(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = bench.main(["--quick", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_quick_run_reports_numbers_that_follow_from_its_timings(tmp_path: Path, capsys) -> None:
    real = FeatureCache(tmp_path, "d" * 64).open(rows=1, bytes_per_row=1024)  # a run's cache in the same --dir
    real.store(0, make_sample(g=0, row=0))
    real_bytes = real.entry_path(0).read_bytes()
    out_json = tmp_path / "result.json"

    code, out, _ = run_bench(capsys, "--dir", str(tmp_path), "--json", str(out_json))

    assert code == 0
    r = json.loads(out_json.read_text())
    s = r["setup"]
    assert (s["tokens"], s["rows"], s["reps"], s["device"]) == (512, 2, 2, "cpu")
    tensor_bytes = s["tokens"] * (8 + 1 + 6 * 7168 * 2)  # K3: ids int64, mask uint8, 5 aux + last layer, bf16
    assert s["rows"] * tensor_bytes < s["file_bytes"] <= s["rows"] * s["sample_bytes"]
    assert len(r["reps"]) == 2
    raw_s = statistics.median(rep["raw_s"] for rep in r["reps"])
    cache_s = statistics.median(rep["cache_s"] for rep in r["reps"])
    assert r["raw_gbps"] == pytest.approx(s["file_bytes"] / raw_s / 1e9)
    assert r["cache_gbps"] == pytest.approx(s["file_bytes"] / cache_s / 1e9)
    assert r["cache_over_raw"] == pytest.approx(r["cache_gbps"] / r["raw_gbps"])
    assert f"cache / raw = {r['cache_over_raw']:.3f}" in out
    assert f"plan.cache_read_gbps: {r['cache_gbps']:.1f}" in out
    # Cold reads are claimed only where mincore saw the pages gone (tmpfs, say, keeps them).
    warm = r["max_resident_share"]
    assert ("WARNING" in out) == (math.isnan(warm) or warm > 0.05)
    # Its own entries are gone; the run's entry in the same folder is untouched.
    assert not Path(s["folder"]).exists()
    assert real.entry_path(0).read_bytes() == real_bytes


def test_kept_entries_verify_through_the_cache(tmp_path: Path, capsys) -> None:
    code, _, _ = run_bench(capsys, "--dir", str(tmp_path), "--keep", "--rows", "1")
    assert code == 0
    cache = FeatureCache(tmp_path, bench.BENCH_DIGEST)
    sample = cache.load(0, g=5, epoch=1)
    assert sample is not None and tuple(sample.hs.shape) == (512, 5 * 7168)
    assert cache.corrupt == 0


def test_a_disk_too_small_is_refused_before_anything_is_written(tmp_path: Path, capsys) -> None:
    target = tmp_path / "not" / "yet"
    with pytest.raises(SystemExit) as refused:
        bench.main(["--dir", str(target), "--tokens", str(10**9), "--rows", "2", "--device", "cpu"])
    message = str(refused.value)
    assert f"--dir {target}" in message and "free" in message and "fix:" in message
    assert list(tmp_path.iterdir()) == []  # not even the folder
