"""tools/derive_smoke_data: the smoke fixture is the N longest rows, with a manifest a recipe's
``expected_sha256: manifest`` accepts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from runtime.shared.data_files import check_data_sha256, iter_rows, sha256_file, write_rows
from tools.smoke_data import derive

REPO = Path(__file__).resolve().parent.parent


def full_file(folder: Path) -> Path:
    rows = [
        {"id": f"r{i}", "input_ids": list(range(2 + (i * 7) % 11)), "loss_mask": [0] + [1] * (1 + (i * 7) % 11)}
        for i in range(20)
    ]
    path = folder / "full.jsonl"
    write_rows(path, rows)
    return path


def test_longest_rows_in_file_order_with_manifest(tmp_path: Path) -> None:
    full = full_file(tmp_path)
    manifest = derive(full, sha256_file(full), 4, tmp_path / "smoke.jsonl")
    chosen = list(iter_rows(tmp_path / "smoke.jsonl"))
    lengths = sorted(r.num_tokens for r in iter_rows(full))
    assert len(chosen) == 4 and sorted(r.num_tokens for r in chosen) == lengths[-4:]
    indices = manifest["derived_from"]["row_indices"]
    assert indices == sorted(indices) and [f"r{i}" for i in indices] == [r.id for r in chosen]
    assert check_data_sha256(tmp_path / "smoke.jsonl", "manifest") == manifest["sha256"]


def test_recipe_mode_writes_the_smoke_overlay_path(tmp_path: Path) -> None:
    full = full_file(tmp_path)
    doc = yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())
    doc["data"].update(train_path=str(full), expected_sha256=sha256_file(full), num_rows=20, chat_path=None)
    doc["smoke"]["data"] = {
        "train_path": str(tmp_path / "smoke" / "rows.jsonl"),
        "expected_sha256": "manifest",
        "num_rows": 3,
    }
    recipe = tmp_path / "fixture.yaml"
    recipe.write_text(yaml.safe_dump(doc))
    done = subprocess.run(
        [str(REPO / "tools" / "derive_smoke_data"), "--recipe", str(recipe)], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "smoke" / "rows.jsonl.manifest.json").read_text())
    assert manifest["rows"] == 3 and manifest["derived_from"]["sha256"] == sha256_file(full)
    wrong = subprocess.run(
        [
            str(REPO / "tools" / "derive_smoke_data"),
            "--input",
            str(full),
            "--expected-sha256",
            "0" * 64,
            "--rows",
            "2",
            "--output",
            str(tmp_path / "x.jsonl"),
        ],
        capture_output=True,
        text=True,
    )
    assert wrong.returncode == 2 and "0" * 64 in wrong.stderr and not (tmp_path / "x.jsonl").exists()
