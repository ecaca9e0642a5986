"""A new user's first command on a fresh clone: ``python3 -m launcher tiny --local`` builds the tiny
target and its data (the recipe's ``data.prepare_commands``), with progress lines, and runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import copy_repository
from tests.support.launcher_cli import probe_overrides

pytestmark = [pytest.mark.slow, pytest.mark.mooncake, pytest.mark.distributed]


def test_one_command_builds_what_is_missing_and_runs(tmp_path: Path) -> None:
    clone = copy_repository(tmp_path / "clone", share_cache=False)
    assert not (clone / ".cache").exists()
    runs = tmp_path / "runs"
    command = [sys.executable, "-m", "launcher", "tiny", "--local", *probe_overrides(runs)]
    command += ["--set", "trainer.max_steps=4"]
    done = subprocess.run(command, cwd=clone, capture_output=True, text=True, timeout=3600)
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-6000:]
    assert "[prepare] .cache/tiny/target, .cache/tiny/data/train.jsonl missing" in console
    assert "[make_tiny_target] training: step" in console and "[make_tiny_target] done in" in console
    assert "prepare_data: wrote 128 rows" in console
    assert (clone / ".cache" / "tiny" / "target" / "config.json").exists()
    (job_dir,) = (runs / "tiny").iterdir()
    steps = [json.loads(line)["step"] for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert (job_dir / "plots" / "loss.png").exists()
    # A second command finds everything in place and builds nothing.
    again = subprocess.run(command, cwd=clone, capture_output=True, text=True, timeout=1800)
    assert again.returncode == 0 and "[prepare]" not in again.stdout + again.stderr
