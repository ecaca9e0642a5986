"""Check, and with ``apply`` patch, an SGLang source tree: an installed ``site-packages`` folder, the
``sglang`` package folder itself, or an SGLang git checkout whose package sits under ``python/``.

1. find the folder that holds ``sglang/`` (any layout) and the SGLang version there;
2. classify the tree: pristine (the patch applies: forward dry-run), patched by this patch (the
   reverse dry-run applies, and the record agrees), patched by another patch version (the record
   names it), or changed in a way the patch does not fit;
3. apply the patch into a temporary copy of the touched files, byte-compile every patched file and
   check that each hook symbol is defined.

``apply`` then patches the tree itself, idempotently, and writes the record that
:func:`runtime.shared.sglang_patch_check.check_installed` reads.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import py_compile
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from runtime.files import atomic_write_text
from runtime.sglang_patching.gnu_patch import patched_files, run_patch
from runtime.shared.data_files import sha256_file
from runtime.shared.sglang_patch_check import (
    APPLY_FIX,
    RECORD_FORMAT,
    RECORD_NAME,
    PatchReport,
    check_hooks,
    read_record,
    tree_version,
)
from runtime.shared.sglang_patch_manifest import Manifest, PatchError, Target, check_patch_file, load_manifest


def package_root(path: Path) -> Path:
    """The folder holding ``sglang/`` for any of the layouts: that folder itself (site-packages),
    the ``sglang`` package folder, or an SGLang git checkout (package under ``python/``)."""
    path = path.resolve()
    for candidate in (path, path / "python", path.parent):
        if (candidate / "sglang" / "srt").is_dir() and (candidate / "sglang" / "__init__.py").is_file():
            if candidate == path.parent and path.name != "sglang":
                continue
            return candidate
    raise PatchError(
        f"{path} holds no SGLang source: expected {path}/sglang/srt (installed package), "
        f"{path}/python/sglang/srt (git checkout) or {path}/srt (the package folder)"
    )


def write_record(root: Path, target: Target, files: Iterable[str], how: str) -> Path:
    """Record what was applied (atomically: temp name, then rename)."""
    path = root / "sglang" / RECORD_NAME
    record = {
        "format": RECORD_FORMAT,
        "target": target.name,
        "patch_sha256": target.patch_sha256,
        "sglang_version": target.sglang_version,
        "applied_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "how": how,
        "files": {name: sha256_file(root / name) for name in files},
    }
    atomic_write_text(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def byte_compile(root: Path, files: Iterable[str]) -> list[str]:
    """Compile every patched Python file (into a temporary folder); returns the problems."""
    problems = []
    with tempfile.TemporaryDirectory(prefix="dspark-pyc-") as out:
        for index, name in enumerate(files):
            if not name.endswith(".py"):
                continue
            try:
                py_compile.compile(str(root / name), cfile=os.path.join(out, f"{index}.pyc"), doraise=True)
            except py_compile.PyCompileError as exc:
                problems.append(f"{name} does not compile: {exc.msg}")
    return problems


def classify(root: Path, target: Target) -> tuple[str, str]:
    """(state, detail) of the tree under ``root`` for ``target``."""
    record = read_record(root)
    if record is not None and (
        record.get("target") != target.name or record.get("patch_sha256") != target.patch_sha256
    ):
        if run_patch(root, target.patch_file)[0]:
            # pip's --force-reinstall restores the files but leaves our record (pip does not own it):
            # the files are the truth, and applying writes a new record.
            return "pristine", (
                f"the patch applies (dry-run); {RECORD_NAME} is left from patch SHA-256 "
                f"{str(record.get('patch_sha256'))[:12]}... over files reinstalled since"
            )
        return "patched-other", (
            f"{root / 'sglang' / RECORD_NAME} records patch target {record.get('target')!r} "
            f"(patch SHA-256 {str(record.get('patch_sha256'))[:12]}...), not {target.name!r} "
            f"(patch SHA-256 {target.patch_sha256[:12]}...)"
        )
    forward, forward_out = run_patch(root, target.patch_file)
    if forward:
        if record is not None:
            return "foreign", f"the record says patched, but the files are unpatched (patch dry-run applies): {root}"
        return "pristine", "the patch applies (dry-run)"
    reverse, _ = run_patch(root, target.patch_file, reverse=True)
    if reverse:
        return "patched", "already patched with this patch (reverse dry-run applies)"
    other = installed_patch_id(root)
    if other is not None and other != target.patch_id:
        return (
            "patched-other",
            f"{root} carries dspark-capture patch {other!r}, not {target.patch_id!r} (target {target.name})",
        )
    return "foreign", f"the patch does not fit this tree (forward and reverse dry-runs fail):\n{_indent(forward_out)}"


_PATCH_ID_FILE = "sglang/srt/managers/scheduler_components/batch_result_processor.py"


def installed_patch_id(root: Path) -> str | None:
    """The ``DSPARK_CAPTURE_PATCH`` value some version of this patch left in the tree, if any."""
    path = root / _PATCH_ID_FILE
    if not path.is_file():
        return None
    match = re.search(r"""^DSPARK_CAPTURE_PATCH\s*=\s*["']([^"']+)["']""", path.read_text(errors="replace"), re.M)
    return match.group(1) if match else None


def _indent(text: str, limit: int = 1500) -> str:
    text = text if len(text) <= limit else text[:limit] + " ..."
    return "\n".join("      " + line for line in text.splitlines())


def _check_copy(root: Path, target: Target, report: PatchReport) -> None:
    """Apply into a temporary copy of the touched files, byte-compile them, check the hooks."""
    files = list(target.files)
    with tempfile.TemporaryDirectory(prefix="dspark-patch-") as tmp:
        copy_root = Path(tmp)
        for name in files:
            (copy_root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, copy_root / name)
        clean, output = run_patch(copy_root, target.patch_file, dry_run=False)
        if not clean:
            report.problems.append(f"applying into a temporary copy failed:\n{_indent(output)}")
            return
        report.steps.append(f"applied into a temporary copy ({len(files)} files)")
        _verify_patched(copy_root, target, report, where="the temporary copy")


def _verify_patched(root: Path, target: Target, report: PatchReport, where: str = "the tree") -> None:
    problems = byte_compile(root, target.files)
    problems += check_hooks(root, target.hooks)
    if problems:
        report.problems += [f"{where}: {p}" for p in problems]
    else:
        report.steps.append(
            f"{where}: {len(target.files)} patched files byte-compile; {len(target.hooks)} hook symbols present"
        )


def check_tree(
    tree: Path, target_name: str | None = None, apply: bool = False, manifest: Manifest | None = None
) -> PatchReport:
    """Check (and with ``apply`` patch) the SGLang tree at ``tree`` against a patch target."""
    manifest = manifest or load_manifest()
    target, notice = manifest.resolve(target_name)
    report = PatchReport(target=target.name, tree=str(tree))
    if notice:
        report.notices.append(notice)
    try:
        check_patch_file(target)
        patch_set = patched_files(target.patch_file.read_text())
        if sorted(patch_set) != sorted(target.files):
            raise PatchError(
                f"{target.patch_file} touches {sorted(patch_set)}, but targets.{target.name}.files lists "
                f"{sorted(target.files)}: regenerate the patch (tools/check_patch --regenerate) or fix the manifest"
            )
        root = package_root(tree)
        report.tree = str(root)
        report.version = tree_version(root)
        if report.version is not None and report.version != target.sglang_version:
            report.problems.append(
                f"{root} has sglang {report.version}, but target {target.name} is for sglang {target.sglang_version}"
            )
            report.fix = f"pip install --force-reinstall --no-deps sglang=={target.sglang_version}, then {APPLY_FIX}"
            return report
        report.state, detail = classify(root, target)
        if report.state in ("patched-other", "foreign"):
            report.problems.append(detail)
            report.fix = (
                f"restore a pristine sglang {target.sglang_version} "
                f"(pip install --force-reinstall --no-deps sglang=={target.sglang_version}), then {APPLY_FIX}"
            )
            return report
        report.steps.append(detail)
        if report.state == "pristine":
            _check_copy(root, target, report)
            if apply and report.ok:
                clean, output = run_patch(root, target.patch_file, dry_run=False)
                if not clean:
                    report.problems.append(f"patching {root} failed:\n{_indent(output)}")
                    report.fix = (
                        f"pip install --force-reinstall --no-deps sglang=={target.sglang_version}, then {APPLY_FIX}"
                    )
                    return report
                _verify_patched(root, target, report)
                if report.ok:
                    record = write_record(root, target, target.files, how="applied")
                    report.state = "patched"
                    report.steps.append(f"patched {root}; record {record}")
        else:  # already patched with this patch
            _verify_patched(root, target, report)
            record = read_record(root)
            if record is None and apply and report.ok:
                path = write_record(root, target, target.files, how="found already patched (reverse dry-run)")
                report.steps.append(f"tree was patched without a record; wrote {path}")
            elif apply:
                report.steps.append("nothing to do: already applied")
        if not report.ok and not report.fix:
            report.fix = f"pip install --force-reinstall --no-deps sglang=={target.sglang_version}, then {APPLY_FIX}"
    except PatchError as exc:
        report.problems.append(str(exc))
    return report
