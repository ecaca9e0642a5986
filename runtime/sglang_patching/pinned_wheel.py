"""The pinned PyPI wheel the patch is made against: downloaded once with ``pip download`` into
``.cache/sglang`` (its SHA-256 checked against the manifest), unpacked, and checked like a tree."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

from runtime.sglang_patching.tree import check_tree
from runtime.shared.data_files import sha256_file
from runtime.shared.sglang_patch_check import PatchReport
from runtime.shared.sglang_patch_manifest import (
    REPO_ROOT,
    Manifest,
    PatchError,
    Target,
    check_patch_file,
    load_manifest,
)

WHEEL_CACHE_DIR = REPO_ROOT / ".cache" / "sglang"
PIP_DOWNLOAD_TIMEOUT_S = 600.0


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
    actual = sha256_file(wheel)
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
