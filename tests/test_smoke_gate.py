"""The smoke gate on the tiny recipe with the real pipeline (--local: Mooncake master, embedded
capture, 4 gloo trainer ranks): it passes, and each injected fault fails the right check with its
reason and fix, leaving the later checks NOT RUN."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest

from runtime.recipe import load_recipe
from tests.support.launcher_cli import launch, probe_overrides

pytestmark = [pytest.mark.mooncake, pytest.mark.distributed]

REPO = Path(__file__).resolve().parent.parent
CHECKS = [
    "plan",
    "sglang patch",
    "data sha256",
    "mooncake master health",
    "engine health",
    "captured sample contract",
    "finite update on every rank",
    "checkpoint written, reloaded, hashed",
]


def run_gate(runs: Path, *overrides: str, env: dict[str, str] | None = None) -> tuple[int, dict, str]:
    """``python3 -m launcher tiny --local --smoke``; returns (exit code, gate.json, stdout)."""
    args = ["tiny", "--local", "--smoke", *probe_overrides(runs)]
    for item in overrides:
        args += ["--set", item]
    done = launch(args, env=env or dict(os.environ))
    (job_dir,) = list((runs / "tiny").iterdir())
    return done.returncode, json.loads((job_dir / "gate.json").read_text()), done.stdout + done.stderr


def statuses(gate: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in gate["checks"]}


def failed_check(gate: dict) -> dict:
    (failure,) = [c for c in gate["checks"] if c["status"] == "FAIL"]
    after = [c["status"] for c in gate["checks"][gate["checks"].index(failure) + 1 :]]
    assert set(after) <= {"NOT RUN"}, "the gate stops at the first failure"
    return failure


@pytest.mark.slow
def test_gate_passes_on_the_tiny_pipeline(tmp_path: Path, tiny_assets: Path) -> None:
    code, gate, output = run_gate(tmp_path / "runs")
    assert code == 0, output
    assert gate["passed"] is True and [c["name"] for c in gate["checks"]] == CHECKS
    assert statuses(gate) == {name: ("SKIP" if name == "sglang patch" else "PASS") for name in CHECKS}
    by_name = {c["name"]: c for c in gate["checks"]}
    assert "hs bfloat16" in by_name["captured sample contract"]["detail"]
    assert "weights sha256" in by_name["checkpoint written, reloaded, hashed"]["detail"]
    assert "smoke gate: PASS" in output


def test_wrong_sha_fails_before_anything_runs(tmp_path: Path, tiny_assets: Path) -> None:
    code, gate, output = run_gate(tmp_path / "runs", "data.expected_sha256=" + "0" * 64)
    failure = failed_check(gate)
    assert code == 1 and failure["name"] == "data sha256"
    assert "0" * 64 in failure["detail"] and "tools/prepare_data" in failure["fix"]
    assert not list((tmp_path / "runs" / "tiny").glob("*/logs/*.out")), "no component was started"


def test_unpatched_sglang_fails_the_patch_check(tmp_path: Path, tiny_assets: Path) -> None:
    wheels = sorted((REPO / ".cache" / "sglang").glob("sglang-0.5.23-*.whl"))
    if not wheels:
        pytest.skip("the pinned SGLang wheel is not cached (tools/bootstrap caches it)")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheels[0]) as wheel:  # a real, unpatched SGLang 0.5.23 package tree
        wheel.extractall(site, [n for n in wheel.namelist() if n.startswith("sglang/")])
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code, gate, _ = run_gate(
        tmp_path / "runs", "capture.engine=sglang", "capture.sglang.tp_size=1", "job.capture.gpus_per_node=1", env=env
    )
    failure = failed_check(gate)
    assert code == 1 and failure["name"] == "sglang patch"
    assert "is not patched" in failure["detail"] and "tools/check_patch --apply" in failure["fix"]


@pytest.mark.slow
def test_master_down_fails_the_master_check(tmp_path: Path, tiny_assets: Path) -> None:
    code, gate, output = run_gate(tmp_path / "runs", "capture.owns_master=false", "transport.connect_timeout_s=5")
    failure = failed_check(gate)
    assert code != 0 and failure["name"] == "mooncake master health", output
    assert "does not accept connections" in failure["detail"] and "owns_master" in failure["fix"]


@pytest.mark.slow
def test_nan_on_one_rank_fails_the_update_check_naming_the_rank(tmp_path: Path, tiny_assets: Path) -> None:
    code, gate, output = run_gate(tmp_path / "runs", "capture.inject_nan_at_g=1")
    failure = failed_check(gate)
    assert code != 0 and failure["name"] == "finite update on every rank", output
    assert "loss term 'ce' is not finite on rank(s) [1]" in failure["detail"]
    assert statuses(gate)["captured sample contract"] == "PASS"


def test_allowed_blockers_need_no_sglang_on_the_login_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """--allow-blockers on a login node without SGLang: the patch is checked against the pinned wheel."""
    from launcher import gate
    from runtime.shared import sglang_patch_check

    if not sorted((REPO / ".cache" / "sglang").glob("sglang-0.5.23-*.whl")):
        pytest.skip("the pinned SGLang wheel is not cached (tools/bootstrap caches it)")
    monkeypatch.setattr(sglang_patch_check, "installed_sglang_root", lambda: None)
    # A blocker to allow: a trainer disk too small for the feature cache.
    loaded = load_recipe(REPO / "recipes" / "kimi_k3_v1c.yaml", ["plan.trainer_local_disk_bytes=1GB"])
    checks = {c.name: c for c in gate.preflight_checks(loaded, REPO, allow_blockers=True)}
    assert checks["plan"].status == gate.PASS and "--allow-blockers" in checks["plan"].detail
    assert checks["sglang patch"].status == gate.PASS, checks["sglang patch"]
    assert "pinned wheel" in checks["sglang patch"].detail
