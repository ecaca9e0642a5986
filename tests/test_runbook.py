"""RUNBOOK.md's tested commands work as written: every ```bash block marked ``<!-- tested -->`` runs,
in order, as one script from the repository root, on the real local Slurm cluster.

The runbook's stop-and-resume on Slurm (16 steps, then ``--resume latest``, then an uninterrupted run)
is also this suite's check that a Slurm run resumes exactly: the runs it leaves consumed the prompt
order, and the resumed run's losses and final weights equal the uninterrupted run's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import copy_repository
from tests.support.tiny_runs import final_weights, metrics, prompt_rows

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.mooncake, pytest.mark.distributed]

REPO = Path(__file__).resolve().parent.parent
TESTED_BLOCK = re.compile(r"<!-- tested -->\s*\n```bash\n(.*?)```", re.DOTALL)


def runbook_blocks() -> list[str]:
    """The tested blocks of RUNBOOK.md, in order."""
    return TESTED_BLOCK.findall((REPO / "RUNBOOK.md").read_text())


def test_runbook_has_the_tiny_procedure() -> None:
    script = "\n".join(runbook_blocks())
    for command in (
        "tools/make_tiny_target",
        "tools/prepare_data --recipe tiny",
        "tools/verify_data --recipe tiny",
        "python3 -m launcher tiny --smoke",
        "python3 -m launcher tiny --resume latest",
        "tools/compare_runs",
        "python3 -m launcher kimi_k3_v1c --smoke --dry-run",
    ):
        assert command in script, f"RUNBOOK.md's tested blocks lack {command!r}"


def runs_state(repo: Path) -> tuple[list[str], str | None]:
    """What a user sees of the repository's runs/: its job folders and where jobs/latest points."""
    runs = repo / "runs"
    folders = sorted(str(p.relative_to(runs)) for p in runs.glob("*/*")) if runs.exists() else []
    latest = runs / "jobs" / "latest"
    return folders, (os.readlink(latest) if latest.is_symlink() else None)


def test_runbook_runbook_blocks_run_as_written(slurm_cluster, tiny_assets, tmp_path: Path) -> None:
    before = runs_state(REPO)
    copy = copy_repository(tmp_path / "repo", share_cache=True)
    script = "set -euo pipefail\n" + "\n".join(runbook_blocks())
    # The interpreter running the tests (the project venv) is the runbook's python3, as after
    # `source .venv/bin/activate`.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-c", script], cwd=copy, env=env, capture_output=True, text=True, timeout=1800)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert runs_state(REPO) == before, "the runbook test must leave the user's runs/ and runs/jobs/latest alone"
    assert (copy / "runs" / "jobs" / "latest").is_symlink()
    assert "smoke gate: PASS" in output
    assert "fits with streaming" in output and "not yet on a GPU" in output, "the K3 plan is honest"
    assert "#SBATCH hetjob" in output
    assert "resuming from" in output
    # The resumed run reproduces the uninterrupted one: its final checkpoint has the same weights.
    assert re.search(r"B: step_00000032 step 32 [0-9a-f]{64}  \(same as the other run\)", output), output[-3000:]
    assert_stop_and_resume_on_slurm_was_exact(copy / "runs" / "tiny")


def assert_stop_and_resume_on_slurm_was_exact(runs: Path) -> None:
    """The runbook's three training runs on Slurm: stopped at 16, resumed to 32, uninterrupted 32."""
    by_steps = {}
    for job_dir in sorted(runs.iterdir()):
        if (job_dir / "metrics.jsonl").exists() and not (job_dir / "gate.json").exists():
            records = metrics(job_dir)
            by_steps[(records[0]["step"], records[-1]["step"])] = (job_dir, records)
    assert set(by_steps) == {(1, 16), (17, 32), (1, 32)}, sorted(by_steps)
    stopped, resumed, full = by_steps[(1, 16)][1], by_steps[(17, 32)][1], by_steps[(1, 32)][1]
    rows = [row for r in full for row in r["row_indices"]]
    assert rows == prompt_rows(0, 256), "the optimizer saw exactly the prompt order"
    assert [row for r in stopped + resumed for row in r["row_indices"]] == rows
    assert [r["loss"] for r in stopped + resumed] == [r["loss"] for r in full], "the same losses, step by step"
    resumed_dir, full_dir = by_steps[(17, 32)][0], by_steps[(1, 32)][0]
    assert final_weights(resumed_dir / "checkpoints") == final_weights(full_dir / "checkpoints")
