"""The /etc/hosts line that makes the fake node names resolve to loopback for programs in jobs."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from tools.slurm_local_impl.settings import MARKER

HOSTS_FILE = Path("/etc/hosts")


def hosts_line(node_names: tuple[str, ...]) -> str:
    """The one line we own: every node name on 127.0.0.1, tagged with our marker."""
    return f"127.0.0.1 {' '.join(node_names)}  # {MARKER}"


def _without_our_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.rstrip().endswith(f"# {MARKER}")]


def _write(path: Path, text: str) -> None:
    """Write ``text`` through a temp file and a rename; /etc/hosts is a bind mount in Docker, where
    the rename fails with EBUSY, so then fall back to rewriting the file in place."""
    temp = path.with_name(f".{path.name}.slurm_local.tmp")
    try:
        temp.write_text(text)
        os.chmod(temp, path.stat().st_mode & 0o7777 if path.exists() else 0o644)
        os.replace(temp, path)
    except OSError as error:
        temp.unlink(missing_ok=True)
        if error.errno not in (errno.EBUSY, errno.EXDEV, errno.EPERM, errno.EACCES):
            raise
        with path.open("r+") as handle:
            handle.seek(0)
            handle.write(text)
            handle.truncate()


def add_node_names(node_names: tuple[str, ...], path: Path = HOSTS_FILE) -> None:
    """Make sure exactly one marked line maps ``node_names`` to 127.0.0.1 (idempotent)."""
    current = path.read_text() if path.exists() else ""
    wanted = [*_without_our_lines(current), hosts_line(node_names)]
    text = "\n".join(wanted) + "\n"
    if text != current:
        _write(path, text)


def remove_node_names(path: Path = HOSTS_FILE) -> bool:
    """Remove our marked lines; True if there were any."""
    if not path.exists():
        return False
    current = path.read_text()
    kept = _without_our_lines(current)
    if len(kept) == len(current.splitlines()):
        return False
    _write(path, "\n".join(kept) + "\n" if kept else "")
    return True


def has_node_names(path: Path = HOSTS_FILE) -> bool:
    """True if our marked line is present."""
    return path.exists() and any(line.rstrip().endswith(f"# {MARKER}") for line in path.read_text().splitlines())
