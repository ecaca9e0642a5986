"""Keep native libraries' log lines out of a component's console, and a healthy run's logs quiet.

The Mooncake client logs through glog, which its library never initialises: every line goes
straight to file descriptor 2, after glog's own "WARNING: Logging before InitGoogleLogging() is
written to STDERR". A component started by the launcher therefore points fd 2 at a per-task file
beside its log (``logs/native_{component}_{rank}.log``) and gives Python's ``sys.stderr``
(tracebacks, logging, warnings) a duplicate of the original fd 2, which stays the task's console.

:func:`initialise_glog` initialises the glog the Mooncake wheel ships (every store client calls it
before its library logs), so that preamble is never written; the lines themselves still go to fd 2.
A client's setup output is held until the setup returns (:func:`held_native_output`): a failed setup
writes all of it, a healthy one leaves out the lookup of its own segment that every start logs as an
ERROR and a WARNING before registering it. ``mooncake_master`` is a program of its own that cannot be
initialised from here: :func:`pump_native_output` copies its output into its log without the
preamble and the WARNING it logs at every segment mount.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.util
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

NATIVE_LOG_PATTERN = "native_{component}_{rank}.log"
"""File name (in the job's ``logs/``) of one task's native-library output."""


def native_log_path(job_dir: Path, component: str, rank: int | str) -> Path:
    """Where one component task's native-library output goes."""
    return job_dir / "logs" / NATIVE_LOG_PATTERN.format(component=component, rank=rank)


def route_native_output(environ: dict[str, str] | None = None) -> Path | None:
    """Point fd 2 at the task's native log when the launcher started this component (the contract
    variables DSPARK_JOB_DIR, DSPARK_COMPONENT, DSPARK_TASK_RANK are set); returns the file, or None.

    Call it before logging is configured: handlers bind to ``sys.stderr`` when they are made.
    """
    env = os.environ if environ is None else environ
    job_dir, component, rank = env.get("DSPARK_JOB_DIR"), env.get("DSPARK_COMPONENT"), env.get("DSPARK_TASK_RANK")
    if not (job_dir and component and rank is not None):
        return None
    path = native_log_path(Path(job_dir), component, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    console = os.dup(2)
    native = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(native, 2)
    os.close(native)
    sys.stderr = os.fdopen(console, "w", buffering=1, errors="backslashreplace")
    print(f"native library output (Mooncake glog, ...) goes to {path}", file=sys.stderr)
    return path


GLOG_PREAMBLE = b"WARNING: Logging before InitGoogleLogging() is written to STDERR"
"""The line glog writes (once per process) when a program logs without initialising it."""

_glog_lock = threading.Lock()
_glog_initialised = False


def _glog_library() -> ctypes.CDLL | None:
    """The glog shared library the installed Mooncake wheel ships (non-CUDA or CUDA build), or None."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    site = Path(next(iter(spec.submodule_search_locations))).parent
    found = sorted(glob.glob(str(site / "mooncake_transfer_engine*.libs" / "libglog*.so*")))
    if not found:
        return None
    try:
        return ctypes.CDLL(found[0])
    except OSError:
        return None


def initialise_glog() -> bool:
    """Initialise Mooncake's glog in this process (once): its lines keep going to fd 2 (the task's
    native log, or a command's stderr), without the "Logging before InitGoogleLogging()" WARNING.

    Returns whether glog was found (a Mooncake build without a separate libglog keeps its preamble).
    Mooncake sets glog's level itself from ``MC_LOG_LEVEL`` when a client starts."""
    global _glog_initialised
    with _glog_lock:
        if _glog_initialised:
            return True
        library = _glog_library()
        if library is None:
            return False
        try:
            ctypes.c_bool.in_dll(library, "_ZN3fLB17FLAGS_logtostderrE").value = True
            library._ZN6google17InitGoogleLoggingEPKc(b"dspark")
        except (AttributeError, ValueError):
            return False  # another glog build: its symbols differ; the preamble stays
        _glog_initialised = True
        return True


HEALTHY_SETUP_MARKS = (b"http=404 body: metadata not found", b"] Failed to retrieve segment descriptor, name ")
"""What :func:`healthy_setup_line` looks for (Mooncake 0.3.13's wording)."""


def healthy_setup_line(line: bytes) -> bool:
    """A line every healthy Mooncake client start prints: the lookup of its own segment's descriptor
    before it registers it (E "metadata not found", W "Failed to retrieve segment descriptor"), or glog's
    preamble."""
    return line.rstrip() == GLOG_PREAMBLE or any(mark in line for mark in HEALTHY_SETUP_MARKS)


@dataclass
class HeldOutput:
    """What :func:`held_native_output` yields: set ``healthy`` once the native call succeeded."""

    healthy: bool = False


_hold_lock = threading.Lock()


@contextlib.contextmanager
def held_native_output(drop: Callable[[bytes], bool] = healthy_setup_line) -> Iterator[HeldOutput]:
    """Hold what this process writes to fd 2 during a native call (a Mooncake client's setup) in a
    temporary file, then write it where fd 2 pointed: all of it when the call failed, without the lines
    ``drop`` names when the caller marked it healthy. One holder at a time (fd 2 is the process's)."""
    with _hold_lock, tempfile.TemporaryFile() as held:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        outcome = HeldOutput()
        try:
            yield outcome
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = b"".join(line for line in held if not (outcome.healthy and drop(line)))
            if kept:
                os.write(2, kept)


def healthy_master_line(line: bytes) -> bool:
    """A line every healthy ``mooncake_master`` prints: glog's preamble, or the WARNING each segment
    mount logs twice (``warn=segment_already_exists``, Mooncake 0.3.13) although the mount succeeds."""
    return line.rstrip() == GLOG_PREAMBLE or b", warn=segment_already_exists" in line


def pump_native_output(
    source: IO[bytes], sink: IO[bytes], drop: Callable[[bytes], bool] = healthy_master_line
) -> threading.Thread:
    """Copy a native program's output ``source`` (a pipe) into ``sink`` line by line, leaving out the
    lines ``drop`` names; a daemon thread that ends at the pipe's end of file."""

    def pump() -> None:
        with source:
            for line in iter(source.readline, b""):
                if not drop(line):
                    sink.write(line)
                    sink.flush()

    thread = threading.Thread(target=pump, name="native-log-pump", daemon=True)
    thread.start()
    return thread
