"""The K3 operator's first hour at the K3 recipe's own settings, on the local Slurm cluster, as RUNBOOK
section 5 writes it: ``python3 -m launcher kimi_k3_v1c --probe`` with only ``K3_FEATURE_CACHE_DIR`` set
(the target, data and warm-start paths are the smoke gate's), the link and the store measured with the
K3 recipe's own 1 GiB objects, then the plan with those facts; and a probe whose site variable does not
reach the job (a site whose sbatch exports nothing) FAILS with its reason in ``status``.

Not rehearsed here, because they need GPU nodes: the capture node's host-to-device rate (skipped, and
said, without CUDA), the smoke gate's in-job checks (the SGLang server at TP8 on the K3 target), the full
run. RUNBOOK names them as such."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from launcher.control import job_report
from launcher.jobs import find_record
from tests.support.launcher_cli import launch, probe_overrides

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent
SITE_PATHS = ("K3_TARGET_DIR", "K3_DATA_DIR", "K3_INIT_CHECKPOINT", "K3_FEATURE_CACHE_DIR")
JOB_TIMEOUT_S = 400.0
GIB_OBJECTS = "1,024 MiB"
"""How the probe names the K3 recipe's measurement objects (its largest sample, capped at 1 GiB)."""


def _runbook_probe_command() -> list[str]:
    """RUNBOOK's probe command, as written (section 5)."""
    text = (REPO / "RUNBOOK.md").read_text()
    (line,) = [line for line in text.splitlines() if line.startswith("python3 -m launcher kimi_k3_v1c --probe")]
    command = line.split("#", 1)[0].split()
    assert command == ["python3", "-m", "launcher", "kimi_k3_v1c", "--probe"], line
    return command[3:]


def _site_env(cache_dir: Path | None, **extra: str) -> dict[str, str]:
    """This environment without the K3 site paths, but for the cache folder when given."""
    env = {k: v for k, v in os.environ.items() if k not in SITE_PATHS}
    env["DSPARK_PROBE_MEASURE"] = "1"  # the suite skips the measurements in other probe jobs (conftest)
    if cache_dir is not None:
        env["K3_FEATURE_CACHE_DIR"] = str(cache_dir)
    return {**env, **extra}


def _wait(job_id: str, runs: Path) -> str:
    record = find_record(job_id, runs)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (state := job_report(record).state) not in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}:
        assert time.monotonic() < deadline, f"job {job_id} still {state} after {JOB_TIMEOUT_S:.0f} s"
        time.sleep(3)
    return state


def _submitted_id(stdout: str) -> str:
    return stdout.split("submitted job ", 1)[1].split()[0]


def test_the_k3_probe_runs_as_runbook_writes_it_and_measures_at_the_recipes_sizes(
    slurm_cluster, tmp_path: Path
) -> None:
    runs, cache = tmp_path / "runs", tmp_path / "nvme" / "feature_cache"
    cache.mkdir(parents=True)
    done = launch([*_runbook_probe_command(), *probe_overrides(runs, short_run=False)], env=_site_env(cache))
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = _submitted_id(done.stdout)
    assert _wait(job_id, runs) == "COMPLETED", launch(["logs", job_id, "--runs-dir", str(runs)]).stdout[-4000:]
    job_dir = Path(find_record(job_id, runs).job_dir)
    capture = json.loads((job_dir / "site_facts" / "facts_capture.json").read_text())
    trainer = json.loads((job_dir / "site_facts" / "facts_trainer.json").read_text())
    # The link: four 1 GiB objects in the capture's own segment, none evicted before trainer rank 0 read them.
    link = trainer["measured"]["link_get_gbps"]
    assert link["value"] > 0 and f"3 objects of {GIB_OBJECTS} read by trainer rank 0" in link["how"], trainer
    assert f"one {GIB_OBJECTS} object put" in capture["measured"]["store_put_gbps"]["how"], capture
    # The cache disk: the folder the variable names, never a folder literally called ${K3_FEATURE_CACHE_DIR}.
    assert f"written to {cache}," in trainer["measured"]["cache_read_gbps"]["how"], trainer
    assert not list(REPO.glob("$*")) and not list(job_dir.rglob("$*"))
    assert capture["skipped"] == {"h2d_gbps_per_gpu": "no CUDA device here"}  # a GPU node measures it
    status = launch(["status", job_id, "--runs-dir", str(runs)])
    assert status.returncode == 0 and "COMPLETED" in status.stdout
    assert "--resume" not in status.stdout, "a probe has no run to resume"
    logs = launch(["logs", job_id, "--runs-dir", str(runs), "--component", "trainer", "--rank", "0"]).stdout
    assert "no metrics yet" not in logs, "a probe trains nothing: no plots are drawn for it"
    # RUNBOOK's next command: the plan with the measured facts in place of the recipe's assumptions. These
    # "nodes" have this machine's memory, far below the 1.9 TB K3's capture node holds: refused, naming the
    # measured figure and where it came from.
    plan = launch(["kimi_k3_v1c", "--plan", "--site-facts", str(job_dir / "site_facts")], env=_site_env(cache))
    assert plan.returncode == 2, plan.stdout + plan.stderr
    (problem,) = [line for line in plan.stderr.splitlines() if "plan.capture_host_memory_bytes" in line]
    measured = capture["measured"]["capture_host_memory_available_bytes"]["value"]
    assert f"(from --set plan.capture_host_memory_bytes={measured})" in problem, plan.stderr
    assert f"the probe's measurements, from {job_dir / 'site_facts' / 'facts_capture.json'}" in plan.stderr


def test_a_probe_whose_site_variable_does_not_reach_the_job_fails_with_its_reason_in_status(
    slurm_cluster, tmp_path: Path
) -> None:
    """A site whose sbatch exports nothing (SBATCH_EXPORT=NONE): the login node had the variable, the job
    has not; the batch script refuses before any component starts, and status says so in one line."""
    runs, cache = tmp_path / "runs", tmp_path / "cache"
    cache.mkdir()
    env = _site_env(cache, SBATCH_EXPORT="NONE")
    done = launch([*_runbook_probe_command(), *probe_overrides(runs, short_run=False)], env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = _submitted_id(done.stdout)
    assert _wait(job_id, runs) == "FAILED"
    status = launch(["status", job_id, "--runs-dir", str(runs)])
    assert status.returncode == 1, status.stdout + status.stderr
    (reason,) = [line for line in status.stdout.splitlines() if "batch script failed" in line]
    assert re.search(
        r"note: the batch script failed before its components started: batch script line \d+: "
        r"K3_FEATURE_CACHE_DIR: export K3_FEATURE_CACHE_DIR before sbatch \(used by trainer.feature_cache.dir\)",
        reason,
    ), status.stdout
    logs = launch(["logs", job_id, "--runs-dir", str(runs)])
    assert logs.returncode == 0 and "K3_FEATURE_CACHE_DIR: export K3_FEATURE_CACHE_DIR" in logs.stdout, logs.stdout
    assert "the batch log above is all the job wrote" in logs.stdout
