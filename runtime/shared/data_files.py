"""The pre-tokenized training data file: rows, SHA-256, the manifest beside it, and its checks.

Pure Python (no torch, no numpy at module level) so that the login-node launcher can import it to
refuse a submission whose data does not match the recipe, and so that ``tools/verify_data`` and the
producer share one reading of the format.

Format: JSON Lines, one row per line, ``{"id": str, "input_ids": [int], "loss_mask": [0|1]}``.
The manifest is ``<file>.manifest.json`` (see :func:`manifest_path`); ``data.expected_sha256:
manifest`` in a recipe means "the SHA-256 recorded there".
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.files import atomic_write_text
from runtime.user_errors import UserError, require_regular_file

MANIFEST_FORMAT = "dspark-data-manifest/1"
MANIFEST_SUFFIX = ".manifest.json"
EXPECTED_FROM_MANIFEST = "manifest"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HASH_CHUNK_BYTES = 8 * 2**20


class DataFileError(UserError, ValueError):
    """A data file, row or manifest that cannot be used. The message names the file, the row or
    field, and the fix."""


@dataclass(frozen=True)
class DataRow:
    """One pre-tokenized row."""

    index: int
    """0-based row number (line number - 1)."""
    id: str
    input_ids: list[int]
    loss_mask: list[int]

    @property
    def num_tokens(self) -> int:
        """Tokens in the row."""
        return len(self.input_ids)


@dataclass
class DataSummary:
    """What :func:`verify_data_file` found in a file that passed every check."""

    path: Path
    sha256: str
    rows: int
    tokens: int
    masked_tokens: int
    max_row_tokens: int
    min_row_tokens: int
    warnings: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# SHA-256 and the manifest
# ----------------------------------------------------------------------------------------------


def sha256_file(path: str | Path, chunk_bytes: int = _HASH_CHUNK_BYTES) -> str:
    """Hex SHA-256 of a file, streamed in ``chunk_bytes`` pieces (multi-GB files stay cheap)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_path(data_path: str | Path) -> Path:
    """The manifest beside a data file: ``train.jsonl`` -> ``train.jsonl.manifest.json``."""
    data_path = Path(data_path)
    return data_path.with_name(data_path.name + MANIFEST_SUFFIX)


def read_manifest(data_path: str | Path) -> dict[str, Any]:
    """The manifest of ``data_path``; a clear error when it is absent or malformed."""
    path = manifest_path(data_path)
    require_regular_file(path, "manifest", "regenerate it with tools/prepare_data")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataFileError(
            f"{path}: manifest not found (expected beside the data file {data_path}); "
            "fix: write it with tools/prepare_data, or put the data file's real SHA-256 in "
            "data.expected_sha256 instead of 'manifest'"
        ) from None
    except json.JSONDecodeError as exc:
        raise DataFileError(
            f"{path}: manifest is not valid JSON ({exc}); fix: regenerate it with tools/prepare_data"
        ) from exc
    if not isinstance(manifest, dict):
        raise DataFileError(
            f"{path}: the manifest holds a JSON {type(manifest).__name__}, not an object with format, sha256, ...; "
            "fix: regenerate it with tools/prepare_data"
        )
    if manifest.get("format") != MANIFEST_FORMAT:
        raise DataFileError(
            f"{path}: field 'format' is {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
            f"expected {MANIFEST_FORMAT!r}; fix: regenerate it with tools/prepare_data"
        )
    sha = manifest.get("sha256")
    if not isinstance(sha, str) or not _HEX64.match(sha):
        raise DataFileError(f"{path}: field 'sha256' is {sha!r}, not 64 lowercase hex digits; fix: regenerate it")
    return manifest


def write_manifest(data_path: str | Path, manifest: dict[str, Any]) -> Path:
    """Write ``manifest`` beside ``data_path`` atomically (temp name, then rename)."""
    path = manifest_path(data_path)
    payload = {"format": MANIFEST_FORMAT, **{k: v for k, v in manifest.items() if k != "format"}}
    atomic_write_text(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return path


def resolve_expected_sha256(data_path: str | Path, expected_sha256: str) -> str:
    """The SHA-256 a recipe expects: its literal hex, or the manifest's for ``manifest``."""
    if expected_sha256 == EXPECTED_FROM_MANIFEST:
        return str(read_manifest(data_path)["sha256"])
    if not _HEX64.match(expected_sha256):
        raise DataFileError(
            f"data.expected_sha256 is {expected_sha256!r}; fix: write 64 lowercase hex digits (sha256sum FILE) or "
            "'manifest'"
        )
    return expected_sha256


def check_data_sha256(
    data_path: str | Path,
    expected_sha256: str,
    recipe_file: str = "the recipe",
    field_name: str = "data.expected_sha256",
) -> str:
    """Refuse data that does not match the recipe: returns the file's SHA-256 when it equals the
    expected one (literal hex, or ``manifest``), raises :class:`DataFileError` otherwise.

    The launcher calls this before submitting; the error names the recipe file, the field, both
    values and the fix.
    """
    data_path = Path(data_path)
    require_regular_file(data_path, f"{recipe_file}: data.train_path", "give the prepared JSONL file")
    if not data_path.is_file():
        raise DataFileError(
            f"{recipe_file}: data.train_path {data_path} does not exist; fix: run tools/prepare_data "
            "(for recipes/tiny.yaml: tools/make_tiny_target, then tools/prepare_data --recipe tiny)"
        )
    expected = resolve_expected_sha256(data_path, expected_sha256)
    actual = sha256_file(data_path)
    if actual != expected:
        origin = (
            f"the manifest {manifest_path(data_path).name}" if expected_sha256 == EXPECTED_FROM_MANIFEST else field_name
        )
        raise DataFileError(
            f"{recipe_file}: {field_name}: {data_path} has SHA-256 {actual}, but {origin} expects "
            f"{expected}; fix: use the data file the recipe was written for, or, if this file is the "
            f"intended one, set {field_name}: {actual} (re-run tools/prepare_data to refresh the manifest)"
        )
    return actual


# ----------------------------------------------------------------------------------------------
# rows
# ----------------------------------------------------------------------------------------------


def parse_row(line: bytes | str, index: int, path: str | Path) -> DataRow:
    """Parse one line; errors name the file, the row (1-based line number) and the fix."""
    where = f"{path}: row {index + 1} (line {index + 1})"
    try:
        text = line.decode("utf-8") if isinstance(line, bytes) else line
    except UnicodeDecodeError as exc:
        raise DataFileError(
            f"{where}: not UTF-8 (byte 0x{line[exc.start]:02x} at column {exc.start + 1}); the row is corrupted; "
            "fix: regenerate the file with tools/prepare_data"
        ) from None
    if not text.endswith("\n"):
        raise DataFileError(
            f"{where}: the last line has no newline, so the file looks truncated (a partial write?); "
            "fix: regenerate the file with tools/prepare_data"
        )
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataFileError(
            f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); the row looks truncated or corrupted; fix: regenerate the file with tools/prepare_data"
        ) from None
    if not isinstance(obj, dict):
        raise DataFileError(f"{where}: expected a JSON object {{id, input_ids, loss_mask}}, got {type(obj).__name__}")
    missing = [k for k in ("id", "input_ids", "loss_mask") if k not in obj]
    if missing:
        raise DataFileError(
            f"{where}: missing field(s) {', '.join(missing)}; fix: every row needs id, input_ids, loss_mask"
        )
    row_id = obj["id"]
    where = f"{path}: row {index + 1} (id {row_id!r})"
    ids, mask = obj["input_ids"], obj["loss_mask"]
    # set(map(type, ...)) runs in C: ten times faster than a generator over 64K tokens per row
    if not isinstance(ids, list) or not set(map(type, ids)) <= {int}:
        raise DataFileError(f"{where}: field input_ids must be a list of integers")
    if not isinstance(mask, list) or not set(map(type, mask)) <= {int}:
        raise DataFileError(f"{where}: field loss_mask must be a list of integers")
    return DataRow(index=index, id=str(row_id), input_ids=ids, loss_mask=mask)


def iter_rows(path: str | Path) -> Iterator[DataRow]:
    """Every row of a data file, in order (parsed lazily, one line at a time)."""
    with open(path, "rb") as handle:
        for index, line in enumerate(handle):
            yield parse_row(line, index, path)


def check_row(row: DataRow, path: str | Path, vocab_size: int | None, max_length: int | None) -> None:
    """Row-level sanity: lengths agree and fit, ids in the vocabulary, mask is 0/1 and not empty."""
    where = f"{path}: row {row.index + 1} (id {row.id!r})"
    if not row.input_ids:
        raise DataFileError(f"{where}: input_ids is empty; fix: drop the row")
    if len(row.loss_mask) != len(row.input_ids):
        raise DataFileError(
            f"{where}: loss_mask has {len(row.loss_mask)} entries but input_ids has {len(row.input_ids)}; "
            "fix: regenerate the row with tools/prepare_data"
        )
    if max_length is not None and len(row.input_ids) > max_length:
        raise DataFileError(
            f"{where}: {len(row.input_ids)} tokens, above data.max_length {max_length}; fix: re-run "
            f"tools/prepare_data --max-length {max_length}, or raise data.max_length"
        )
    # min/max/set run in C: a 462 x 64K-token file is checked in seconds; the slow scan that names
    # the position runs only on a row that fails.
    if vocab_size is not None and (min(row.input_ids) < 0 or max(row.input_ids) >= vocab_size):
        for position, token in enumerate(row.input_ids):
            if not 0 <= token < vocab_size:
                raise DataFileError(
                    f"{where}: input_ids[{position}] = {token} is outside the vocabulary 0..{vocab_size - 1} "
                    "(capture.vocab_size); fix: tokenize with the target's tokenizer"
                )
    if not set(row.loss_mask) <= {0, 1}:
        for position, value in enumerate(row.loss_mask):
            if value not in (0, 1):
                raise DataFileError(
                    f"{where}: loss_mask[{position}] = {value}; the mask holds only 0 and 1; fix: regenerate the "
                    "row with tools/prepare_data"
                )
    if not any(row.loss_mask):
        raise DataFileError(
            f"{where}: loss_mask is all zeros (no assistant tokens, e.g. truncated away); a draft learns "
            "nothing from it; fix: drop the row or raise --max-length in tools/prepare_data"
        )


def verify_data_file(
    path: str | Path,
    expected_sha256: str | None = None,
    vocab_size: int | None = None,
    max_length: int | None = None,
    num_rows: int | None = None,
) -> DataSummary:
    """Check a whole data file (SHA-256, rows, ids, masks, lengths); raise on the first problem."""
    path = Path(path)
    require_regular_file(path, "data file", "give the prepared JSONL file")
    if not path.is_file():
        raise DataFileError(f"{path}: data file does not exist; fix: run tools/prepare_data")
    actual_sha = sha256_file(path)
    if expected_sha256 is not None:
        expected = resolve_expected_sha256(path, expected_sha256)
        if actual_sha != expected:
            raise DataFileError(
                f"{path}: SHA-256 is {actual_sha}, expected {expected}"
                f"{' (from the manifest)' if expected_sha256 == EXPECTED_FROM_MANIFEST else ''}; "
                "fix: use the intended file or update data.expected_sha256"
            )
    rows = tokens = masked = 0
    longest, shortest = 0, None
    warnings: list[str] = []
    seen_ids: dict[str, int] = {}
    for row in iter_rows(path):
        check_row(row, path, vocab_size, max_length)
        if row.id in seen_ids:
            warnings.append(f"row {row.index + 1}: id {row.id!r} repeats row {seen_ids[row.id] + 1}")
        seen_ids.setdefault(row.id, row.index)
        mask_bytes = bytes(row.loss_mask)  # 0/1 only (check_row): byte scans run in C
        if b"\x01\x01" not in mask_bytes:
            warnings.append(
                f"row {row.index + 1} (id {row.id!r}): no two adjacent assistant tokens, so no DSpark anchor is eligible"
            )
        rows += 1
        tokens += row.num_tokens
        masked += mask_bytes.count(1)
        longest = max(longest, row.num_tokens)
        shortest = row.num_tokens if shortest is None else min(shortest, row.num_tokens)
    if rows == 0:
        raise DataFileError(f"{path}: the file has no rows; fix: run tools/prepare_data on a non-empty chat file")
    if num_rows is not None and rows != num_rows:
        raise DataFileError(
            f"{path}: {rows} rows, but data.num_rows is {num_rows}; fix: use the intended file or set data.num_rows: {rows}"
        )
    return DataSummary(path, actual_sha, rows, tokens, masked, longest, shortest or 0, warnings)


class RowIndex:
    """Random access to the rows of a data file by row number, without holding them in memory.

    The producer needs row ``i`` in prompt order; a K3 file is hundreds of MB of JSON, so only the
    byte offset of every line is kept and a row is parsed when it is captured.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        offsets: list[int] = []
        position = 0
        with open(self.path, "rb") as handle:
            for line in handle:
                offsets.append(position)
                position += len(line)
        self._offsets = offsets
        self._size = position

    def __len__(self) -> int:
        return len(self._offsets)

    def read(self, index: int) -> DataRow:
        """Row ``index`` (0-based), parsed."""
        if not 0 <= index < len(self._offsets):
            raise IndexError(f"{self.path}: row {index} outside 0..{len(self._offsets) - 1}")
        end = self._offsets[index + 1] if index + 1 < len(self._offsets) else self._size
        with open(self.path, "rb") as handle:
            handle.seek(self._offsets[index])
            line = handle.read(end - self._offsets[index])
        return parse_row(line, index, self.path)


def rows_text(rows: list[dict[str, Any]]) -> str:
    """Rows as canonical JSON Lines (compact, fixed key order): exactly what :func:`write_rows` writes."""
    return "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)


def write_rows(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Write rows as canonical JSON Lines (compact, fixed key order) atomically."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(path), rows_text(rows))
