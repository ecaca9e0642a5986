"""The whole tiny pipeline with ``capture.engine: sglang``: the real patched SGLang server (CPU, from the
capture venv) captures into Mooncake and the 4-rank gloo trainer trains on it, with ``--local`` and on
the real local Slurm cluster; the smoke gate passes every row against the real server; and a server
killed mid-run fails the capture component with a clear message, after which a resumed run gives
the optimizer exactly the sample sequence of the prompt order."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launcher.control import job_report
from launcher.jobs import find_record
from runtime.capture.sglang_cpu import cpu_server_overrides, tiny_asset_overrides
from tests.conftest import free_port
from tests.support.launcher_cli import probe_overrides
from tests.support.tiny_runs import final_weights, metrics, prompt_rows
from tests.test_sglang_server import require_capture_venv

# Each run starts the CPU server (2-4 minutes on a busy 2-core machine) before the trainer can step.
pytestmark = [
    pytest.mark.sglang_server,
    pytest.mark.slow,
    pytest.mark.mooncake,
    pytest.mark.distributed,
    pytest.mark.timeout(2700),
]

REPO = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 1500.0
STEPS = 6
GLOBAL_BATCH = 8
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


def sglang_sets(assets: Path, *extra: str) -> list[str]:
    # The trainer waits for its first sample while the server starts (up to minutes on a busy CPU).
    items = [*tiny_asset_overrides(assets), *cpu_server_overrides(free_port()), "transport.idle_timeout_s=900", *extra]
    return [arg for item in items for arg in ("--set", item)]


def launcher(args: list[str], timeout_s: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )


def new_job(runs: Path, before: set[Path]) -> Path:
    (job_dir,) = set((runs / "tiny").iterdir()) - before
    return job_dir


def run(
    mode: str, runs: Path, assets: Path, *extra: str, expect_ok: bool = True
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One tiny run with the SGLang engine; returns its job folder and the launcher's result."""
    before = set((runs / "tiny").iterdir()) if (runs / "tiny").exists() else set()
    args = ["tiny", *probe_overrides(runs), *sglang_sets(assets, *extra)]
    done = launcher([*args, "--local"] if mode == "local" else args)
    job_dir = new_job(runs, before)
    if mode == "slurm":
        assert done.returncode == 0, done.stdout + done.stderr
        record = find_record(str(job_dir), runs)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while (state := job_report(record).state) not in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}:
            assert time.monotonic() < deadline, f"job {record.job_id} still {state}"
            time.sleep(3)
        ok = state == "COMPLETED"
    else:
        ok = done.returncode == 0
    if expect_ok:
        assert ok, done.stdout[-3000:] + done.stderr[-3000:] + launcher(["logs", str(job_dir)], 120).stdout[-6000:]
    return job_dir, done


def capture_log(job_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((job_dir / "logs").glob("*_capture_0.out")))


def server_log(job_dir: Path) -> str:
    path = job_dir / "capture" / "sglang_server.log"
    return path.read_text(errors="replace") if path.exists() else ""


def test_smoke_gate_passes_every_row_against_the_real_server(tmp_path: Path, sglang_tiny_assets: Path) -> None:
    require_capture_venv()
    runs = tmp_path / "runs"
    done = launcher(["tiny", "--local", "--smoke", *probe_overrides(runs), *sglang_sets(sglang_tiny_assets)])
    (job_dir,) = list((runs / "tiny").iterdir())
    gate = json.loads((job_dir / "gate.json").read_text())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert {c["name"]: c["status"] for c in gate["checks"]} == dict.fromkeys(CHECKS, "PASS")
    by_name = {c["name"]: c for c in gate["checks"]}
    assert "sgl-venv" in by_name["sglang patch"]["detail"]
    assert "sglang" in by_name["engine health"]["detail"].lower()
    assert "hs bfloat16" in by_name["captured sample contract"]["detail"]
    assert "smoke gate: PASS" in done.stdout
    assert "launching: " in server_log(job_dir) and "sglang.launch_server" in server_log(job_dir)


@pytest.mark.parametrize("mode", ["local", pytest.param("slurm", marks=pytest.mark.slurm)])
def test_pipeline_trains_on_the_real_server_in_the_prompt_order(
    mode: str, tmp_path: Path, sglang_tiny_assets: Path, request: pytest.FixtureRequest
) -> None:
    require_capture_venv()
    if mode == "slurm":
        request.getfixturevalue("slurm_cluster")
    runs = tmp_path / "runs"
    job_dir, _ = run(mode, runs, sglang_tiny_assets, f"trainer.max_steps={STEPS}")
    records = metrics(job_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    consumed = [row for r in records for row in r["row_indices"]]
    assert consumed == prompt_rows(0, STEPS * GLOBAL_BATCH), "the optimizer saw exactly the prompt order"
    assert "SGLang server healthy after" in capture_log(job_dir)
    assert "sglang.launch_server" in server_log(job_dir)


def _server_pid(job_dir: Path) -> int | None:
    """The pid of the server the capture component launched (the engine logs it when it starts)."""
    found = re.findall(r"SGLang server started \(pid (\d+)\)", capture_log(job_dir))
    return int(found[-1]) if found else None


def _kill_server_after_step(job_dir: Path, step: int, killed: dict[str, float]) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        path = job_dir / "metrics.jsonl"
        steps = len(path.read_text().splitlines()) if path.exists() else 0
        pid = _server_pid(job_dir)
        if steps >= step and pid is not None:
            os.killpg(os.getpgid(pid), signal.SIGKILL)  # the whole server: launcher and scheduler
            killed["after_step"] = steps
            return
        time.sleep(0.5)


def test_a_server_killed_mid_run_fails_clearly_and_the_resumed_run_keeps_the_sequence(
    tmp_path: Path, sglang_tiny_assets: Path
) -> None:
    require_capture_venv()
    runs = tmp_path / "runs"
    checkpoints = tmp_path / "checkpoints"
    (runs / "tiny").mkdir(parents=True)
    before = set()
    killed: dict[str, float] = {}
    sets = [f"trainer.max_steps={STEPS}", f"trainer.checkpoint.dir={checkpoints}", "trainer.checkpoint.every_steps=2"]

    def killer() -> None:
        while not (jobs := set((runs / "tiny").iterdir()) - before):
            time.sleep(0.2)
        (job_dir,) = jobs
        _kill_server_after_step(job_dir, 2, killed)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    first, done = run("local", runs, sglang_tiny_assets, *sets, expect_ok=False)
    thread.join(timeout=5)
    assert killed, (
        "the server was never killed:\n" + done.stdout[-3000:] + done.stderr[-3000:] + capture_log(first)[-3000:]
    )
    assert done.returncode != 0, "a run whose capture server died must fail"
    log_text = capture_log(first)
    assert "the SGLang server exited with status -9" in log_text or "SGLang server" in log_text, log_text[-3000:]
    saved_step, _ = final_weights(checkpoints)
    assert 2 <= saved_step < STEPS

    resumed, _ = run("local", runs, sglang_tiny_assets, *sets, "trainer.checkpoint.resume_from=auto")
    records = metrics(resumed)
    assert [r["step"] for r in records] == list(range(saved_step + 1, STEPS + 1)), "continued from the checkpoint"
    consumed = [row for r in records for row in r["row_indices"]]
    assert consumed == prompt_rows(saved_step * GLOBAL_BATCH, (STEPS - saved_step) * GLOBAL_BATCH)
    assert final_weights(checkpoints)[0] == STEPS
