"""The capture entry point's ``--k3-moe-exchange`` override reaches the embedded engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime.capture.producer import make_engine
from runtime.recipe import load_recipe, load_resolved, write_resolved

REPO = Path(__file__).resolve().parent.parent


def resolved_tiny(tmp_path: Path, *overrides: str):
    loaded = load_recipe(REPO / "recipes" / "tiny.yaml", overrides=list(overrides))
    return load_resolved(write_resolved(loaded, tmp_path / "job", REPO))


def test_cli_override_replaces_the_recipe_exchange(tmp_path: Path) -> None:
    resolved = resolved_tiny(tmp_path, "capture.expert_parallel=2", "capture.engines_per_node=2")
    assert make_engine(resolved, None).settings.moe_exchange == "nccl"
    with pytest.raises(Exception, match="needs one process per GPU") as info:
        make_engine(resolved, None, "deepep")
    assert "--k3-moe-exchange nccl" in str(info.value)


def test_cli_rejects_unknown_exchange() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "runtime.capture", "--recipe", "x", "--k3-moe-exchange", "pplx"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "invalid choice: 'pplx'" in done.stderr
