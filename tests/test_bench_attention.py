"""``tools/bench/attention.py --quick`` runs on the CPU and reports rates consistent with its own
FLOP count (the plan's causal formula); no timed assertion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench.attention import causal_attention_flops, main


def test_quick_run_reports_rates_from_the_causal_flop_count(tmp_path: Path) -> None:
    out = tmp_path / "attention.json"
    assert main(["--quick", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["matmul_tflops"] > 0
    variants = {run["variant"] for run in results["runs"]}
    assert {"sdpa", "sdpa-padded"} <= variants
    flops = causal_attention_flops(2, 256, 192, 128)
    assert flops == 2.0 * 2 * 320 * 256 * 257 / 2
    for run in results["runs"]:
        assert run["tflops"] == pytest.approx(flops / run["seconds"] / 1e12)
