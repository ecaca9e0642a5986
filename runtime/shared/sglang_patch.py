"""The SGLang capture patch: manifest, checker, applier, regenerator (torch-free library core).

The command line is ``tools/check_patch`` (``tools/patch_check.py``); the launcher, the smoke gate and
the SGLang capture engine import this module.

The patch lives in ``patches/sglang/<target>/`` and is described by ``patches/sglang/MANIFEST.yaml``
(targets with the pinned SGLang version, the patch file and its SHA-256, the hook symbols the patch
adds; aliases that map older target names to the current one with a notice).

What a check does, on the pinned wheel (downloaded once into ``.cache/sglang``), a source tree
(``--tree``: an installed ``site-packages`` folder, the ``sglang`` package folder itself, or an
SGLang git checkout whose package sits under ``python/``) or the installed package:

1. finds the folder that holds ``sglang/`` (both layouts) and the SGLang version there;
2. classifies the tree: pristine (the patch applies: forward dry-run), patched by this patch (the
   reverse dry-run applies, and the record agrees), patched by another patch version (the record
   names it), or changed in a way the patch does not fit;
3. applies the patch into a temporary copy of the touched files, byte-compiles every patched file
   and checks that each hook symbol is defined.

``--apply`` then patches the tree itself, idempotently, and writes a record
(``sglang/.dspark_capture_patch.json``) with the target, the patch SHA-256 and the SHA-256 of every
patched file. :func:`check_installed` is the fast, torch-free check the launcher, the smoke gate and
the SGLang capture engine call before they rely on the installed package.

GNU ``patch`` does the patching (``apt-get install patch`` where it is missing).
"""

from __future__ import annotations

import ast
import datetime as dt
import difflib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runtime.files import atomic_write_text

REPO_ROOT = Path(__file__).resolve().parents[2]
PATCHES_DIR = REPO_ROOT / "patches" / "sglang"
MANIFEST_PATH = PATCHES_DIR / "MANIFEST.yaml"
WHEEL_CACHE_DIR = REPO_ROOT / ".cache" / "sglang"
MANIFEST_FORMAT = "dspark-sglang-patches/1"
RECORD_NAME = ".dspark_capture_patch.json"
RECORD_FORMAT = "dspark-capture-patch-record/1"
APPLY_FIX = "tools/check_patch --apply"
PATCH_TIMEOUT_S = 120.0
PIP_DOWNLOAD_TIMEOUT_S = 600.0


class PatchError(RuntimeError):
    """A manifest, patch or tree that cannot be used; the message names the file and the fix."""


# ----------------------------------------------------------------------------------------------
# manifest
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hook:
    """Something the patch must leave in a file: a defined symbol (``Class.attr`` or a module-level
    name) or, for code that defines nothing new, a literal text."""

    file: str
    symbol: str | None = None
    contains: str | None = None

    def describe(self) -> str:
        """``file::symbol`` or ``file contains '...'``."""
        return f"{self.file}::{self.symbol}" if self.symbol else f"{self.file} contains {self.contains!r}"


@dataclass(frozen=True)
class Wheel:
    """The pinned PyPI wheel whose ``sglang/`` tree the patch is made against."""

    filename: str
    sha256: str
    python_version: str
    platform: str


@dataclass(frozen=True)
class Target:
    """One patch target: an SGLang version and the patch that fits it."""

    name: str
    patch_id: str
    """The ``DSPARK_CAPTURE_PATCH`` value the patch writes into SGLang (reported in every capture)."""
    sglang_version: str
    sglang_commit: str | None
    wheel: Wheel
    patch_file: Path
    patch_sha256: str
    flags_added: tuple[str, ...]
    request_fields_added: tuple[str, ...]
    files: tuple[str, ...]
    hooks: tuple[Hook, ...]
    date_validated: str
    validated_how: str


@dataclass(frozen=True)
class Manifest:
    """``patches/sglang/MANIFEST.yaml``."""

    path: Path
    current: str
    targets: dict[str, Target]
    aliases: dict[str, tuple[str, str]]
    """alias name -> (target name, notice)."""

    def resolve(self, name: str | None) -> tuple[Target, str | None]:
        """The target named ``name`` (or the current one) and, for an alias, its notice."""
        name = name or self.current
        if name in self.targets:
            return self.targets[name], None
        if name in self.aliases:
            target_name, notice = self.aliases[name]
            return self.targets[target_name], f"patch target '{name}' is an alias of '{target_name}': {notice}"
        known = sorted(self.targets) + sorted(self.aliases)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise PatchError(
            f"{self.path}: no patch target or alias named '{name}'.{hint} Known: {', '.join(known)}. "
            "Fix capture.sglang.patch_target in the recipe (or --target)."
        )


def load_manifest(path: Path = MANIFEST_PATH) -> Manifest:
    """Read and check the manifest; every problem names the file and the field."""
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise PatchError(f"patch manifest {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise PatchError(f"{path}: YAML syntax error: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
        raise PatchError(f"{path}: field 'format' must be {MANIFEST_FORMAT!r}")
    targets: dict[str, Target] = {}
    for name, body in (raw.get("targets") or {}).items():
        targets[name] = _parse_target(path, name, body)
    if not targets:
        raise PatchError(f"{path}: field 'targets' is empty; add at least one target")
    current = raw.get("current")
    if current not in targets:
        raise PatchError(f"{path}: field 'current' is {current!r}, which is not one of the targets {sorted(targets)}")
    aliases: dict[str, tuple[str, str]] = {}
    for alias, body in (raw.get("aliases") or {}).items():
        where = f"{path}: aliases.{alias}"
        if not isinstance(body, dict) or body.get("target") not in targets:
            raise PatchError(f"{where}.target must name one of the targets {sorted(targets)}")
        if alias in targets:
            raise PatchError(f"{where}: an alias cannot share a target's name")
        aliases[str(alias)] = (body["target"], str(body.get("notice", "")).strip())
    return Manifest(path=path, current=current, targets=targets, aliases=aliases)


def _parse_target(path: Path, name: str, body: Any) -> Target:
    where = f"{path}: targets.{name}"
    if not isinstance(body, dict):
        raise PatchError(f"{where} must be a mapping")

    def need(key: str) -> Any:
        if key not in body or body[key] in (None, ""):
            raise PatchError(f"{where}.{key} is missing")
        return body[key]

    wheel = need("wheel")
    if not isinstance(wheel, dict):
        raise PatchError(f"{where}.wheel must be a mapping (filename, sha256, python_version, platform)")
    hooks = []
    for index, hook in enumerate(need("hooks")):
        if not isinstance(hook, dict) or "file" not in hook or not ({"symbol", "contains"} & set(hook)):
            raise PatchError(f"{where}.hooks[{index}] needs 'file' and 'symbol' or 'contains'")
        hooks.append(Hook(file=hook["file"], symbol=hook.get("symbol"), contains=hook.get("contains")))
    sha = str(need("patch_sha256"))
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise PatchError(f"{where}.patch_sha256 must be 64 lowercase hex digits")
    return Target(
        name=name,
        patch_id=str(need("patch_id")),
        sglang_version=str(need("sglang_version")),
        sglang_commit=body.get("sglang_commit"),
        wheel=Wheel(
            filename=str(wheel.get("filename", "")),
            sha256=str(wheel.get("sha256", "")),
            python_version=str(wheel.get("python_version", "3.11")),
            platform=str(wheel.get("platform", "manylinux_2_34_x86_64")),
        ),
        patch_file=path.parent / str(need("patch_file")),
        patch_sha256=sha,
        flags_added=tuple(body.get("flags_added") or ()),
        request_fields_added=tuple(body.get("request_fields_added") or ()),
        files=tuple(need("files")),
        hooks=tuple(hooks),
        date_validated=str(body.get("date_validated", "")),
        validated_how=str(body.get("validated_how", "")).strip(),
    )


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_patch_file(target: Target) -> None:
    """The patch file exists and is the one the manifest pins."""
    if not target.patch_file.is_file():
        raise PatchError(f"patch file {target.patch_file} (targets.{target.name}.patch_file) does not exist")
    actual = file_sha256(target.patch_file)
    if actual != target.patch_sha256:
        raise PatchError(
            f"{target.patch_file} has SHA-256 {actual}, but {MANIFEST_PATH.name} pins {target.patch_sha256} "
            f"(targets.{target.name}.patch_sha256). If the patch was changed on purpose, regenerate it with "
            "tools/check_patch --regenerate EDITED_TREE (which updates the manifest); otherwise restore it from git."
        )


def patched_files(patch_text: str) -> list[str]:
    """Paths (relative to the folder holding ``sglang/``) that a ``-p1`` unified diff touches."""
    files = []
    for line in patch_text.splitlines():
        if line.startswith("+++ "):
            name = line[4:].split("\t")[0].strip()
            files.append(name.split("/", 1)[1] if "/" in name else name)
    return files


# ----------------------------------------------------------------------------------------------
# trees: layouts, versions, the record
# ----------------------------------------------------------------------------------------------


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
        "files": {name: file_sha256(root / name) for name in files},
    }
    atomic_write_text(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


# ----------------------------------------------------------------------------------------------
# GNU patch
# ----------------------------------------------------------------------------------------------


def _patch_binary() -> str:
    binary = shutil.which("patch")
    if binary is None:
        raise PatchError("GNU patch is not installed; install it (apt-get install patch) and run again")
    return binary


def run_patch(root: Path, patch_file: Path, *, reverse: bool = False, dry_run: bool = True) -> tuple[bool, str]:
    """Run ``patch -p1`` in ``root``; returns (applied cleanly, output). Never leaves rejects."""
    args = [
        _patch_binary(),
        "-p1",
        "--batch",
        "--no-backup-if-mismatch",
        "--reject-file=-",
        "-d",
        str(root),
        "-i",
        str(patch_file),
    ]
    args += ["--reverse", "--force"] if reverse else ["--forward"]
    if dry_run:
        args.append("--dry-run")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=PATCH_TIMEOUT_S, check=False)
    output = (proc.stdout + proc.stderr).strip()
    # Exact fit only: offsets are fine, fuzz would mean the code around a hook moved.
    clean = proc.returncode == 0 and "with fuzz" not in output
    return clean, output


# ----------------------------------------------------------------------------------------------
# checks of a patched file set
# ----------------------------------------------------------------------------------------------


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
# the pinned wheel
# ----------------------------------------------------------------------------------------------


def fetch_wheel(target: Target, cache_dir: Path = WHEEL_CACHE_DIR) -> Path:
    """The pinned wheel from the cache, downloaded with ``pip download`` when absent; its SHA-256
    is checked against the manifest."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheel = cache_dir / target.wheel.filename
    if not wheel.is_file():
        print(f"downloading sglang=={target.sglang_version} into {cache_dir} (pip download, about 40 MB)", flush=True)
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", target.wheel.python_version, "--platform", target.wheel.platform,
            "--implementation", "cp", f"sglang=={target.sglang_version}", "-d", str(cache_dir),
        ]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, timeout=PIP_DOWNLOAD_TIMEOUT_S, check=False)
        if proc.returncode != 0 or not wheel.is_file():
            raise PatchError(
                f"could not download {target.wheel.filename}: {(proc.stdout + proc.stderr).strip()[-800:]}\n"
                f"fix: put the wheel into {cache_dir} by hand, or check with --tree on an SGLang {target.sglang_version} tree"
            )
    actual = file_sha256(wheel)
    if target.wheel.sha256 and actual != target.wheel.sha256:
        raise PatchError(
            f"{wheel} has SHA-256 {actual}, but the manifest pins {target.wheel.sha256} "
            f"(targets.{target.name}.wheel.sha256): delete the file and run again"
        )
    return wheel


def extract_from_wheel(wheel: Path, names: Iterable[str], dest: Path) -> Path:
    """Extract the named files (and the package's ``__init__``/version files) into ``dest``."""
    wanted = set(names) | {"sglang/__init__.py", "sglang/_version.py", "sglang/srt/__init__.py"}
    with zipfile.ZipFile(wheel) as archive:
        members = set(archive.namelist())
        missing = sorted(n for n in names if n not in members)
        if missing:
            raise PatchError(f"{wheel.name} lacks files the patch touches: {', '.join(missing)}")
        for name in sorted(wanted & members):
            archive.extract(name, dest)
    return dest


# ----------------------------------------------------------------------------------------------
# reports
# ----------------------------------------------------------------------------------------------


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


def check_wheel(target_name: str | None = None, manifest: Manifest | None = None) -> PatchReport:
    """Check the patch against the pinned PyPI wheel (downloaded and cached on first use)."""
    manifest = manifest or load_manifest()
    target, _ = manifest.resolve(target_name)
    try:
        check_patch_file(target)
        wheel = fetch_wheel(target)
    except PatchError as exc:
        return PatchReport(target=target.name, tree=target.wheel.filename, problems=[str(exc)])
    with tempfile.TemporaryDirectory(prefix="dspark-wheel-") as tmp:
        extract_from_wheel(wheel, target.files, Path(tmp))
        report = check_tree(Path(tmp), target_name, manifest=manifest)
        report.tree = f"{wheel.name} (pinned wheel)"
        return report


# ----------------------------------------------------------------------------------------------
# the installed package (launcher, smoke gate, capture engine)
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
        if not path.is_file() or file_sha256(path) != expected:
            report.problems.append(f"{path} changed after the patch was applied")
    report.problems += check_hooks(root, target.hooks)
    if report.ok:
        report.steps.append(f"record and {len(record.get('files') or {})} patched files match; hooks present")
    else:
        report.fix = f"pip install --force-reinstall --no-deps sglang=={target.sglang_version}, then {fix}"
    return report


# ----------------------------------------------------------------------------------------------
# regenerating the patch after editing a copy of the tree
# ----------------------------------------------------------------------------------------------


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
    manifest_text = manifest_path.read_text().replace(target.patch_sha256, file_sha256(target.patch_file))
    atomic_write_text(manifest_path, manifest_text)
    return target.patch_file
