"""The pre-tokenized data file: SHA-256 / manifest checks and row checks, each with a clear error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.shared.data_files import (
    DataFileError,
    RowIndex,
    check_data_sha256,
    manifest_path,
    read_manifest,
    resolve_expected_sha256,
    sha256_file,
    verify_data_file,
    write_manifest,
    write_rows,
)
from tests.conftest import REPO_ROOT


def _rows(count: int = 6) -> list[dict]:
    rows = []
    for index in range(count):
        length = 8 + index
        rows.append(
            {
                "id": f"row-{index}",
                "input_ids": [(7 * index + k) % 50 for k in range(length)],
                "loss_mask": [0] * 4 + [1] * (length - 4),
            }
        )
    return rows


def _write(path: Path, rows: list[dict]) -> str:
    write_rows(path, rows)
    sha = sha256_file(path)
    write_manifest(path, {"sha256": sha, "rows": len(rows)})
    return sha


def _raw_lines(rows: list[dict]) -> list[str]:
    return [json.dumps(row, separators=(",", ":")) + "\n" for row in rows]


def test_sha_matches_literal_and_manifest(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    sha = _write(path, _rows())
    assert check_data_sha256(path, sha) == sha
    assert check_data_sha256(path, "manifest") == sha
    assert resolve_expected_sha256(path, "manifest") == sha
    assert read_manifest(path)["rows"] == 6
    assert manifest_path(path).name == "train.jsonl.manifest.json"


def test_sha_mismatch_names_recipe_field_both_values_and_fix(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    sha = _write(path, _rows())
    wrong = "0" * 64
    with pytest.raises(DataFileError) as err:
        check_data_sha256(path, wrong, recipe_file="recipes/x.yaml")
    text = str(err.value)
    assert "recipes/x.yaml" in text and "data.expected_sha256" in text
    assert sha in text and wrong in text and "fix:" in text


def test_file_changed_after_its_manifest_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    _write(path, _rows())
    with open(path, "a") as handle:  # someone appended a row after prepare_data
        handle.write(_raw_lines(_rows(1))[0])
    with pytest.raises(DataFileError, match="the manifest train.jsonl.manifest.json expects"):
        check_data_sha256(path, "manifest")


def test_missing_manifest_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    write_rows(path, _rows())
    with pytest.raises(DataFileError, match="manifest not found.*tools/prepare_data"):
        check_data_sha256(path, "manifest")
    with pytest.raises(DataFileError, match="does not exist.*tools/prepare_data"):
        check_data_sha256(tmp_path / "nope.jsonl", "manifest")


def test_truncated_last_row(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    text = "".join(_raw_lines(_rows(4)))
    path.write_text(text[: len(text) - 25])  # cut inside row 4
    with pytest.raises(DataFileError, match=r"row 4 .*truncated"):
        verify_data_file(path)


def test_truncated_row_in_the_middle(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    lines = _raw_lines(_rows(4))
    lines[1] = lines[1][:30] + "\n"
    path.write_text("".join(lines))
    with pytest.raises(DataFileError, match=r"row 2 \(line 2\): not valid JSON"):
        verify_data_file(path)


def test_id_out_of_range_names_row_and_position(tmp_path: Path) -> None:
    rows = _rows()
    rows[3]["input_ids"][5] = 50
    path = tmp_path / "train.jsonl"
    _write(path, rows)
    with pytest.raises(
        DataFileError, match=r"row 4 \(id 'row-3'\): input_ids\[5\] = 50 is outside the vocabulary 0\.\.49"
    ):
        verify_data_file(path, vocab_size=50)
    verify_data_file(path, vocab_size=51)  # the same file passes with a larger vocabulary


def test_empty_mask(tmp_path: Path) -> None:
    rows = _rows()
    rows[2]["loss_mask"] = [0] * len(rows[2]["input_ids"])
    path = tmp_path / "train.jsonl"
    _write(path, rows)
    with pytest.raises(DataFileError, match=r"row 3 \(id 'row-2'\): loss_mask is all zeros"):
        verify_data_file(path)


def test_mask_values_and_lengths(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    rows = _rows()
    rows[0]["loss_mask"][6] = 2
    _write(path, rows)
    with pytest.raises(DataFileError, match=r"row 1 .*loss_mask\[6\] = 2"):
        verify_data_file(path)
    rows = _rows()
    rows[1]["loss_mask"].append(1)
    _write(path, rows)
    with pytest.raises(DataFileError, match=r"row 2 .*loss_mask has 10 entries but input_ids has 9"):
        verify_data_file(path)
    _write(path, _rows())
    with pytest.raises(DataFileError, match=r"row 6 .*13 tokens, above data.max_length 12"):
        verify_data_file(path, max_length=12)


def test_row_count_and_summary(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    sha = _write(path, _rows())
    with pytest.raises(DataFileError, match="6 rows, but data.num_rows is 7"):
        verify_data_file(path, num_rows=7)
    summary = verify_data_file(path, expected_sha256="manifest", vocab_size=50, max_length=64, num_rows=6)
    assert (summary.rows, summary.sha256) == (6, sha)
    assert summary.tokens == sum(8 + i for i in range(6))
    assert summary.masked_tokens == sum(4 + i for i in range(6))


def test_row_index_reads_any_row(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    rows = _rows(9)
    _write(path, rows)
    index = RowIndex(path)
    assert len(index) == 9
    for i in (8, 0, 4):
        row = index.read(i)
        assert (row.id, row.input_ids, row.loss_mask) == (rows[i]["id"], rows[i]["input_ids"], rows[i]["loss_mask"])


def test_module_is_importable_without_torch() -> None:
    code = (
        "import sys; import runtime.shared.data_files as d; "
        "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; "
        "assert not bad, bad; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
