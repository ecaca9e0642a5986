"""Issue 15, item 5: no orphans. ``kill -9`` of the ``--local`` supervisor takes its component tasks
with it (parent-death signal), and ``status``/``cancel`` say what really happened."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.control import _pid_alive
from tests.support.launcher_cli import launch, probe_overrides

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def test_killed_supervisor_takes_its_components_along(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    data = tmp_path / "train.jsonl"  # the probe reads no data; the preflight checks its digest
    data.write_text('{"id": "r0", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}\n')
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            "tiny",
            "--local",
            "--probe",
            "--set",
            "job.env.DSPARK_PROBE_HOLD_S=600",
            *probe_overrides(runs),
            "--set",
            f"data.train_path={data}",
            "--set",
            f"data.expected_sha256={digest}",
            "--set",
            "data.num_rows=null",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        job_dir = None
        while time.monotonic() < deadline:
            found = [p for p in (runs / "tiny").glob("*") if p.is_dir()] if (runs / "tiny").exists() else []
            if found and len(list((found[0] / "probe").glob("*.json"))) == 5:
                job_dir = found[0]
                break
            assert supervisor.poll() is None, "the supervisor ended early"
            time.sleep(0.5)
        assert job_dir is not None, "the probes did not all record within 180 s"
        status = json.loads((job_dir / "local_status.json").read_text())
        pids = [int(pid) for entry in status.values() for pid in entry["pids"].values()]
        assert len(pids) == 5 and all(_pid_alive(pid) for pid in pids)

        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_is_running(pid) for pid in pids):
            time.sleep(0.2)
        assert not [pid for pid in pids if _is_running(pid)], "component tasks outlived their supervisor"
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()

    report = launch(["status", str(job_dir)])
    assert "RUNNING" not in report.stdout, report.stdout
    assert "LOST" in report.stdout and "died before recording the end" in report.stdout, report.stdout
    cancelled = launch(["cancel", str(job_dir)])
    assert (
        cancelled.returncode == 1
        and "is not running" in cancelled.stderr
        and "nothing was cancelled" in cancelled.stderr
    )


def _is_running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and _pid_alive(pid) and os.path.exists(f"/proc/{pid}")
