"""Issue 28, item 2: a dead process is named, first, with its exit and the resume command; the failures
of the survivors that follow it are reported after it as consequences. At the process boundary: real
short-lived children (``python -c``), a real supervisor loop, a real watch thread; no run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.control import SUPERVISOR_LOCK
from launcher.deaths import Death, claim_first_death, first_cause, last_words, order_deaths
from launcher.jobs import JobRecord
from launcher.local import LocalRun, LocalTask
from runtime.capture.master_watch import EXIT_MASTER_DIED, MasterWatch, trainer_step_text
from runtime.shared.contracts import JOB_RECORD_FILENAME


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


KILL_SELF_AFTER = "import os, signal, time; time.sleep({delay}); os.kill(os.getpid(), signal.SIGKILL)"
EXIT_AFTER = "import sys, time; time.sleep({delay}); print('ConnectionResetError: peer gone', flush=True); sys.exit(1)"
SLEEP = "import time; time.sleep(60)"


def test_a_kill_seen_in_the_same_round_is_the_cause_and_an_earlier_round_beats_it() -> None:
    reset = Death("trainer", 0, 1, seen_order=2)
    abort = Death("trainer", 2, -signal.SIGABRT, seen_order=2)
    killed = Death("trainer", 1, -signal.SIGKILL, seen_order=2)
    assert order_deaths([reset, abort, killed])[0] == killed
    earlier = Death("capture", 0, 3, seen_order=1)
    assert order_deaths([reset, killed, earlier])[0] == earlier
    assert killed.describe() == "trainer rank 1 killed by SIGKILL (-9)"


def test_ranks_that_refused_together_are_named_by_the_lowest_whose_line_the_console_shows() -> None:
    """Every trainer rank refuses a corrupt checkpoint with the same words; which exit the supervisor
    sees first is a race (CI once named rank 2, whose line the console does not echo)."""
    words = "checkpoint file x/__0_0.distcp is corrupt: sha256 ab, cd when written. Fix: resume from an older one"
    rank2 = Death("trainer", 2, 1, seen_order=1, last_words=f"[trainer rank 2] error: {words}")
    rank0 = Death("trainer", 0, 1, seen_order=2, last_words=f"[trainer rank 0] error: {words}")
    other = Death("trainer", 1, 1, seen_order=2, last_words="[trainer rank 1] error: something else")
    ordered = order_deaths([rank0, other, rank2])
    assert ordered[0] == rank2 and first_cause(ordered) == rank0
    assert first_cause(order_deaths([rank2, other])) == rank2  # no peer with the same words: the first stays
    killed = Death("trainer", 3, -signal.SIGKILL, seen_order=1)
    assert first_cause(order_deaths([rank0, killed, rank2])) == killed  # a kill is not a refusal


def test_the_first_claim_in_the_job_folder_wins(tmp_path: Path) -> None:
    first = Death("trainer", 1, -9)
    assert claim_first_death(tmp_path, first) == first
    assert claim_first_death(tmp_path, Death("trainer", 0, 1)) == first  # a later task learns the cause


def test_last_words_are_the_last_error_line(tmp_path: Path) -> None:
    log = tmp_path / "task.out"
    log.write_text("Traceback (most recent call last):\n  File x\nRuntimeError: gloo connection reset\nbye\n")
    assert last_words(log) == "RuntimeError: gloo connection reset"
    log.write_text("2026-12-03 14:20:27,154 ERROR [dspark.capture] master gone; resume with `x`\nshutting down\n")
    assert last_words(log) == "master gone; resume with `x`" and Death("capture", 0, 3, last_words="x").describe()
    assert last_words(tmp_path / "missing.out") == ""
    log.write_text("[trainer rank 0] error: disk full at /x while writing metrics.jsonl\n")
    assert last_words(log) == "[trainer rank 0] error: disk full at /x while writing metrics.jsonl"


def _local_run(tmp_path: Path, children: dict[tuple[str, int], str]) -> LocalRun:
    """A supervisor over real ``python -c`` children standing in for the component tasks."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    resolved = SimpleNamespace(recipe=SimpleNamespace(job=SimpleNamespace(stop_grace_s=5)), job_dir=job_dir)
    record = JobRecord(
        "local-1", "local", "tiny", str(job_dir), "tiny", "d", False, False, {"capture": 1, "trainer": 3}
    )
    run = LocalRun(resolved, record, probe=False, echo=False)  # type: ignore[arg-type]
    for (component, rank), code in children.items():
        log_path = job_dir / f"{component}_{rank}.out"
        log = log_path.open("ab")
        process = subprocess.Popen(
            [sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        run.tasks.append(LocalTask(component, rank, process, log, log_path))
    for component in ("capture", "trainer"):
        run.status[component] = {"state": "RUNNING", "tasks": 1, "exit_codes": {}}
    return run


def _supervise(run: LocalRun) -> tuple[int, float]:
    started = time.monotonic()
    try:
        return run._supervise(), time.monotonic() - started
    finally:
        for task in run.tasks:
            if task.process.poll() is None:
                task.process.kill()
                task.process.wait()
            task.log.close()


def test_the_supervisor_names_the_killed_rank_first(tmp_path: Path, capsys) -> None:
    run = _local_run(
        tmp_path,
        {
            ("capture", 0): SLEEP,
            ("trainer", 0): EXIT_AFTER.format(delay=1.5),  # would react to its peer's death, later
            ("trainer", 1): KILL_SELF_AFTER.format(delay=0.3),  # the cause
            ("trainer", 2): SLEEP,
        },
    )
    code, took_s = _supervise(run)
    err = capsys.readouterr().err
    assert code == -signal.SIGKILL
    first = [line for line in err.splitlines() if line.startswith("[local] FAILED: ")]
    assert first == [
        f"[local] FAILED: trainer rank 1 killed by SIGKILL (-9); resume with "
        f"`python3 -m launcher --resume {run.record.job_dir} --local`"
    ], err
    assert took_s < 4, f"{took_s:.1f} s from the start to the supervisor's end"
    run._repeat_the_cause()  # the run's last line, after the echoed logs of its peers
    assert capsys.readouterr().err == (
        "[local] the cause, above: trainer rank 1 killed by SIGKILL (-9) (what its peers logged after it are "
        f"consequences); resume with `python3 -m launcher --resume {run.record.job_dir} --local`\n"
    )
    assert run.status["trainer"]["state"] == "FAILED" and run.status["capture"]["state"] == "STOPPED"


def test_a_peer_that_died_on_its_own_is_reported_after_the_cause(tmp_path: Path, capsys) -> None:
    run = _local_run(
        tmp_path,
        {
            ("capture", 0): SLEEP,
            ("trainer", 0): SLEEP,
            ("trainer", 1): EXIT_AFTER.format(delay=0.0),
            ("trainer", 2): KILL_SELF_AFTER.format(delay=0.0),
        },
    )
    for task in run.tasks[2:]:
        task.process.wait(10)  # both dead before the first round: the same round, the kill is the cause
    _supervise(run)
    err = capsys.readouterr().err
    assert "[local] FAILED: trainer rank 2 killed by SIGKILL (-9); resume with" in err, err
    assert (
        "[local] after trainer rank 2 (consequences, not the cause): "
        "trainer rank 1 exited with code 1: ConnectionResetError: peer gone"
    ) in err, err


def test_a_capture_that_failed_on_its_own_while_the_trainer_stopped_says_so(tmp_path: Path, capsys) -> None:
    """A full disk fails both components within a second: the trainer is seen first and named the cause;
    the capture, dead on its own before the supervisor stopped it, keeps its own reason in the summary."""
    disk_full = "[trainer rank 0] error: disk full at /x while writing metrics.jsonl"
    slow_to_stop = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1), sys.exit(1))); time.sleep(60)"
    capture_fails = (
        "import sys, time; time.sleep(0.8); print('t ERROR [dspark.capture] the capture stops: disk full'); sys.exit(1)"
    )
    run = _local_run(
        tmp_path,
        {
            ("capture", 0): capture_fails,
            ("trainer", 0): f"import sys, time; time.sleep(0.3); print({disk_full!r}); sys.exit(1)",
            ("trainer", 1): slow_to_stop,  # the supervisor's stop of the trainer takes a second
        },
    )
    _supervise(run)
    err = capsys.readouterr().err
    # Its own one-line refusal was echoed already: the FAILED line points at it rather than repeat it.
    assert (
        "[local] FAILED: trainer rank 0 exited with code 1; its error line above says why and the fix; resume with"
        in err
    ), err
    assert run.status["trainer"]["reason"] == f"trainer rank 0 exited with code 1: {disk_full}"
    assert run.status["capture"]["state"] == "FAILED"
    assert run.status["capture"]["reason"] == (
        "capture rank 0 exited with code 1: t ERROR [dspark.capture] the capture stops: disk full, "
        "after trainer rank 0 died first"
    )


def test_a_capture_failure_is_named_first_with_its_last_error_line(tmp_path: Path, capsys) -> None:
    said = "mooncake_master (pid 7) killed by SIGKILL (-9) at step 3; resume with `python3 -m launcher tiny`"
    logged = "2026-12-03 14:20:27,154 ERROR [dspark.capture] " + said
    capture = f"import sys, time; time.sleep(0.3); print({logged!r}, flush=True); sys.exit({EXIT_MASTER_DIED})"
    run = _local_run(tmp_path, {("capture", 0): capture, ("trainer", 0): SLEEP})
    code, took_s = _supervise(run)
    err = capsys.readouterr().err
    assert code == EXIT_MASTER_DIED and took_s < 4
    assert f"[local] FAILED: capture rank 0 exited with code {EXIT_MASTER_DIED}: {said}\n" in err, err
    assert run.status["trainer"]["state"] == "CANCELLED"


def test_the_master_watch_names_the_dead_master_within_a_second(tmp_path: Path) -> None:
    (tmp_path / JOB_RECORD_FILENAME).write_text(json.dumps({"recipe_source": "tiny", "mode": "local"}))
    master = _child(SLEEP)
    exits: list[tuple[int, float]] = []
    watch = MasterWatch(
        {"mooncake_master": master}, tmp_path, poll_s=0.1, exit=lambda c: exits.append((c, time.monotonic()))
    )
    watch.where = lambda: trainer_step_text(24, 8)
    watch.start()
    try:
        killed_at = time.monotonic()
        master.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        watch.stop()
        master.kill()
    assert exits and exits[0][0] == EXIT_MASTER_DIED and exits[0][1] - killed_at < 1.0
    assert watch.line == (
        f"mooncake_master (pid {master.pid}) killed by SIGKILL (-9) at step 3; the capture fails now; "
        f"resume with `python3 -m launcher --resume {tmp_path} --local`"
    )


def test_a_master_stopped_on_purpose_is_no_death(tmp_path: Path) -> None:
    master = _child(SLEEP)
    exits: list[int] = []
    watch = MasterWatch({"mooncake_master": master}, tmp_path, poll_s=0.05, exit=exits.append).start()
    watch.stop()
    master.terminate()
    master.wait(5)
    time.sleep(0.3)
    assert not exits and not watch.line
    assert trainer_step_text(None, 8) == "before the trainer's first step"


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.distributed
def test_kill_9_of_the_mooncake_master_is_one_line_within_seconds(tmp_path: Path, tiny_assets: Path) -> None:
    """A real ``launcher tiny --local``: once the trainer has stepped, ``kill -9`` its Mooncake master. The
    capture names it with the step and the resume command, and the supervisor names the capture as the
    cause, within seconds (before: about 350 s of time-outs and the survivors' tracebacks)."""
    import os
    import queue
    import re
    import threading

    from tests.support.launcher_cli import REPO, probe_overrides

    runs = tmp_path / "runs"
    command = [sys.executable, "-m", "launcher", "tiny", "--local", *probe_overrides(runs)]
    supervisor = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[tuple[float, str]] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put((time.monotonic(), line.rstrip())) for line in supervisor.stdout],  # type: ignore[union-attr]
        daemon=True,
    ).start()
    console: list[tuple[float, str]] = []
    try:
        master_pid, deadline = None, time.monotonic() + 600
        while master_pid is None or not (runs / "tiny").exists() or len(_metric_rows(runs)) < 2:
            assert time.monotonic() < deadline and supervisor.poll() is None, [line for _, line in console][-40:]
            try:
                console.append(lines.get(timeout=0.5))
            except queue.Empty:
                continue
            found = re.search(r"mooncake_master ready \(pid (\d+)\)", console[-1][1])
            master_pid = int(found.group(1)) if found else master_pid
        killed_at = time.monotonic()
        os.kill(master_pid, signal.SIGKILL)
        supervisor.wait(timeout=240)
        while True:
            try:
                console.append(lines.get(timeout=2))
            except queue.Empty:
                break
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
    text = "\n".join(line for _, line in console)
    watch = [
        (t, line) for t, line in console if f"mooncake_master (pid {master_pid}) killed by SIGKILL (-9) at step" in line
    ]
    assert watch, text[-4000:]
    assert re.search(
        r"at step \d+; the capture fails now; resume with `python3 -m launcher --resume \S+ --local`", watch[0][1]
    )
    failed = [(t, line) for t, line in console if line.startswith("[local] FAILED: capture rank 0 exited with code 3")]
    assert failed, text[-4000:]
    assert watch[0][0] - killed_at < 10 and failed[0][0] - killed_at < 10, (
        watch[0][0] - killed_at,
        failed[0][0] - killed_at,
    )
    assert supervisor.returncode == EXIT_MASTER_DIED
    (job_dir,) = [p for p in (runs / "tiny").iterdir() if p.is_dir()]
    status = json.loads((job_dir / "local_status.json").read_text())
    assert status["capture"]["state"] == "FAILED" and "mooncake_master" in status["capture"]["reason"], status
    assert status["trainer"]["state"] == "CANCELLED" and "after capture rank 0 died" in status["trainer"]["reason"]
    # (A stopped trainer may keep its last finished step: DCP names its own metadata file .metadata.)
    # (The supervisor's lock file names who supervises the folder, for cancel; it stays, empty.)
    kept = {".metadata", SUPERVISOR_LOCK}
    leftovers = [p for p in job_dir.rglob(".*") if p.is_file() and p.name not in kept]
    assert not leftovers, "no temporary or reserve file is left"
    print(
        f"kill -9 -> capture line {watch[0][0] - killed_at:.1f} s; -> supervisor line {failed[0][0] - killed_at:.1f} s"
    )
    print(watch[0][1])
    print(failed[0][1])


def _metric_rows(runs: Path) -> list[str]:
    found = list((runs / "tiny").glob("*/metrics.jsonl"))
    return found[0].read_text().splitlines() if found else []


def test_slurm_workers_agree_on_the_first_death_through_the_job_folder(tmp_path: Path) -> None:
    from launcher.worker import _death_line

    (tmp_path / JOB_RECORD_FILENAME).write_text(json.dumps({"recipe_source": "tiny", "mode": "slurm"}))
    resume = f"resume with `python3 -m launcher --resume {tmp_path}`"
    assert _death_line(tmp_path, Death("trainer", 1, -9)) == (
        f"FAILED (the first task to die): trainer rank 1 killed by SIGKILL (-9); {resume}"
    )
    assert _death_line(tmp_path, Death("trainer", 0, 1)) == (
        "trainer rank 0 exited with code 1: a consequence of trainer rank 1 killed by SIGKILL (-9), "
        f"which died first (the cause); {resume}"
    )


PEER_TRACEBACK = (  # a peer's reaction to the death: a deep traceback when its collective fails
    "import signal, sys, time\n"
    "def deep(n):\n"
    "    if n == 0: raise RuntimeError('[gloo] Connection closed by peer [127.0.0.1]:29500')\n"
    "    deep(n - 1)\n"
    "def boom(*_):\n"
    "    deep(30)\n"
    "signal.signal(signal.SIGTERM, boom)\n"
    "time.sleep(60)\n"
)
WRITER_THREADS_THEN_REFUSAL = (  # a checkpoint save on a full disk: DCP's writer threads fail, then the refusal
    "import sys, threading, time\n"
    "def write():\n"
    "    raise OSError(28, 'No space left on device')\n"
    "for _ in range(4):\n"
    "    t = threading.Thread(target=write); t.start(); t.join()\n"
    "time.sleep({delay})\n"
    "print('[trainer rank {rank}] error: disk full at /x/checkpoints while saving step_00000024: need about 11476055 '\n"
    "      'bytes, {free} free; the previous checkpoints are intact. Fix: free space there', file=sys.stderr)\n"
    "sys.exit(1)\n"
)


def _console(run: LocalRun, capsys) -> list[str]:
    """The supervisor's console in order (its echo goes to stdout, its own lines to stderr), as ``run()``
    ends: supervise, echo the logs' last lines, repeat the cause."""
    import contextlib

    with contextlib.redirect_stderr(sys.stdout):
        _supervise(run)
        run._echo_logs()
        run._repeat_the_cause()
    return capsys.readouterr().out.splitlines()


def _between(lines: list[str], first: str, last: str) -> list[str]:
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    end = next(i for i, line in enumerate(lines) if line.startswith(last))
    assert start < end, lines
    return lines[start + 1 : end]


def test_after_a_kill_the_peers_traceback_stays_in_its_log(tmp_path: Path, capsys) -> None:
    run = _local_run(
        tmp_path,
        {
            ("capture", 0): SLEEP,
            ("trainer", 0): PEER_TRACEBACK,
            ("trainer", 1): KILL_SELF_AFTER.format(delay=0.3),
            ("trainer", 2): SLEEP,
        },
    )
    run.echo = True
    lines = _console(run, capsys)
    assert lines[0].startswith("[local] FAILED: trainer rank 1 killed by SIGKILL (-9); resume with"), lines
    assert lines[-1].startswith("[local] the cause, above: trainer rank 1 killed by SIGKILL (-9) (what its peers")
    assert len(_between(lines, "[local] FAILED:", "[local] the cause, above:")) <= 3, lines
    assert not [line for line in lines if "Traceback" in line or line.lstrip().startswith("File ")], lines
    assert "Traceback (most recent call last)" in (tmp_path / "job" / "trainer_0.out").read_text(), "kept in the log"


def test_a_full_disk_is_named_first_and_last_without_the_writer_threads_tracebacks(tmp_path: Path, capsys) -> None:
    """Every rank's save fails on the full disk, each naming its own free bytes; rank 1 happens to end first.
    The console: the disk first (rank 0's line, or the first rank's in the FAILED line), a handful of lines,
    and the closing line names the disk again, not "trainer rank 1 exited with code 1"."""
    run = _local_run(
        tmp_path,
        {
            ("capture", 0): SLEEP,
            ("trainer", 0): WRITER_THREADS_THEN_REFUSAL.format(delay=0.8, rank=0, free=5959680),
            ("trainer", 1): WRITER_THREADS_THEN_REFUSAL.format(delay=0.2, rank=1, free=5955584),
            ("trainer", 2): WRITER_THREADS_THEN_REFUSAL.format(delay=0.9, rank=2, free=5951488),
        },
    )
    run.echo = True
    lines = _console(run, capsys)
    text = "\n".join(lines)
    assert "Traceback" not in text and "Exception in thread" not in text, text
    failed = next(i for i, line in enumerate(lines) if line.startswith("[local] FAILED: "))
    # rank 1 ends first, the others refuse the same within the supervisor's wait: the cause named is rank 0,
    # whose refusal the console shows above the FAILED line that points at it
    refusal = "[trainer rank 0] error: disk full at /x/checkpoints while saving step_00000024"
    assert any(line.startswith(refusal) for line in lines[:failed]), text
    assert lines[failed].startswith("[local] FAILED: trainer rank 0 exited with code 1; its error line above"), text
    closing = lines[-1]
    assert closing.startswith("[local] the cause, above: trainer rank ") and "disk full at /x/checkpoints" in closing
    assert "the previous checkpoints are intact" in closing and "resume with `python3 -m launcher --resume" in closing
    assert len(lines) <= 8, text


def test_ranks_that_refused_with_the_same_words_but_their_own_numbers_are_one_cause() -> None:
    words = "disk full at /x while saving step_00000024: need about 11476055 bytes, {} free. Fix: free space"
    rank1 = Death("trainer", 1, 1, seen_order=1, last_words="[trainer rank 1] error: " + words.format(5955584))
    rank0 = Death("trainer", 0, 1, seen_order=2, last_words="[trainer rank 0] error: " + words.format(5959680))
    assert first_cause(order_deaths([rank0, rank1])) == rank0
    assert rank1.pointed().startswith("trainer rank 1 exited with code 1: [trainer rank 1] error: disk full")
    assert rank0.pointed() == "trainer rank 0 exited with code 1; its error line above says why and the fix"
    assert rank0.cause() == (
        "trainer rank 0 exited with code 1: disk full at /x while saving step_00000024: need about 11476055 bytes, "
        "5959680 free"
    )


def test_a_refusal_right_after_library_tracebacks_is_shown(tmp_path: Path, capsys) -> None:
    """What torch's checkpoint writer threads leave in rank 0's log on a full disk, ending in hooks that
    failed too (the log's disk is full): the refusal that follows is a line of our own and is shown."""
    log = "\n".join(
        [
            "[trainer] step 23 | loss 4.1",
            "Exception in thread Thread-7 (_write_files_from_queue):",
            "Traceback (most recent call last):",
            '  File "/torch/distributed/checkpoint/filesystem.py", line 1, in _write_files_from_queue',
            "OSError: [Errno 28] No space left on device",
            "Exception in threading.excepthook:",
            "Exception ignored in thread started by: <bound method Thread._bootstrap of <Thread(Thread-7)>>",
            "Exception ignored in sys.unraisablehook: <built-in function unraisablehook>",
            "[trainer rank 0] error: disk full at /x/checkpoints while saving step_00000024: need about 1 bytes, "
            "0 free; the previous checkpoints are intact. Fix: free space there",
        ]
    )
    run = _local_run(tmp_path, {("trainer", 0): f"print({log!r}, flush=True); import time; time.sleep(60)"})
    run.echo = True
    deadline = time.monotonic() + 20
    while "error: disk full" not in run.tasks[0].log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        run._echo_logs()
    finally:
        run.tasks[0].process.kill()
        run.tasks[0].process.wait()
        run.tasks[0].log.close()
    assert capsys.readouterr().out.splitlines() == [
        "[trainer] step 23 | loss 4.1",
        f"[trainer] (a traceback ending `OSError: [Errno 28] No space left on device`: in {run.tasks[0].log_path})",
        "[trainer rank 0] error: disk full at /x/checkpoints while saving step_00000024: need about 1 bytes, 0 free; "
        "the previous checkpoints are intact. Fix: free space there",
    ]
