"""tools/bootstrap is never silent while pip works: off a terminal pip is quiet and every package
group gets a start line and a "done in N s" line. Run against a stand-in venv whose ``python`` only
records its arguments (no network, no install): the process boundary is the interpreter."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

STAND_IN = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/calls.log"
# torch is missing, so the script installs it; everything else (pip, the checks) succeeds.
[[ "$1" == "-c" && "$2" == "import torch" ]] && exit 1
exit 0
"""


def test_every_pip_group_is_announced_and_timed_off_a_terminal(tmp_path: Path) -> None:
    missing = [
        p
        for p in ("libibverbs1", "libnuma1", "patch")
        if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode
    ]
    if missing:
        pytest.skip(f"the script would apt-get install {missing}")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    env = {**os.environ, "DSPARK_VENV": str(venv), "DSPARK_PYTHON": str(python)}
    done = subprocess.run(
        ["bash", "tools/bootstrap"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("[bootstrap] installing ")]
    assert [lines[i].split()[2] for i in starts] == ["CPU-only", "dspark-recipes[runtime,mooncake-cpu,test]"], lines
    for i in starts:
        assert lines[i + 1].startswith("[bootstrap]   done in ") and lines[i + 1].endswith(" s"), lines
    assert any(line.startswith("[bootstrap] caching the pinned SGLang wheel") for line in lines), lines
    installs = [c for c in (venv / "bin" / "calls.log").read_text().splitlines() if c.startswith("-m pip install")]
    assert len(installs) == 2 and all(c.startswith("-m pip install -q ") for c in installs), installs
