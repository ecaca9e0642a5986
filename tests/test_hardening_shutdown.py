"""Issue 15, item 10: when a component fails, the local supervisor stops every task of the other
component at once (SIGTERM to all, then one grace deadline from ``job.stop_grace_s``), instead of
one task at a time."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.support.launcher_cli import launch, probe_overrides

pytestmark = pytest.mark.distributed

STOP_DELAY_S = 3


def only_job_dir(runs_dir: Path) -> Path:
    (job_dir,) = [p for p in (runs_dir / "tiny").iterdir() if p.is_dir()]
    return job_dir


@pytest.mark.slow
def test_failed_capture_stops_all_trainer_ranks_in_parallel(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    data = tmp_path / "train.jsonl"  # the probe reads no data; the preflight checks its digest
    data.write_text('{"id": "r0", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}\n')
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    done = launch(
        [
            "tiny",
            "--local",
            "--probe",
            *probe_overrides(runs),
            "--set",
            f"data.train_path={data}",
            "--set",
            f"data.expected_sha256={digest}",
            "--set",
            "data.num_rows=null",
            "--set",
            "job.env.DSPARK_PROBE_FAIL=capture",
            "--set",
            "job.env.DSPARK_PROBE_HOLD_S=120",
            "--set",
            f"job.env.DSPARK_PROBE_STOP_DELAY_S={STOP_DELAY_S}",
            "--set",
            "job.stop_grace_s=60",
        ]
    )
    assert done.returncode != 0
    stops = only_job_dir(runs) / "probe" / "stops"
    signalled = {p.stem: float(p.read_text()) for p in stops.glob("trainer_*.term")}
    left = {p.stem: float(p.read_text()) for p in stops.glob("trainer_*.exit")}
    assert len(signalled) == 4 and len(left) == 4, (sorted(signalled), sorted(left), done.stderr[-2000:])
    # every rank got its SIGTERM before any rank had finished stopping: they stop side by side
    assert max(signalled.values()) < min(left.values()), (signalled, left)
