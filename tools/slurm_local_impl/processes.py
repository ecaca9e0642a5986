"""Starting, finding and stopping the cluster's daemons by pid (never by name)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from runtime.files import atomic_write_text
from tools.slurm_local_impl.packages import SBIN_DIRS
from tools.slurm_local_impl.settings import PROCESS_MARKER_ENV, StateLayout


def daemon_env(layout: StateLayout) -> dict[str, str]:
    """Environment for every daemon: our slurm.conf, sbin on PATH, the process marker, and no Slurm
    job variables inherited from a caller that itself runs inside a job."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "SLURMD_"))}
    env["SLURM_CONF"] = str(layout.slurm_conf)
    env[PROCESS_MARKER_ENV] = str(layout.root)
    path = env.get("PATH", "/usr/bin:/bin")
    missing = [folder for folder in SBIN_DIRS if folder not in path.split(":")]
    env["PATH"] = ":".join([path, *missing])
    return env


def read_pid(pid_file: Path) -> int | None:
    """The pid in ``pid_file``, or None if the file is absent or unreadable."""
    try:
        return int(pid_file.read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None


def is_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    # The state letter follows the parenthesised command name, which may itself contain spaces.
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def is_ours(pid: int, layout: StateLayout) -> bool:
    """True if ``pid`` carries this cluster's process marker in its environment."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    return f"{PROCESS_MARKER_ENV}={layout.root}".encode() in environ.split(b"\0")


def running_pid(pid_file: Path, layout: StateLayout) -> int | None:
    """The pid from ``pid_file`` if that process is alive and belongs to this cluster."""
    pid = read_pid(pid_file)
    if pid is not None and is_alive(pid) and is_ours(pid, layout):
        return pid
    return None


def start_foreground_daemon(argv: Sequence[str], name: str, layout: StateLayout) -> subprocess.Popen[bytes]:
    """Start daemon ``name`` in the foreground, in its own session so it outlives this command. Its
    stdout/stderr go to ``layout.console_log(name)`` (fatal start-up errors land there before the
    daemon opens its own log) and its pid to ``layout.pid_file(name)`` via a temp file and a rename."""
    console = layout.console_log(name)
    console.parent.mkdir(parents=True, exist_ok=True)
    with console.open("ab") as log:
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=daemon_env(layout),
            cwd=layout.root,
            start_new_session=True,
        )
    pid_file = layout.pid_file(name)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(pid_file, f"{process.pid}\n")
    return process


def stop_pid(pid: int, timeout_s: float = 10.0) -> bool:
    """SIGTERM ``pid``, then SIGKILL if it is still alive after ``timeout_s``. True if it was alive."""
    if not is_alive(pid):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(pid)
        if not is_alive(pid):
            return True
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    for _ in range(50):
        _reap(pid)
        if not is_alive(pid):
            break
        time.sleep(0.1)
    return True


def _reap(pid: int) -> None:
    """Collect ``pid`` if it is our own child (it is when ``up`` and ``down`` run in one process)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def marked_pids(layout: StateLayout) -> list[int]:
    """Every live process (other than this one) whose environment carries this cluster's marker:
    our daemons and the slurmstepd processes they forked."""
    own = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != own:
            pid = int(entry.name)
            if is_ours(pid, layout) and is_alive(pid):
                found.append(pid)
    return sorted(found)


def port_accepts(port: int, host: str = "127.0.0.1", timeout_s: float = 0.5) -> bool:
    """True if something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a log file, for error messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return f"({path} does not exist)"
