"""Atomic file writes and an exclusive lock file: the ground floor every other room (launcher, runtime,
tools, tests) builds on.

A file is written under a temporary name beside its target and renamed over it only when complete,
so a reader sees the old file or the new one, never half of one. When the write fails (a full disk,
a folder where the file should be, an interrupt) the temporary file is removed and the target is
left as it was. This module imports nothing of the repository and nothing outside the standard
library, so the login-node launcher and the light layer can use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def temporary_sibling(target: Path) -> Path:
    """The temporary name a write of ``target`` goes through: hidden, in the same folder (so the
    rename stays on one file system), unique to this process."""
    return target.with_name(f".{target.name}.tmp{os.getpid()}")


@contextlib.contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temporary path to write ``target``'s content to (for writers that take a path, such as
    ``safetensors.save_file``); on success it is renamed over ``target``, on failure removed."""
    tmp = temporary_sibling(target)
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def atomic_write_bytes(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` atomically (see the module docstring)."""
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(target: Path, text: str) -> None:
    """Write ``text`` to ``target`` atomically (see the module docstring)."""
    with atomic_path(target) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (made if missing) for the block: one process at a
    time builds or fills what the lock guards, the others wait and then find it done."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
