"""Issue 28, item 5: every child of the run dies with its parent, every time. A small parent process
starts a child through the same code the run uses (the component tasks' spawn, the Mooncake master's
spawn, the SGLang server's parent-death request), prints the child's pid and is killed with SIGKILL;
the child must be gone within 2 s. A component that does not stop on its SIGTERM (a trainer rank
waiting for a step boundary that never comes: before, one lived on for about 45 s) is ended by its
orphan watch after its grace."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GONE_WITHIN_S = 2.0

SLEEPER = "import time; time.sleep(60)"
STUBBORN = (
    # a component that takes its SIGTERM as "stop at the next step boundary" and never gets there
    "import os, signal, time; from runtime.shared.lifecycle import exit_when_orphaned; "
    "signal.signal(signal.SIGTERM, lambda *a: None); "
    "exit_when_orphaned(int(os.environ['DSPARK_PARENT_PID']), grace_s=1.0, poll_s=0.1); time.sleep(60)"
)

PARENTS = {
    "component": (
        "import os, sys, time; from pathlib import Path; from launcher.component import spawn_component; "
        "p = spawn_component([sys.executable, '-c', {child!r}], dict(os.environ), Path.cwd()); "
        "print(p.pid, flush=True); time.sleep(60)"
    ),
    "mooncake_master": (
        "import sys, time; from runtime.transport.master import MasterProcess, MasterSettings; "
        "m = MasterProcess(MasterSettings('127.0.0.1', 1, 2, 3, 60, 0.9)); "
        "p = m._spawn([sys.executable, '-c', {child!r}]); print(p.pid, flush=True); time.sleep(60)"
    ),
    # `launcher eval --local`, the data.prepare_commands and the plots: run_attached
    "attached": (
        "import sys, threading, time; from launcher.component import run_attached; "
        "threading.Timer(0.5, lambda: print(open('/proc/self/task/' + str(__import__('os').getpid()) + "
        "'/children').read().split()[0], flush=True)).start(); "
        "run_attached([sys.executable, '-c', {child!r}], cwd='.')"
    ),
    "sglang_server": (  # engine_sglang starts its server with preexec_fn=die_with_parent
        "import subprocess, sys, time; from runtime.shared.lifecycle import die_with_parent; "
        "p = subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True, preexec_fn=die_with_parent); "
        "print(p.pid, flush=True); time.sleep(60)"
    ),
}


def _alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill_parent_and_time_the_child(parent_code: str) -> tuple[int, float | None]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        child = int(parent.stdout.readline())  # type: ignore[union-attr]
        time.sleep(0.3)  # the child is past its exec
        assert _alive(child)
        killed_at = time.monotonic()
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = killed_at + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        return child, (time.monotonic() - killed_at) if not _alive(child) else None
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("spawn", sorted(PARENTS))
def test_a_child_dies_with_its_killed_parent(spawn: str) -> None:
    child, took_s = _kill_parent_and_time_the_child(PARENTS[spawn].format(child=SLEEPER))
    assert took_s is not None and took_s < GONE_WITHIN_S, (
        f"{spawn} child {child} still there after kill -9 of its parent"
    )


def test_a_component_that_does_not_stop_is_ended_by_its_orphan_watch() -> None:
    child, took_s = _kill_parent_and_time_the_child(PARENTS["component"].format(child=STUBBORN))
    # grace 1 s + one poll: gone within 2 s, where the parent-death SIGTERM alone left it running
    assert took_s is not None and took_s < GONE_WITHIN_S, f"the component {child} outlived its parent"


def test_a_parent_that_died_before_the_request_is_noticed() -> None:
    """The race: the parent dies between the fork and the child's prctl. The child compares its parent
    with the pid the parent had, and signals itself."""
    code = "import time; from runtime.shared.lifecycle import die_with_parent; die_with_parent(15, parent_pid=1); time.sleep(30)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=20
    )
    assert done.returncode == -signal.SIGTERM


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_to_the_parent_alone_stops_its_attached_child(signum: int) -> None:
    """``kill -TERM`` of the launcher's pid only (not its group) during ``eval --local`` or a prepare
    command: before, the launcher ended and its child ran on to the end as an orphan. Now the child's
    whole group gets SIGTERM, the parent waits for it and says so."""
    code = (
        "import sys, os; from launcher.component import run_attached, ChildStopped\n"
        "try:\n"
        "    run_attached([sys.executable, '-c', 'import os, time; print(os.getpid(), flush=True); time.sleep(60)'],"
        " cwd='.')\n"
        "except ChildStopped as exc:\n"
        "    print('stopped', exc.signum, exc.returncode, flush=True); sys.exit(3)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    child = int(parent.stdout.readline())  # type: ignore[union-attr]
    try:
        os.kill(parent.pid, signum)
        out, _ = parent.communicate(timeout=10)
        assert parent.returncode == 3 and out.split() == ["stopped", str(int(signum)), str(-signal.SIGTERM)], out
        assert not _alive(child)
    finally:
        if parent.poll() is None:
            parent.kill()
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_result_files_are_written_whole_or_not_at_all_when_a_stop_comes_meanwhile(tmp_path: Path) -> None:
    """The evaluation writes results.json, summary.txt and plots with the stop signals held back: a SIGTERM
    that comes meanwhile ends it after the last file, never between two."""
    code = (
        "import os, signal, time, pathlib; from runtime.shared.lifecycle import stop_signals_deferred\n"
        f"out = pathlib.Path({str(tmp_path)!r})\n"
        "with stop_signals_deferred():\n"
        "    (out / 'results.json').write_text('{}')\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.3)\n"
        "    (out / 'summary.txt').write_text('done')\n"
        "(out / 'after').write_text('never')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == -signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "summary.txt"]


def test_a_prepare_command_stops_with_the_launcher(tmp_path: Path) -> None:
    """Issue 35's fault campaign: SIGTERM to the launcher's pid during ``data.prepare_commands`` left
    tools.tiny_target running as an orphan, which finished the target a minute later. The command (and what
    it started: a shell pipeline) now stops with the launcher, which says so in one line."""
    pids = tmp_path / "pids"
    command = f"sleep 60 & echo $! >> {pids}; echo $$ >> {pids}; wait"  # a shell and its child
    code = (
        "from pathlib import Path; from launcher.inputs import prepare_missing_inputs; "
        "from runtime.recipe import load_recipe; "
        f"r = load_recipe(Path('recipes/tiny.yaml'), [f'data.train_path={tmp_path}/none.jsonl', "
        f"'data.prepare_commands=[\"{command}\"]']).recipe; prepare_missing_inputs(r, Path('.'), 'tiny')"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while (not pids.exists() or len(pids.read_text().split()) < 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    children = [int(p) for p in pids.read_text().split()]
    try:
        parent.send_signal(signal.SIGTERM)
        out, _ = parent.communicate(timeout=10)
        assert parent.returncode == 128 + signal.SIGTERM, out
        assert "[prepare] stopped (SIGTERM) during `sleep 60" in out and "Traceback" not in out, out
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in children if _alive(p)], "the command and its child stopped with the launcher"
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
