"""A checkpoint is trusted only whole (torch-free: the trainer, the launcher's ``eval`` and ``--resume``).

Every file of a checkpoint is covered by a record whose own integrity is checked:

- ``trainer_state.json`` records the size and SHA-256 of every file under ``dcp/`` (``files``), besides
  the step, cursor, RNG and the weights and optimizer hashes;
- ``trainer_state.json.sha256`` seals the state file itself: its SHA-256, in ``sha256sum`` format
  (``sha256sum -c trainer_state.json.sha256`` in the checkpoint folder checks it by hand). The state
  records ``"integrity": "sha256-seal/1"``, so a state that should have a seal and has none is refused.

So one changed byte anywhere is refused: in a shard or DCP's ``.metadata`` (its recorded digest differs),
in ``trainer_state.json`` (its seal differs; a ``"step": 8 -> 9`` edit included), in the seal (it no
longer matches the state). A file in ``dcp/`` that the state does not record, or a recorded one that is
gone, is refused too. The refusal names the file and the fix: the previous checkpoint, by name.

Checkpoints written before the seal (no ``integrity`` field, no seal file) are accepted as legacy: their
``dcp/`` files are still checked against the state's records, the state file itself cannot be, and the
caller says so in one line (:data:`LEGACY_NOTE`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from runtime.files import atomic_write_text
from runtime.shared.checkpoint_folders import STATE_FILE, complete_checkpoints
from runtime.user_errors import UserError

SEAL_FILE = f"{STATE_FILE}.sha256"
SEAL_SCHEME = "sha256-seal/1"
"""The ``integrity`` a sealed ``trainer_state.json`` records."""
DCP_DIR = "dcp"
FILE_HASH_THREADS = 8
"""Checkpoint files hashed at once (reads and hashlib run without the GIL): rank 0 reads back every
rank's files, 25 GiB for the K3 draft, which took 24 s on one thread (H200 host)."""
LEGACY_NOTE = (
    "predates the seal of trainer_state.json (no {seal}): its dcp/ files were checked against the state's "
    "records, the state file itself cannot be; accepted as a legacy checkpoint"
)


class CheckpointIntegrityError(UserError, ValueError):
    """A checkpoint that is not whole; the message names the file and the fix (the previous checkpoint)."""


def file_digest(file: Path) -> dict[str, Any]:
    """``{"bytes": N, "sha256": HEX}`` of one file."""
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        for block in iter(lambda: handle.read(16 << 20), b""):
            digest.update(block)
    return {"bytes": file.stat().st_size, "sha256": digest.hexdigest()}


def file_digests(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file under ``folder``, by relative path, hashed on
    :data:`FILE_HASH_THREADS` threads."""
    return digests_of(folder, sorted(p for p in folder.rglob("*") if p.is_file()))


def digests_of(folder: Path, files: list[Path]) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of ``files`` (under ``folder``), by path relative to it, on
    :data:`FILE_HASH_THREADS` threads."""
    if not files:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(FILE_HASH_THREADS, len(files)))) as pool:
        found = list(pool.map(file_digest, files))
    return {str(file.relative_to(folder)): digest for file, digest in zip(files, found, strict=True)}


def seal_text(state_bytes: bytes) -> str:
    """The seal file's content for ``trainer_state.json``'s exact bytes (``sha256sum`` format)."""
    return f"{hashlib.sha256(state_bytes).hexdigest()}  {STATE_FILE}\n"


def previous_fix(path: Path, use: str) -> str:
    """The fix for a checkpoint that is not whole: the previous complete one, by name (``use`` is
    ``resume`` or ``eval``), or none older."""
    older = [p for p in complete_checkpoints(path.parent) if p.name < path.name]
    if not older:
        return f"there is no older checkpoint in {path.parent}: start the run afresh, or move {path} away"
    previous = older[-1]
    how = (
        f"evaluate the previous checkpoint, --checkpoint {previous.name}"
        if use == "eval"
        else f"resume from the previous checkpoint, {previous.name} (--set trainer.checkpoint.resume_from={previous})"
    )
    return f"{how}, and move {path} away"


def verify_whole(path: Path, use: str = "resume", note: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Check that checkpoint ``path`` is whole (see the module docstring) and return its state.

    Raises :class:`CheckpointIntegrityError` naming the file and the fix; ``note`` gets the one line
    that says a legacy checkpoint was accepted."""
    state_file, seal_file = path / STATE_FILE, path / SEAL_FILE
    fix = previous_fix(path, use)
    try:
        raw = state_file.read_bytes()
        state = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointIntegrityError(
            f"{state_file} is unreadable ({exc}); this checkpoint cannot be used. Fix: {fix}"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointIntegrityError(f"{state_file} holds a {type(state).__name__}, not a trainer state. Fix: {fix}")
    if seal_file.is_file():
        try:
            sealed = seal_file.read_text(encoding="utf-8").split()[0]
        except (OSError, UnicodeDecodeError, IndexError) as exc:
            raise CheckpointIntegrityError(f"{seal_file} is unreadable ({exc}). Fix: {fix}") from None
        actual = hashlib.sha256(raw).hexdigest()
        if sealed != actual:
            raise CheckpointIntegrityError(
                f"{state_file} does not match its seal {seal_file} (sha256 {actual}, sealed {sealed}): one of them "
                f"was changed after the save, so this checkpoint cannot be trusted. Fix: {fix}"
            )
    elif state.get("integrity"):
        raise CheckpointIntegrityError(
            f"{seal_file} is missing: {state_file} records integrity {state['integrity']!r}, and without its seal "
            f"the state cannot be trusted. Fix: {fix}"
        )
    elif note is not None:
        note(f"checkpoint {path} " + LEGACY_NOTE.format(seal=SEAL_FILE))
    _verify_files(path, state, fix)
    return state


def _verify_files(path: Path, state: dict[str, Any], fix: str) -> None:
    """Every file under ``dcp/``: recorded, of the recorded size and SHA-256; nothing unrecorded."""
    recorded = state.get("files")
    if not recorded:
        if state.get("integrity"):
            raise CheckpointIntegrityError(f"{path / STATE_FILE} records no files. Fix: {fix}")
        return  # a checkpoint from before file records: the loaded-tensor hashes are still checked
    actual = file_digests(path / DCP_DIR)
    for name, want in sorted(recorded.items()):
        file = path / DCP_DIR / name
        got = actual.get(name)
        if got is None:
            raise CheckpointIntegrityError(
                f"checkpoint file {file} is missing; this checkpoint cannot be used. Fix: {fix}"
            )
        if got["bytes"] != want["bytes"]:
            raise CheckpointIntegrityError(
                f"checkpoint file {file} has {got['bytes']} bytes, {want['bytes']} were written (truncated or "
                f"overwritten). Fix: {fix}"
            )
        if got["sha256"] != want["sha256"]:
            raise CheckpointIntegrityError(
                f"checkpoint file {file} is corrupt: sha256 {got['sha256']}, {want['sha256']} when written. Fix: {fix}"
            )
    extra = sorted(set(actual) - set(recorded))
    if extra and state.get("integrity"):
        raise CheckpointIntegrityError(
            f"checkpoint file {path / DCP_DIR / extra[0]} was not written by the save ({path / STATE_FILE} does not "
            f"record it{f'; {len(extra) - 1} more' if len(extra) > 1 else ''}). Fix: {fix}"
        )


def write_seal(path: Path, state_bytes: bytes) -> None:
    """Write the seal of ``trainer_state.json`` (whose exact bytes are ``state_bytes``) atomically."""
    atomic_write_text(path / SEAL_FILE, seal_text(state_bytes))


def seal_json(payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``payload`` with ``integrity`` set, and the exact text to write as ``trainer_state.json``."""
    sealed = {**payload, "integrity": SEAL_SCHEME}
    return json.dumps(sealed, indent=2) + "\n", sealed


EXPORT_MANIFEST = "export.sha256"
"""In an exported draft folder: the SHA-256 of every other file in it (``sha256sum`` format;
``sha256sum -c export.sha256`` there checks it by hand)."""


def write_export_manifest(folder: Path, known: dict[str, dict[str, Any]] | None = None) -> None:
    """Record every file of an exported draft folder (before it gets its final name); ``known`` are
    digests already taken of some of its files (by relative path), which are not read again."""
    known = known or {}
    rest = sorted(p for p in folder.rglob("*") if p.is_file() and str(p.relative_to(folder)) not in known)
    digests = {**known, **digests_of(folder, rest)}
    lines = [f"{d['sha256']}  {name}\n" for name, d in sorted(digests.items()) if name != EXPORT_MANIFEST]
    atomic_write_text(folder / EXPORT_MANIFEST, "".join(lines))


def export_fix(folder: Path) -> str:
    """The fix for an exported draft that cannot be trusted: export again, or evaluate its checkpoint."""
    step = folder.name.removeprefix("export-")
    return (
        f"export the draft again from its checkpoint, or evaluate the checkpoint itself (--checkpoint {step})"
        if step != folder.name
        else "export the draft again from its checkpoint"
    )


def verify_export(folder: Path, note: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]] | None:
    """Check an exported draft folder against its manifest: every file recorded and unchanged, none added.
    Returns the files' digests (by relative path, the manifest left out). An export from before the
    manifest is accepted, ``note`` says so, and None is returned."""
    manifest = folder / EXPORT_MANIFEST
    fix = export_fix(folder)
    if not manifest.is_file():
        if note is not None:
            note(
                f"exported draft {folder} has no {EXPORT_MANIFEST} (written before exports recorded their files): "
                "its files cannot be checked; accepted as a legacy export"
            )
        return None
    recorded: dict[str, str] = {}
    for number, line in enumerate(manifest.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        digest, _, name = line.partition("  ")
        if len(digest) != 64 or not name:
            raise CheckpointIntegrityError(f"{manifest}:{number} is not a 'SHA256  FILE' line. Fix: {fix}")
        recorded[name] = digest
    actual = file_digests(folder)
    actual.pop(EXPORT_MANIFEST, None)
    for name, digest in sorted(recorded.items()):
        if name not in actual:
            raise CheckpointIntegrityError(f"exported file {folder / name} is missing. Fix: {fix}")
        if actual[name]["sha256"] != digest:
            raise CheckpointIntegrityError(
                f"exported file {folder / name} is corrupt: sha256 {actual[name]['sha256']}, {digest} when written "
                f"(recorded in {manifest}). Fix: {fix}"
            )
    extra = sorted(set(actual) - set(recorded))
    if extra:
        raise CheckpointIntegrityError(
            f"exported file {folder / extra[0]} was not written by the export ({manifest} does not record it). "
            f"Fix: {fix}"
        )
    return actual
