"""``tools/bench/anchor_specforge.py`` at tiny shapes on CPU (issue 17), so the H200 run works the first
time: our micro-step in its own process, and SpecForge's own DSpark draft and loss in another when
its files are beside the repository (``../shared/anchors/specforge-a6b6b02``; skipped otherwise).
No timed assertions: the tests check what each side computed and that the report is consistent."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

ANCHORS = REPO_ROOT.parent / "shared" / "anchors" / "specforge-a6b6b02"
TIMEOUT_S = 600


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "tools.bench.anchor_specforge", "--quick", "--tokens", "192", *args]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def check_ours(result: dict) -> None:
    assert result["ok"], result.get("error")
    assert result["T"] == 192 and result["device"] == "cpu"
    assert len(result["times_s"]) == 1 and result["median_s"] > 0
    assert math.isfinite(result["first_loss"]) and result["first_loss"] > 0
    assert result["trainable_params"] > 0 and result["model_tflop"] > 0
    assert math.isclose(result["mfu"], result["tflops"] / result["matmul_tflops"], rel_tol=1e-9)


def test_ours_runs_without_anchors_and_says_specforge_was_skipped(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    done = bench("--anchors", str(tmp_path / "absent"), "--repeats", "1", "--warmup", "0", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SpecForge anchors not found" in done.stdout and "skipping the specforge variant" in done.stdout
    report = json.loads(out.read_text())
    assert [r["variant"] for r in report["results"]] == ["ours"]
    check_ours(report["results"][0])
    assert report["summary"]["ours"]["speed_vs_specforge"] is None


@pytest.mark.slow
@pytest.mark.skipif(not ANCHORS.is_dir(), reason=f"SpecForge anchors not beside the repository ({ANCHORS})")
def test_ours_and_specforge_side_by_side_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    done = bench(
        "--anchors", str(ANCHORS), "--variants", "ours,specforge", "--repeats", "1", "--warmup", "0", "--json", str(out)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    ours, specforge = report["results"]
    assert (ours["variant"], specforge["variant"]) == ("ours", "specforge")
    check_ours(ours)
    assert specforge["ok"], specforge.get("error")
    # same shapes, same useful-FLOP count, and both objectives start near the same value: the
    # same frozen lm_head and sample, N(0, 0.02) draft weights (anchors differ: SpecForge samples its own)
    assert specforge["model_tflop"] == ours["model_tflop"]
    assert math.isfinite(specforge["first_loss"]) and abs(specforge["first_loss"] - ours["first_loss"]) < 0.25
    ratio = report["summary"]["ours"]["speed_vs_specforge"]
    assert math.isclose(ratio, specforge["median_s"] / ours["median_s"], rel_tol=1e-9)
    assert "SpecForge/this" in done.stdout
