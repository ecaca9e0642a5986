"""Rewrite the patch from an edited copy of the SGLang tree: the difference from the pinned wheel,
and the patch's new SHA-256 in the manifest."""

from __future__ import annotations

import difflib
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

from runtime.files import atomic_write_text
from runtime.sglang_patching.pinned_wheel import fetch_wheel
from runtime.sglang_patching.tree import package_root
from runtime.shared.data_files import sha256_file
from runtime.shared.sglang_patch_manifest import MANIFEST_PATH, PatchError, load_manifest


def unified_patch(pristine_root: Path, edited_root: Path, files: Iterable[str]) -> str:
    """A ``-p1`` unified diff (``a/`` and ``b/`` prefixes, no timestamps) of ``files``."""
    chunks = []
    for name in sorted(files):
        before = (pristine_root / name).read_text().splitlines(keepends=True)
        after = (edited_root / name).read_text().splitlines(keepends=True)
        chunks.extend(difflib.unified_diff(before, after, f"a/{name}", f"b/{name}", n=3))
    return "".join(chunks)


def regenerate(edited_tree: Path, target_name: str | None = None, manifest_path: Path = MANIFEST_PATH) -> Path:
    """Write the target's patch as the difference between the pinned wheel and ``edited_tree``
    (every ``.py`` file under ``sglang/`` that differs) and update the manifest's SHA-256. The
    changed files must be the ones the manifest lists (with their hooks): those stay hand-written."""
    manifest = load_manifest(manifest_path)
    target, _ = manifest.resolve(target_name)
    edited_root = package_root(edited_tree)
    wheel = fetch_wheel(target)
    with tempfile.TemporaryDirectory(prefix="dspark-regen-") as tmp:
        pristine = Path(tmp)
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if n.startswith("sglang/") and n.endswith(".py")]
            archive.extractall(pristine, names)
        changed = [
            n
            for n in names
            if (edited_root / n).is_file() and (edited_root / n).read_bytes() != (pristine / n).read_bytes()
        ]
        if not changed:
            raise PatchError(f"{edited_root} does not differ from the pinned wheel")
        text = unified_patch(pristine, edited_root, changed)
    if sorted(changed) != sorted(target.files):
        raise PatchError(
            f"{edited_root} changes {sorted(changed)}, but targets.{target.name}.files in {manifest_path} lists "
            f"{sorted(target.files)}: list the changed files there (and their hooks), then run again"
        )
    target.patch_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target.patch_file, text)
    manifest_text = manifest_path.read_text().replace(target.patch_sha256, sha256_file(target.patch_file))
    atomic_write_text(manifest_path, manifest_text)
    return target.patch_file
