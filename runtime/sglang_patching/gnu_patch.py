"""GNU ``patch -p1`` on an SGLang tree, and the files a unified diff touches."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from runtime.shared.sglang_patch_manifest import PatchError

PATCH_TIMEOUT_S = 120.0


def patched_files(patch_text: str) -> list[str]:
    """Paths (relative to the folder holding ``sglang/``) that a ``-p1`` unified diff touches."""
    files = []
    for line in patch_text.splitlines():
        if line.startswith("+++ "):
            name = line[4:].split("\t")[0].strip()
            files.append(name.split("/", 1)[1] if "/" in name else name)
    return files


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
