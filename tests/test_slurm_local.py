"""tools/slurm_local: the real local Slurm cluster, exercised with plain sbatch/srun/sacct/scancel.

The cluster tests (marker ``slurm``) submit real two-component heterogeneous jobs and read what the
tasks wrote. The unit tests at the end check the rendered configuration and the /etc/hosts editing on
temporary files and need neither root nor Slurm.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import SLURM_LOCAL, LocalSlurmCluster, slurm_local_status
from tools.slurm_local_impl import hosts_file
from tools.slurm_local_impl.lock import lock_path
from tools.slurm_local_impl.processes import is_alive, marked_pids
from tools.slurm_local_impl.render import render_gres_conf, render_slurm_conf
from tools.slurm_local_impl.settings import MARKER, SYSTEM_SLURM_CONF, ClusterSettings, StateLayout

JOB_TIMEOUT_S = 60.0
# A requeued job may start again only after AuthInfo cred_expire (15 s here) plus a scheduler pass.
REQUEUE_TIMEOUT_S = 90.0

# One task of a component: writes its environment, how node1 resolves, and its pid to
# $OUT/g<group>-r<restart>-t<procid>.env (temp name, then rename), then sleeps and exits as told.
TASK_SCRIPT = """\
group=$1; sleep_s=$2; exit_code=$3
restart=${SLURM_RESTART_COUNT:-0}
file="$OUT/g${group}-r${restart}-t${SLURM_PROCID}"
{ env; echo "RESOLVED_NODE1=$(getent hosts node1 | awk '{print $1}')"; echo "TASK_PID=$$"; } > "$file.tmp"
mv "$file.tmp" "$file.env"
# A sleep ended by a signal ends the task with its status: when Slurm signals the step's processes one
# by one, the shell must not go on to `exit 0` after its sleep was killed (sacct then said COMPLETED).
if [ "$restart" = "0" ]; then sleep "$sleep_s" || exit $?; fi
exit "$exit_code"
"""

# Two components as the launcher submits them: capture (1 task, 8 GPUs) and trainer (4 tasks,
# 4 GPUs). The batch script exits with the first non-zero component status, which ends the job and
# so the other component too.
HETJOB_SCRIPT = """\
#!/bin/bash
#SBATCH --job-name=slurm-local-test
#SBATCH --partition={partition}
#SBATCH --output={out}/batch-%j.out
#SBATCH --nodes=1 --ntasks-per-node=1 --cpus-per-task=2 --gres=gpu:8
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks-per-node=4 --cpus-per-task=1 --gres=gpu:4
export OUT={out}
echo "restart=${{SLURM_RESTART_COUNT:-0}}" >> "$OUT/batch-runs.txt"
srun --het-group=0 bash "$OUT/task.sh" 0 {sleep0_s} {exit0} &
srun --het-group=1 bash "$OUT/task.sh" 1 {sleep1_s} {exit1} &
wait -n; rc=$?
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
wait -n
"""


def _run(*argv: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    assert result.returncode == 0, f"{' '.join(argv)} failed ({result.returncode}): {result.stderr}"
    return result


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.25)


def _submit_hetjob(
    cluster: LocalSlurmCluster,
    out: Path,
    sleep_s: tuple[int, int] = (0, 0),
    exit_codes: tuple[int, int] = (0, 0),
) -> str:
    """Write the task and batch scripts into ``out``, submit with plain sbatch, return the leader id."""
    (out / "task.sh").write_text(TASK_SCRIPT)
    script = out / "hetjob.sbatch"
    script.write_text(
        HETJOB_SCRIPT.format(
            partition=cluster.partition,
            out=out,
            sleep0_s=sleep_s[0],
            sleep1_s=sleep_s[1],
            exit0=exit_codes[0],
            exit1=exit_codes[1],
        )
    )
    submitted = _run("sbatch", "--parsable", str(script))
    return submitted.stdout.strip().split(";")[0]


def _sacct(job_id: str) -> dict[str, tuple[str, str, str]]:
    """``JobID -> (State, ExitCode, NodeList)`` for the job and its steps."""
    result = _run("sacct", "-j", job_id, "-n", "-o", "JobID,State,ExitCode,NodeList", "--parsable2")
    rows = {}
    for line in result.stdout.splitlines():
        job, state, exit_code, nodes = line.split("|")
        rows[job] = (state, exit_code, nodes)
    return rows


def _components_in_state(job_id: str, *prefixes: str) -> Callable[[], bool]:
    """True once sacct lists both ``+0`` and ``+1`` with a state starting with one of ``prefixes``
    (sacct lags the controller by a second or more, and first shows the leader without ``+0``)."""

    def check() -> bool:
        rows = _sacct(job_id)
        return all(
            f"{job_id}+{offset}" in rows and rows[f"{job_id}+{offset}"][0].startswith(prefixes) for offset in (0, 1)
        )

    return check


def _task_envs(out: Path, group: int, restart: int = 0) -> list[dict[str, str]]:
    """The environments the tasks of one component wrote, ordered by SLURM_PROCID."""
    envs = []
    for path in sorted(out.glob(f"g{group}-r{restart}-t*.env")):
        pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
        envs.append(dict(pairs))
    return sorted(envs, key=lambda env: int(env["SLURM_PROCID"]))


def _squeue_states(job_id: str) -> list[str]:
    result = _run("squeue", "-h", "-j", job_id, "-o", "%T")
    return result.stdout.split()


@pytest.mark.slurm
def test_status_reports_three_idle_nodes_with_eight_gpus_and_up_is_idempotent(slurm_cluster: LocalSlurmCluster) -> None:
    before = slurm_local_status()
    assert before["running"], before
    _run(str(SLURM_LOCAL), "up", timeout_s=120)
    after = slurm_local_status()
    # A second `up` finds every daemon running and starts nothing.
    assert after["daemons"] == before["daemons"]
    assert all(pid is not None for pid in after["daemons"].values())
    assert [node["name"] for node in after["nodes"]] == ["node1", "node2", "node3"]
    for node in after["nodes"]:
        assert node["gres"] == "gpu:8"
        assert node["cpus"] >= 64
        busy = bool(after["queue"])  # another session's jobs may hold the nodes
        assert node["state"] == "idle" or (busy and node["state"] in ("mixed", "allocated")), node
    assert after["hosts_line"] and after["slurm_conf_linked"]
    text = subprocess.run([str(SLURM_LOCAL), "status"], capture_output=True, text=True, timeout=60, check=False)
    assert text.returncode == 0
    assert "cluster: running" in text.stdout
    assert "node node1:" in text.stdout and "gres=gpu:8" in text.stdout


@pytest.mark.slurm
def test_hetjob_components_run_on_two_nodes_and_sacct_lists_both(
    slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    job_id = _submit_hetjob(slurm_cluster, tmp_path)
    _wait_for(_components_in_state(job_id, "COMPLETED"), f"job {job_id}+0 and +1 to complete", JOB_TIMEOUT_S)

    capture, trainer = _task_envs(tmp_path, 0), _task_envs(tmp_path, 1)
    assert len(capture) == 1 and len(trainer) == 4
    capture_node = capture[0]["SLURMD_NODENAME"]
    trainer_nodes = {env["SLURMD_NODENAME"] for env in trainer}
    assert len(trainer_nodes) == 1
    (trainer_node,) = trainer_nodes
    assert capture_node != trainer_node and {capture_node, trainer_node} <= {"node1", "node2", "node3"}
    assert [env["SLURM_PROCID"] for env in trainer] == ["0", "1", "2", "3"]
    assert {env["SLURM_NTASKS"] for env in trainer} == {"4"} and capture[0]["SLURM_NTASKS"] == "1"
    for env in [*capture, *trainer]:
        assert env["SLURM_JOB_NODELIST_HET_GROUP_0"] == capture_node
        assert env["SLURM_JOB_NODELIST_HET_GROUP_1"] == trainer_node
        # Programs in jobs resolve the fake node names (the /etc/hosts line of `up`).
        assert env["RESOLVED_NODE1"] == "127.0.0.1"
    # Fake GPUs reach the tasks the way real ones do (needs gres File= to be a character device).
    assert capture[0]["CUDA_VISIBLE_DEVICES"].split(",") == [str(index) for index in range(8)]
    assert {env["CUDA_VISIBLE_DEVICES"] for env in trainer} == {"0,1,2,3"}

    rows = _sacct(job_id)
    assert rows[f"{job_id}+0"] == ("COMPLETED", "0:0", capture_node)
    assert rows[f"{job_id}+1"] == ("COMPLETED", "0:0", trainer_node)


@pytest.mark.slurm
def test_failing_component_ends_both_and_sacct_reports_failure(
    slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    job_id = _submit_hetjob(slurm_cluster, tmp_path, sleep_s=(300, 0), exit_codes=(0, 3))
    _wait_for(_components_in_state(job_id, "FAILED"), f"job {job_id}+0 and +1 to fail", JOB_TIMEOUT_S)
    rows = _sacct(job_id)
    assert rows[f"{job_id}+0"][:2] == ("FAILED", "3:0")
    assert rows[f"{job_id}+1"][:2] == ("FAILED", "3:0")
    # The capture component was still sleeping: its step was ended by Slurm, its process is gone. (sacct
    # says CANCELLED, or FAILED when the task's own exit status, 143, reaches it first.)
    capture_steps = [
        state for job, (state, _, _) in rows.items() if job.startswith(f"{job_id}+0.") and job[-1].isdigit()
    ]
    assert len(capture_steps) == 1 and capture_steps[0] in ("CANCELLED", "FAILED"), capture_steps
    (capture,) = _task_envs(tmp_path, 0)
    _wait_for(lambda: not is_alive(int(capture["TASK_PID"])), "the capture task to exit", 15)


@pytest.mark.slurm
def test_scancel_of_the_leader_cancels_both_components(slurm_cluster: LocalSlurmCluster, tmp_path: Path) -> None:
    job_id = _submit_hetjob(slurm_cluster, tmp_path, sleep_s=(300, 300))
    _wait_for(lambda: len(list(tmp_path.glob("g*-r0-t*.env"))) == 5, "all five tasks to start", JOB_TIMEOUT_S)
    assert _squeue_states(job_id) == ["RUNNING", "RUNNING"]
    _run("scancel", job_id)
    _wait_for(_components_in_state(job_id, "CANCELLED"), f"job {job_id}+0 and +1 to be cancelled", JOB_TIMEOUT_S)
    assert _squeue_states(job_id) == []
    task_pids = [int(env["TASK_PID"]) for env in [*_task_envs(tmp_path, 0), *_task_envs(tmp_path, 1)]]
    _wait_for(lambda: not any(is_alive(pid) for pid in task_pids), "the cancelled tasks to exit", 15)


@pytest.mark.slurm
def test_requeue_of_the_leader_reruns_both_components_from_the_top(
    slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    # The tasks sleep only in the first run, so the rerun completes by itself.
    job_id = _submit_hetjob(slurm_cluster, tmp_path, sleep_s=(300, 300))
    _wait_for(lambda: len(list(tmp_path.glob("g*-r0-t*.env"))) == 5, "all five tasks to start", JOB_TIMEOUT_S)
    _run("scontrol", "requeue", job_id)
    _wait_for(_components_in_state(job_id, "COMPLETED"), f"requeued job {job_id} to complete", REQUEUE_TIMEOUT_S)
    assert (tmp_path / "batch-runs.txt").read_text().split() == ["restart=0", "restart=1"]
    rerun_capture, rerun_trainer = _task_envs(tmp_path, 0, restart=1), _task_envs(tmp_path, 1, restart=1)
    assert len(rerun_capture) == 1 and len(rerun_trainer) == 4
    assert {env["SLURM_RESTART_COUNT"] for env in [*rerun_capture, *rerun_trainer]} == {"1"}
    # Same job ids after the requeue: the leader keeps its id, so does the second component.
    assert rerun_capture[0]["SLURM_JOB_ID_HET_GROUP_0"] == job_id
    history = _run("sacct", "-D", "-X", "-j", job_id, "-n", "-o", "JobID,State", "--parsable2").stdout.splitlines()
    assert history.count(f"{job_id}+0|REQUEUED") == 1 and history.count(f"{job_id}+1|REQUEUED") == 1


@pytest.mark.slurm
def test_down_leaves_nothing_and_up_restores(slurm_cluster: LocalSlurmCluster) -> None:
    """Runs last in this file: tears down the cluster this session started and brings it back."""
    if not slurm_cluster.started_by_this_session:
        pytest.skip("the cluster was up before this session; not tearing down someone else's cluster")
    layout = StateLayout(slurm_cluster.state_dir)
    _run(str(SLURM_LOCAL), "down", timeout_s=120)
    try:
        assert marked_pids(layout) == []
        assert not slurm_cluster.state_dir.exists()
        assert not hosts_file.has_node_names()
        assert not SYSTEM_SLURM_CONF.is_symlink()
        assert not lock_path(slurm_cluster.state_dir).exists()
        assert slurm_local_status()["stopped"]
        _run(str(SLURM_LOCAL), "down", timeout_s=60)  # down when down is fine
    finally:
        _run(str(SLURM_LOCAL), "up", timeout_s=300)
    assert slurm_local_status()["running"]


def test_hosts_line_is_added_once_and_removed_without_touching_other_lines(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    original = "127.0.0.1 localhost\n10.0.0.5 login # site line\n"
    hosts.write_text(original)
    hosts_file.add_node_names(("node1", "node2"), path=hosts)
    hosts_file.add_node_names(("node1", "node2"), path=hosts)
    lines = hosts.read_text().splitlines()
    assert lines[:2] == original.splitlines()
    assert lines[2:] == [f"127.0.0.1 node1 node2  # {MARKER}"]
    assert hosts_file.has_node_names(path=hosts)
    assert hosts_file.remove_node_names(path=hosts)
    assert hosts.read_text() == original
    assert not hosts_file.remove_node_names(path=hosts)


def test_rendered_config_gives_each_node_its_own_port_and_eight_gpu_devices(tmp_path: Path) -> None:
    settings = ClusterSettings(state_dir=tmp_path, hostname="testhost")
    conf = render_slurm_conf(settings, first_job_id=4321)
    node_lines = [line for line in conf.splitlines() if line.startswith("NodeName=")]
    ports = [word.split("=")[1] for line in node_lines for word in line.split() if word.startswith("Port=")]
    assert [line.split()[0] for line in node_lines] == ["NodeName=node1", "NodeName=node2", "NodeName=node3"]
    assert ports == ["17001", "17002", "17003"]
    assert all("Gres=gpu:8" in line and "NodeAddr=127.0.0.1" in line for line in node_lines)
    assert "FirstJobId=4321" in conf.splitlines()
    assert f"SlurmdSpoolDir={tmp_path}/spool/slurmd-%n" in conf.splitlines()
    gres = render_gres_conf(settings).splitlines()
    assert f"NodeName=node2 Name=gpu File={tmp_path}/gpus/node2/nvidia[0-7]" in gres
    # Every setting line is key=value: a typo'd line would make slurmctld refuse to start.
    for line in conf.splitlines():
        if line and not line.startswith("#"):
            assert all("=" in word for word in line.split()), line
