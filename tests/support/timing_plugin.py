"""A pytest plugin that records, per test, its wall time and the CPU time it and its children used.

Enabled with ``-p tests.support.timing_plugin`` and ``DSPARK_TEST_PROFILE=FILE``: one JSON line per test
phase (setup, call, teardown) is appended to FILE. CPU time over wall time tells a test that computes
from one that waits (on processes, timeouts or a server), which is what decides how much running tests
in parallel can gain on a machine with few cores. Children count once they are reaped, so a process
a test leaves running is not counted; pytest-xdist workers each append to the same file.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _record(item: pytest.Item, phase: str, wall_s: float, cpu_s: float) -> None:
    target = os.environ.get("DSPARK_TEST_PROFILE")
    if not target:
        return
    row = {
        "test": item.nodeid,
        "phase": phase,
        "wall_s": round(wall_s, 3),
        "cpu_s": round(cpu_s, 3),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "markers": sorted({mark.name for mark in item.iter_markers()}),
    }
    # One short append per line: lines from several workers do not interleave.
    with Path(target).open("a") as handle:
        handle.write(json.dumps(row) + "\n")


@contextlib.contextmanager
def _timed(item: pytest.Item, phase: str) -> Iterator[None]:
    wall, cpu = time.monotonic(), _cpu_seconds()
    try:
        yield
    finally:
        _record(item, phase, time.monotonic() - wall, _cpu_seconds() - cpu)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    """Times the setup phase (fixtures: target builds, clusters, masters)."""
    with _timed(item, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Times the test body."""
    with _timed(item, "call"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """Times the teardown phase."""
    with _timed(item, "teardown"):
        return (yield)
