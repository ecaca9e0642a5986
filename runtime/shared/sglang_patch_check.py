"""Is the installed SGLang patched with our capture patch? The fast, torch-free check.

The launcher, the smoke gate and the SGLang capture engine call :func:`check_installed` before they
rely on the installed package (of this interpreter, or of another one such as the capture venv):
the right SGLang version, the record ``tools/check_patch --apply`` left
(``sglang/.dspark_capture_patch.json``: the target, the patch SHA-256 and the SHA-256 of every
patched file), every patched file unchanged since, every hook present. It needs neither GNU patch
nor network. Applying, checking a source tree or the pinned wheel, and regenerating the patch are
``runtime/sglang_patching`` (the command line is ``tools/check_patch``).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.shared.data_files import sha256_file
from runtime.shared.sglang_patch_manifest import Hook, Manifest, PatchError, load_manifest

RECORD_NAME = ".dspark_capture_patch.json"
RECORD_FORMAT = "dspark-capture-patch-record/1"
APPLY_FIX = "tools/check_patch --apply"


@dataclass
class PatchReport:
    """The outcome of a check (or an apply): ``ok`` when nothing is wrong."""

    target: str
    tree: str
    state: str = "unknown"
    """pristine | patched | patched-other | foreign | missing"""
    version: str | None = None
    notices: list[str] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    fix: str = ""

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems

    def render(self) -> str:
        """Human-readable summary, problems and the fix."""
        lines = [f"patch target {self.target} on {self.tree} (sglang {self.version or '?'}): state {self.state}"]
        lines += [f"  notice: {n}" for n in self.notices]
        lines += [f"  ok: {s}" for s in self.steps]
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        if self.problems and self.fix:
            lines.append(f"  fix: {self.fix}")
        lines.append("  result: " + ("OK" if self.ok else "FAILED"))
        return "\n".join(lines)


def tree_version(root: Path) -> str | None:
    """The SGLang version of the tree under ``root``: installed metadata, else ``sglang/_version.py``."""
    for info in sorted(root.glob("sglang-*.dist-info")):
        metadata = info / "METADATA"
        if metadata.is_file():
            match = re.search(r"^Version:\s*(\S+)", metadata.read_text(errors="replace"), re.M)
            if match:
                return match.group(1)
    # setuptools-scm writes _version.py into wheels; a git checkout has none (None: unknown).
    source = root / "sglang" / "_version.py"
    if source.is_file():
        match = re.search(
            r"""^__version__\s*=\s*(?:version\s*=\s*)?["']([^"']+)["']""", source.read_text(errors="replace"), re.M
        )
        if match:
            return match.group(1)
    return None


def read_record(root: Path) -> dict[str, Any] | None:
    """The record ``--apply`` left in ``root/sglang``, or None."""
    path = root / "sglang" / RECORD_NAME
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PatchError(f"{path} is not valid JSON ({exc}); delete it and run {APPLY_FIX} again") from exc
    return record if isinstance(record, dict) else None


def _defined_names(source: str) -> set[str]:
    """Module-level names and ``Class.member`` names (methods, annotated or assigned attributes)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{item.name}")
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(f"{node.name}.{item.target.id}")
                elif isinstance(item, ast.Assign):
                    names.update(f"{node.name}.{t.id}" for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def check_hooks(root: Path, hooks: Iterable[Hook]) -> list[str]:
    """Every hook symbol is defined (or literal present) in its file; returns the problems."""
    problems = []
    cache: dict[str, tuple[str, set[str]]] = {}
    for hook in hooks:
        path = root / hook.file
        if hook.file not in cache:
            if not path.is_file():
                problems.append(f"{hook.file} is missing")
                cache[hook.file] = ("", set())
                continue
            source = path.read_text()
            try:
                names = _defined_names(source)
            except SyntaxError:
                names = set()
            cache[hook.file] = (source, names)
        source, names = cache[hook.file]
        if not source:
            continue
        if hook.symbol and hook.symbol not in names:
            problems.append(f"hook {hook.describe()} is not defined")
        if hook.contains and hook.contains not in source:
            problems.append(f"hook {hook.describe()} is not present")
    return problems


# ----------------------------------------------------------------------------------------------
# the installed package
# ----------------------------------------------------------------------------------------------


def installed_sglang_root() -> Path | None:
    """The folder holding the importable ``sglang`` package, found without importing it."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).resolve().parent


SGLANG_ROOT_PROBE = (
    "import importlib.util as u; s = u.find_spec('sglang'); "
    "print(list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else '')"
)
PROBE_TIMEOUT_S = 120.0


def sglang_root_of(python: str | Path) -> Path | None:
    """The folder holding the ``sglang`` package that interpreter ``python`` imports (another
    environment, e.g. the capture venv), found without importing it; None when it has none."""
    try:
        done = subprocess.run(
            [str(python), "-c", SGLANG_ROOT_PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PatchError(f"cannot run the SGLang interpreter {python}: {exc}") from None
    if done.returncode != 0:
        raise PatchError(f"the SGLang interpreter {python} failed: {done.stderr.strip()[-800:]}")
    location = done.stdout.strip()
    return Path(location).resolve().parent if location else None


def check_installed(
    target_name: str | None = None, manifest: Manifest | None = None, python: str | Path | None = None
) -> PatchReport:
    """Fast, torch-free check of the installed SGLang: the right version, the record of this
    patch, every patched file unchanged since it was applied, every hook present. Needs neither
    GNU patch nor network; the fix it names is ``tools/check_patch --apply``. ``python`` checks the
    SGLang of that interpreter instead of this one's."""
    manifest = manifest or load_manifest()
    target, notice = manifest.resolve(target_name)
    fix = APPLY_FIX if python is None else f"{python} {APPLY_FIX}"
    report = PatchReport(target=target.name, tree="installed sglang", fix=fix)
    if notice:
        report.notices.append(notice)
    root = installed_sglang_root() if python is None else sglang_root_of(python)
    if root is None:
        report.state = "missing"
        report.problems.append(f"sglang is not installed in this environment ({python or sys.executable})")
        report.fix = f"pip install sglang=={target.sglang_version}, then {fix}"
        return report
    report.tree = str(root)
    if python is None:
        try:
            report.version = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            report.version = tree_version(root)
    else:
        report.version = tree_version(root)
    if report.version != target.sglang_version:
        report.problems.append(
            f"installed sglang is {report.version}, target {target.name} needs {target.sglang_version}"
        )
        report.fix = f"pip install --force-reinstall --no-deps sglang=={target.sglang_version}, then {fix}"
        return report
    record = read_record(root)
    if record is None:
        report.state = "pristine"
        report.problems.append(f"installed sglang at {root} is not patched (no {RECORD_NAME})")
        report.fix = fix
        return report
    if record.get("target") != target.name or record.get("patch_sha256") != target.patch_sha256:
        report.state = "patched-other"
        report.problems.append(
            f"installed sglang carries patch {record.get('target')!r} (SHA-256 {str(record.get('patch_sha256'))[:12]}...), "
            f"not {target.name!r} (SHA-256 {target.patch_sha256[:12]}...)"
        )
        report.fix = f"pip install --force-reinstall --no-deps sglang=={target.sglang_version}, then {fix}"
        return report
    report.state = "patched"
    for name, expected in sorted((record.get("files") or {}).items()):
        path = root / name
        if not path.is_file() or sha256_file(path) != expected:
            report.problems.append(f"{path} changed after the patch was applied")
    report.problems += check_hooks(root, target.hooks)
    if report.ok:
        report.steps.append(f"record and {len(record.get('files') or {})} patched files match; hooks present")
    else:
        report.fix = f"pip install --force-reinstall --no-deps sglang=={target.sglang_version}, then {fix}"
    return report
