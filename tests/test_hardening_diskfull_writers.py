"""Issue 28, item 3: every writer of a run (job record, summary, producer state, metrics, gate records,
plots) handles a full disk as the checkpoint writer does (tests/test_hardening_diskfull.py): one line
with what, where, how much and the fix, no temporary file left, the old file intact, and the
``--local`` supervisor's summary still written. ENOSPC is injected at ``os.write`` (the one call every
writer of runtime/files.py goes through); where root can mount one, a real 1 MiB tmpfs fills up."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.jobs import JobRecord, read_local_status, write_local_status
from launcher.local import STATUS_RESERVE_FILENAME, LocalRun
from runtime import files
from runtime.files import DiskFullError, append_text, atomic_write_text


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch):
    """``os.write`` writes a few bytes, then the disk is full (ENOSPC), while ``full["on"]`` is true."""
    real_write = os.write
    state = {"on": True, "errno": errno.ENOSPC, "while_exists": None}

    def write(fd: int, data: bytes) -> int:
        blocked = state["on"] and (state["while_exists"] is None or state["while_exists"].exists())
        if not blocked:
            return real_write(fd, data)
        if len(data) > 4:
            return real_write(fd, bytes(data[:4]))  # a partial write first, as a filling disk does
        raise OSError(state["errno"], os.strerror(state["errno"]))

    monkeypatch.setattr(files.os, "write", write)
    return state


def test_an_atomic_write_on_a_full_disk_is_one_line_and_leaves_the_old_file(tmp_path: Path, full_disk) -> None:
    target = tmp_path / "producer_state.json"
    full_disk["on"] = False
    atomic_write_text(target, '{"cursor": 8}\n')
    full_disk["on"] = True
    with pytest.raises(DiskFullError) as err:
        atomic_write_text(target, '{"cursor": 16}\n', "job.runs_dir")
    message = str(err.value)
    assert message.startswith(f"disk full at {tmp_path} while writing producer_state.json (need 15 bytes, ")
    assert " bytes free on " in message and message.endswith(", or point job.runs_dir at a larger file system")
    assert "\n" not in message and err.value.errno == errno.ENOSPC
    assert target.read_text() == '{"cursor": 8}\n', "the old file is intact"
    assert _leftovers(tmp_path) == [], "no temporary file survives"


def test_a_spent_quota_says_so(tmp_path: Path, full_disk) -> None:
    full_disk["errno"] = errno.EDQUOT
    with pytest.raises(DiskFullError, match=r"^disk quota exceeded at .* while writing gate\.json \(need "):
        atomic_write_text(tmp_path / "gate.json", "{}" * 10)
    assert _leftovers(tmp_path) == []


def test_an_append_on_a_full_disk_leaves_no_half_line(tmp_path: Path, full_disk) -> None:
    metrics = tmp_path / "metrics.jsonl"
    full_disk["on"] = False
    append_text(metrics, '{"step": 1}\n')
    full_disk["on"] = True
    with pytest.raises(DiskFullError, match=r"^disk full at .* while writing metrics\.jsonl \(need 12 bytes"):
        append_text(metrics, '{"step": 2}\n', "job.runs_dir")
    assert metrics.read_text() == '{"step": 1}\n', "cut back to the last whole line"


def test_the_summary_is_written_from_the_reserve_when_the_disk_is_full(tmp_path: Path, full_disk, capsys) -> None:
    """The supervisor holds a little space; on a full disk it gives it up, so the summary says what
    really happened (before: it stayed RUNNING and a zero-byte temporary file was left)."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    full_disk["on"] = False
    write_local_status(job_dir, {"capture": {"state": "RUNNING"}})
    resolved = SimpleNamespace(recipe=SimpleNamespace(job=SimpleNamespace(stop_grace_s=5)), job_dir=job_dir)
    record = JobRecord("local-1", "local", "tiny", str(job_dir), "tiny", "d", False, False, {"capture": 1})
    run = LocalRun(resolved, record, probe=False, echo=False)  # type: ignore[arg-type]
    run._hold_status_reserve()
    reserve = job_dir / STATUS_RESERVE_FILENAME
    assert reserve.stat().st_size > 0
    full_disk.update(on=True, while_exists=reserve)  # full until the reserve is given up
    run.status = {"capture": {"state": "FAILED", "reason": "capture rank 0 exited with code 1: disk full at ..."}}
    run._save_status()
    assert not reserve.exists()
    assert read_local_status(job_dir)["capture"]["state"] == "FAILED"
    assert _leftovers(job_dir) == [] and capsys.readouterr().err == ""


def test_the_summary_says_why_it_could_not_be_written_when_nothing_is_left(tmp_path: Path, full_disk, capsys) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    resolved = SimpleNamespace(recipe=SimpleNamespace(job=SimpleNamespace(stop_grace_s=5)), job_dir=job_dir)
    record = JobRecord("local-1", "local", "tiny", str(job_dir), "tiny", "d", False, False, {"capture": 1})
    run = LocalRun(resolved, record, probe=False, echo=False)  # type: ignore[arg-type]
    run.status = {"capture": {"state": "FAILED"}}
    run._save_status()  # no reserve held: it cannot write, and says so without dying
    err = capsys.readouterr().err
    assert f"[local] cannot record the component states in {job_dir} (disk full at {job_dir} while writing" in err
    assert _leftovers(job_dir) == []


def test_a_plot_on_a_full_disk_leaves_no_temporary_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.figure import Figure

    from tools.compare_runs import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)))

    def savefig(self: Figure, path: Path, **kwargs: object) -> None:
        Path(path).write_bytes(b"")  # the file is made, then the disk is full (as matplotlib's writer meets it)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, "savefig", savefig)
    assert main([str(run)]) == 1
    plots = run / "plots"
    assert not list(plots.iterdir()), sorted(p.name for p in plots.iterdir())


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_real_full_tmpfs(tmp_path: Path) -> None:
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        with pytest.raises(DiskFullError, match=rf"^disk full at {mount} while writing big\.json \(need 2097152 bytes"):
            atomic_write_text(mount / "big.json", "x" * 2 * 1024 * 1024)
        assert list(mount.iterdir()) == []
        append_text(mount / "metrics.jsonl", "a" * 100 + "\n")
        with pytest.raises(DiskFullError):
            append_text(mount / "metrics.jsonl", "b" * 2 * 1024 * 1024 + "\n")
        assert (mount / "metrics.jsonl").read_text() == "a" * 100 + "\n"
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_the_producer_state_save_on_a_full_disk_is_the_one_line(tmp_path: Path, full_disk) -> None:
    """The writer that crashed the capture with a raw ``OSError: [Errno 28]`` traceback."""
    from runtime.transport.producer import Producer

    state = tmp_path / "transport" / "producer_state.json"
    producer = SimpleNamespace(state_path=state, store_id="store-1")
    with pytest.raises(DiskFullError) as err:
        Producer._save_state(producer, 16)  # type: ignore[arg-type]
    assert str(err.value).startswith(f"disk full at {state.parent} while writing producer_state.json (need ")
    assert str(err.value).endswith("or point job.runs_dir at a larger file system")
    assert list(state.parent.iterdir()) == []
