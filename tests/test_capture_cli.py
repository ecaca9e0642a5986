"""The capture entry point's ``--k3-moe-exchange`` override reaches the embedded engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime.capture.producer import make_engine
from runtime.capture.setup import capture_setup
from runtime.recipe import load_recipe, load_resolved, write_resolved

REPO = Path(__file__).resolve().parent.parent


def resolved_tiny(tmp_path: Path, *overrides: str):
    loaded = load_recipe(REPO / "recipes" / "tiny.yaml", overrides=list(overrides))
    return load_resolved(write_resolved(loaded, tmp_path / "job", REPO))


def test_cli_override_replaces_the_recipe_exchange(tmp_path: Path) -> None:
    resolved = resolved_tiny(tmp_path, "capture.expert_parallel=2", "capture.engines_per_node=2")
    assert make_engine(capture_setup(resolved).engine, None).settings.moe_exchange == "nccl"
    with pytest.raises(Exception, match="needs one process per GPU") as info:
        make_engine(capture_setup(resolved).engine, None, "deepep")
    assert "--k3-moe-exchange nccl" in str(info.value)


def test_cli_rejects_unknown_exchange() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "runtime.capture", "--recipe", "x", "--k3-moe-exchange", "pplx"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "invalid choice: 'pplx'" in done.stderr


def test_a_refusal_is_one_line_and_the_traceback_goes_beside_the_logs(tmp_path: Path) -> None:
    """The capture cannot start its Mooncake master (a held port): one ``error:`` line naming the
    port and the fix, no traceback on stderr (the console --local echoes), the traceback in a file."""
    import os
    import socket

    from runtime.shared.refusal import EXIT_REFUSED, traceback_path

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        resolved = resolved_tiny(tmp_path, f"transport.master_rpc_port={taken}")
        env = {**os.environ, "DSPARK_BIND_ADDRESS": "127.0.0.1", "DSPARK_CAPTURE_HOST": "127.0.0.1"}
        done = subprocess.run(
            [sys.executable, "-m", "runtime.capture", "--recipe", str(resolved.path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    assert done.returncode == EXIT_REFUSED, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("[capture rank 0] error: cannot start mooncake_master"), errors
    assert f"port {taken}" in errors[0] and "choose a free port" in errors[0]
    assert "MasterStartError" in traceback_path(resolved.job_dir, "capture", 0).read_text()
