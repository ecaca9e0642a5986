"""The SGLang capture patch manifest: ``patches/sglang/MANIFEST.yaml`` read and checked (torch-free).

The patch lives in ``patches/sglang/<target>/`` and is described by the manifest: targets with the
pinned SGLang version, the pinned PyPI wheel, the patch file and its SHA-256, the files it touches
and the hook symbols it adds; aliases that map older target names to the current one with a notice.
:mod:`runtime.shared.sglang_patch_check` checks an installed SGLang against a target;
``runtime/sglang_patching`` (used by ``tools/check_patch``) applies and regenerates the patch.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from runtime.shared.data_files import sha256_file

REPO_ROOT = Path(__file__).resolve().parents[2]
PATCHES_DIR = REPO_ROOT / "patches" / "sglang"
MANIFEST_PATH = PATCHES_DIR / "MANIFEST.yaml"
MANIFEST_FORMAT = "dspark-sglang-patches/1"


class PatchError(RuntimeError):
    """A manifest, patch or tree that cannot be used; the message names the file and the fix."""


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


def check_patch_file(target: Target) -> None:
    """The patch file exists and is the one the manifest pins."""
    if not target.patch_file.is_file():
        raise PatchError(f"patch file {target.patch_file} (targets.{target.name}.patch_file) does not exist")
    actual = sha256_file(target.patch_file)
    if actual != target.patch_sha256:
        raise PatchError(
            f"{target.patch_file} has SHA-256 {actual}, but {MANIFEST_PATH.name} pins {target.patch_sha256} "
            f"(targets.{target.name}.patch_sha256). If the patch was changed on purpose, regenerate it with "
            "tools/check_patch --regenerate EDITED_TREE (which updates the manifest); otherwise restore it from git."
        )
