"""Issue 15, item 7: the data is checked before anything is submitted, not only its SHA-256. Each bad
row is refused by the launcher's preflight naming the file and the row, and no job folder is made."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.gate import FAIL, PASS, check_data
from runtime.recipe import load_recipe

REPO = Path(__file__).resolve().parent.parent


def _row(index: int, mask: list[int] | None = None) -> dict:
    ids = [5, 6, 7, 8, 9, 10]
    return {"id": f"r{index}", "input_ids": ids, "loss_mask": mask or [0, 0, 1, 1, 1, 1]}


def _write(path: Path, rows: list[dict], tail: bytes = b"") -> Path:
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + tail)
    return path


def _loaded(path: Path, *extra: str):
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    overrides = [f"data.train_path={path}", f"data.expected_sha256={digest}", "data.num_rows=null", *extra]
    return load_recipe(REPO / "recipes" / "tiny.yaml", overrides=overrides)


GOOD = [_row(i) for i in range(4)]
CASES = {
    "all-zero mask": (GOOD[:2] + [_row(2, [0] * 6)] + GOOD[3:], b"", "row 3 (id 'r2'): loss_mask is all zeros"),
    "mask value 2": (GOOD[:1] + [_row(1, [0, 1, 2, 1, 1, 1])] + GOOD[2:], b"", "row 2 (id 'r1'): loss_mask[2] = 2"),
    "non-UTF-8 line": (
        GOOD,
        b'{"id": "r4", "input_ids": [5], "loss_mask": [1], "x": "\xff"}\n',
        "row 5 (line 5): not UTF-8",
    ),
    "truncated last line": (GOOD, b'{"id": "r4", "input_ids": [5, 6', "row 5 (line 5): the last line has no newline"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_rows_fail_the_preflight_naming_file_and_row(case: str, tmp_path: Path) -> None:
    rows, tail, expected = CASES[case]
    path = _write(tmp_path / "train.jsonl", rows, tail)
    check = check_data(_loaded(path), REPO)
    assert check.status == FAIL, check
    assert str(path) in check.detail and expected in check.detail, check.detail
    assert check.fix, "a fix is named"


def test_sound_file_passes_and_counts_rows(tmp_path: Path) -> None:
    path = _write(tmp_path / "train.jsonl", GOOD)
    check = check_data(_loaded(path), REPO)
    assert check.status == PASS and "4 rows checked" in check.detail, check


def test_submission_is_refused_before_a_job_folder_exists(tmp_path: Path, tiny_assets: Path) -> None:
    # tiny_assets: the launcher builds a missing target before it checks the data (55 s or more here).
    rows, tail, expected = CASES["mask value 2"]
    path = _write(tmp_path / "train.jsonl", rows, tail)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    runs = tmp_path / "runs"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "tiny",
            "--local",
            "--set",
            f"data.train_path={path}",
            "--set",
            f"data.expected_sha256={digest}",
            "--set",
            "data.num_rows=null",
            "--set",
            f"job.runs_dir={runs}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert expected in done.stderr and str(path) in done.stderr, done.stderr
    assert not runs.exists() or not any(runs.rglob("recipe.resolved.json"))
