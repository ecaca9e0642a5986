"""runtime.files.exclusive_lock: one process at a time builds what a lock guards, and a waiter says so."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from runtime.files import exclusive_lock


def test_a_lock_held_by_another_says_so_before_waiting(tmp_path: Path) -> None:
    """What a second tiny build prints (tools/make_tiny_target): told once that it waits, then given the lock."""
    lock = tmp_path / ".build.lock"
    told = threading.Event()
    got = threading.Event()

    def second() -> None:
        with exclusive_lock(lock, told.set):
            got.set()

    with exclusive_lock(lock, lambda: pytest.fail("the first holder waits for nobody")):
        waiter = threading.Thread(target=second)
        waiter.start()
        assert told.wait(10), "the waiting build said nothing"
        assert not got.is_set(), "it took a lock that was held"
    waiter.join(10)
    assert got.is_set()
