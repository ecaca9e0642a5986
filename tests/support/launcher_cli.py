"""``python3 -m launcher ...`` as a subprocess of the tests, with fresh loopback ports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from runtime.shared.contracts import CONTRACT_ENV_NAMES, TRAINER_ENV_NAMES
from runtime.transport.loopback import free_port

REPO = Path(__file__).resolve().parents[2]

# The variables every component gets, whatever runs it (Slurm or --local).
CONTRACT = set(CONTRACT_ENV_NAMES)
TRAINER_CONTRACT = CONTRACT | set(TRAINER_ENV_NAMES)


def read_probes(job_dir: Path) -> dict[tuple[str, int], dict]:
    """Probe records of one job, keyed by (component, rank)."""
    records = {}
    for path in (job_dir / "probe").glob("*.json"):
        data = json.loads(path.read_text())
        records[(data["component"], data["rank"])] = data
    return records


TEST_RUN_OVERRIDES = ("trainer.epochs=2", "eval.after_training=false", "eval.checkpoint_prompts=0")
"""The tests' tiny run: 32 steps (the recipe's 96 make the default run show a trained draft; the tests
need the pipeline, not the quality) without the evaluation around it (tests that check it ask for it)."""


def probe_overrides(runs_dir: Path, short_run: bool = True) -> list[str]:
    """Fresh ports and a private runs folder, so tests never collide with each other; with ``short_run``
    the tests' tiny run (:data:`TEST_RUN_OVERRIDES`)."""
    short = [arg for item in TEST_RUN_OVERRIDES for arg in ("--set", item)] if short_run else []
    return [
        *short,
        "--set",
        f"job.runs_dir={runs_dir}",
        "--set",
        f"job.master_port={free_port()}",
        "--set",
        f"transport.master_rpc_port={free_port()}",
        "--set",
        f"transport.metadata_http_port={free_port()}",
        "--set",
        f"transport.metrics_port={free_port()}",
    ]


def launch(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run ``python3 -m launcher ARGS`` from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args], cwd=REPO, capture_output=True, text=True, timeout=300, **kwargs
    )  # type: ignore[call-overload]
