"""Plots of a job's metrics (``plots/`` in its folder), drawn by ``tools/compare_runs`` in a child
process: the launcher stays free of matplotlib and torch. Used at the end of ``--local``, by trainer
rank 0's Slurm worker when the trainer ends, and by ``python3 -m launcher plots JOB``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from launcher.component import ChildStopped, run_attached
from runtime.user_errors import UserError, file_kind_problem, output_place

PLOTS_DIRNAME = "plots"
PLOT_TIMEOUT_S = 300.0


def plot_metrics(job_dir: Path, repo_root: Path, timeout_s: float = PLOT_TIMEOUT_S) -> tuple[bool, str]:
    """Draw ``job_dir/plots/*.png`` from ``job_dir/metrics.jsonl``; returns (ok, what happened)."""
    if not (job_dir / "metrics.jsonl").exists():
        return False, (
            f"no metrics yet: {job_dir / 'metrics.jsonl'} does not exist; fix: wait for the trainer's first logged "
            "step (trainer.log_every_steps), or see why it has none: `python3 -m launcher logs JOB --component trainer`"
        )
    kind = file_kind_problem(job_dir / "metrics.jsonl")
    if kind is not None:
        return False, (
            f"{job_dir / 'metrics.jsonl'} is {kind}, not a regular file; fix: move it away (the trainer writes a "
            "regular metrics.jsonl)"
        )
    try:  # plots/ is the job's own: a link that leads out of the folder is not written through
        output_place(
            job_dir / PLOTS_DIRNAME, "plots folder", within=job_dir, fix="remove the link; plots/ is made anew"
        )
    except UserError as exc:
        return False, str(exc)
    command = [sys.executable, "-m", "tools.compare_runs", str(job_dir), "--out", str(job_dir / PLOTS_DIRNAME)]
    try:
        done = run_attached(command, cwd=repo_root, capture=True, timeout_s=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"plots took longer than {timeout_s:.0f} s"
    except ChildStopped as exc:
        # The stop was meant for this process (a Slurm worker has its own handler): deliver it as it came.
        os.kill(os.getpid(), exc.signum)
        return False, "plots stopped; `python3 -m launcher plots JOB` draws them"
    if done.returncode != 0:
        return False, f"plots failed: {done.stderr.strip().removeprefix('error: ')[-400:]}"
    return True, f"plots in {job_dir / PLOTS_DIRNAME}"
