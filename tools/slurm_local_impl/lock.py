"""One ``up`` or ``down`` at a time: several test sessions on one machine may call them together."""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from pathlib import Path

from tools.slurm_local_impl.progress import say


def lock_path(state_dir: Path) -> Path:
    """The lock file sits next to the state folder (inside it, ``down`` could not delete the folder)."""
    return state_dir.parent / f".{state_dir.name}.lock"


@contextlib.contextmanager
def exclusive(state_dir: Path, remove_after: bool = False) -> Iterator[None]:
    """Hold an exclusive flock for the cluster of ``state_dir``, saying so while another holder runs.
    ``remove_after`` (``down``) deletes the lock file before releasing it, so nothing is left over."""
    path = lock_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another tools/slurm_local up/down to finish (lock {path})")
            started = time.monotonic()
            fcntl.flock(handle, fcntl.LOCK_EX)
            say(f"got the lock after {time.monotonic() - started:.1f} s")
        try:
            yield
        finally:
            if remove_after:
                path.unlink(missing_ok=True)
            fcntl.flock(handle, fcntl.LOCK_UN)
