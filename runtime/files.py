"""Atomic file writes and an exclusive lock file: the ground floor every other room (launcher, runtime,
tools, tests) builds on.

A file is written under a temporary name beside its target and renamed over it only when complete,
so a reader sees the old file or the new one, never half of one. When the write fails (a full disk,
a folder where the file should be, an interrupt) the temporary file is removed and the target is
left as it was. A write that finds the disk full (ENOSPC) or the quota spent (EDQUOT) raises
:class:`DiskFullError`, one line that says what was written where, how much it needed, what is free and
the fix. This module imports nothing of the repository and nothing outside the standard library, so the
login-node launcher and the light layer can use it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """A write that found no space (or no quota) left; its text is the whole one-line message."""

    def __init__(self, code: int, message: str, filename: str) -> None:
        super().__init__(code, message, filename)
        self.message = message

    def __str__(self) -> str:
        return self.message


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a write failing for want of space or quota."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def mount_point(path: Path) -> Path:
    """The mount point of the file system that holds ``path`` (or would, for a path not made yet)."""
    current = path.absolute()
    while not current.exists() and current != current.parent:
        current = current.parent
    while not os.path.ismount(current) and current != current.parent:
        current = current.parent
    return current


def disk_full_error(exc: OSError, target: Path, need_bytes: int | None, moved_by: str = "") -> DiskFullError:
    """The one-line error for ``exc`` (ENOSPC/EDQUOT) while writing ``target``: what, where, how much
    was needed when known, what is free, and the fix (``moved_by``: the setting that moves the folder)."""
    mount = mount_point(target.parent)
    try:
        free = f"{shutil.disk_usage(mount).free} bytes free"
    except OSError:
        free = "free space unknown"
    what = "disk full" if exc.errno == errno.ENOSPC else "disk quota exceeded"
    need = f"need {need_bytes} bytes, " if need_bytes is not None else ""
    elsewhere = f", or point {moved_by} at a larger file system" if moved_by else ""
    message = (
        f"{what} at {target.parent} while writing {target.name} ({need}{free} on {mount}); "
        f"fix: free space on {mount}{elsewhere}"
    )
    return DiskFullError(exc.errno or errno.ENOSPC, message, str(target))


def temporary_sibling(target: Path) -> Path:
    """The temporary name a write of ``target`` goes through: hidden, in the same folder (so the
    rename stays on one file system), unique to this process."""
    return target.with_name(f".{target.name}.tmp{os.getpid()}")


@contextlib.contextmanager
def atomic_path(target: Path, need_bytes: int | None = None, moved_by: str = "") -> Iterator[Path]:
    """Yield a temporary path to write ``target``'s content to (for writers that take a path, such as
    ``safetensors.save_file``); on success it is renamed over ``target``, on failure removed. A full
    disk raises :class:`DiskFullError` (``need_bytes`` and ``moved_by`` go into its message)."""
    tmp = temporary_sibling(target)
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if is_disk_full(exc) and not isinstance(exc, DiskFullError):
            raise disk_full_error(exc, target, need_bytes, moved_by) from None  # type: ignore[arg-type]
        raise


def _write_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_all(path: Path, data: bytes, flags: int) -> None:
    fd = os.open(path, flags, 0o666)
    try:
        _write_fd(fd, data)
    finally:
        os.close(fd)


def atomic_write_bytes(target: Path, data: bytes, moved_by: str = "") -> None:
    """Write ``data`` to ``target`` atomically (see the module docstring); ``moved_by`` names the setting
    that moves ``target``'s folder, for the fix of a full disk."""
    with atomic_path(target, len(data), moved_by) as tmp:
        _write_all(tmp, data, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)


def atomic_write_text(target: Path, text: str, moved_by: str = "") -> None:
    """Write ``text`` (UTF-8) to ``target`` atomically, as :func:`atomic_write_bytes`."""
    atomic_write_bytes(target, text.encode(), moved_by)


def append_text(target: Path, text: str, moved_by: str = "") -> None:
    """Append ``text`` (UTF-8, whole lines) to ``target``; a full disk cuts the file back to where it was
    (no half line) and raises :class:`DiskFullError`."""
    data = text.encode()
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    try:
        size = os.fstat(fd).st_size
        try:
            _write_fd(fd, data)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            if is_disk_full(exc):
                raise disk_full_error(exc, target, len(data), moved_by) from None
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive_lock(lock_path: Path, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (made if missing) for the block: one process at a
    time builds or fills what the lock guards, the others wait and then find it done. ``waiting`` is
    called once, before blocking, when another process holds the lock (a waiting build says so)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
