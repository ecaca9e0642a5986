"""``up``, ``down`` and ``status`` of the local Slurm cluster: munge, MariaDB + slurmdbd (for sacct),
slurmctld and one slurmd per fake node, all as root on this machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runtime.files import atomic_path
from tools.slurm_local_impl import hosts_file
from tools.slurm_local_impl.mariadb import db_password, ensure_mariadb
from tools.slurm_local_impl.packages import ensure_packages, find_program
from tools.slurm_local_impl.processes import (
    daemon_env,
    is_alive,
    marked_pids,
    port_accepts,
    read_pid,
    running_pid,
    start_foreground_daemon,
    stop_pid,
    tail,
)
from tools.slurm_local_impl.progress import say, wait_until
from tools.slurm_local_impl.render import (
    fake_gpu_file_names,
    render_gres_conf,
    render_slurm_conf,
    render_slurmdbd_conf,
)
from tools.slurm_local_impl.settings import MARKER, SYSTEM_SLURM_CONF, ClusterSettings, StateLayout

DAEMON_START_TIMEOUT_S = 60.0
NODES_IDLE_TIMEOUT_S = 90.0
JOBS_GONE_TIMEOUT_S = 20.0
FAKE_GPU_DEVICE = "/dev/null"


def require_root() -> None:
    """Exit with a clear message unless running as root (slurmd, munged and apt need it)."""
    if os.geteuid() != 0:
        raise SystemExit(
            "slurm_local: must run as root (it starts slurmd/munged and may apt-get install); rerun with sudo."
        )


def daemon_names(settings: ClusterSettings) -> list[str]:
    """Daemons in start order; ``down`` stops them in the reverse order."""
    return ["munged", "mariadbd", "slurmdbd", "slurmctld", *[f"slurmd-{node}" for node in settings.node_names]]


def _write_file(path: Path, text: str, mode: int = 0o644) -> bool:
    """Write through a temp file and a rename; True if the content changed."""
    if path.exists() and path.read_text() == text:
        os.chmod(path, mode)
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as temp:
        temp.write_text(text)
        os.chmod(temp, mode)
    return True


def _prepare_state(settings: ClusterSettings) -> bool:
    """Create the state folder, munge key, fake GPU files and config files; True if a config changed."""
    layout = settings.layout
    # munged insists that every folder above its socket is searchable by everyone.
    for folder in (layout.root, layout.etc, layout.munge_dir, layout.run, layout.log, layout.spool, layout.fake_gpus):
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o755)
    layout.ctld_state.mkdir(parents=True, exist_ok=True)
    if not layout.munge_key.exists():
        with atomic_path(layout.munge_key) as temp:
            temp.write_bytes(os.urandom(1024))
            os.chmod(temp, 0o600)
    for node in settings.node_names:
        node_gpus = layout.fake_gpus / node
        node_gpus.mkdir(parents=True, exist_ok=True)
        for name in fake_gpu_file_names(settings):
            _link_fake_gpu(node_gpus / name)
    changed = _write_file(layout.slurm_conf, render_slurm_conf(settings, _first_job_id(layout)))
    changed |= _write_file(layout.gres_conf, render_gres_conf(settings))
    # slurmdbd refuses a slurmdbd.conf readable by others (it holds the database password).
    changed |= _write_file(layout.slurmdbd_conf, render_slurmdbd_conf(settings, db_password(settings)), mode=0o600)
    return changed


def _first_job_id(layout: StateLayout) -> int:
    """The first job id of this state folder, chosen from the clock when the folder is created and
    kept in it: 100 ids per second of separation between two clusters' creation, wrapping after
    about a week, always below Slurm's default MaxJobId (67,043,328)."""
    path = layout.root / "first_job_id"
    if path.exists():
        return int(path.read_text())
    first = 1000 + (int(time.time()) % 600_000) * 100
    _write_file(path, f"{first}\n")
    return first


def _link_fake_gpu(path: Path) -> None:
    """A fake GPU is a link to /dev/null: slurmd only exports CUDA_VISIBLE_DEVICES / SLURM_STEP_GPUS for
    gres ``File=`` entries that are character or block devices ("is not a valid character or block
    device"); with plain files the GPUs are counted but no task learns which ones it got."""
    if path.is_symlink() and os.readlink(path) == FAKE_GPU_DEVICE:
        return
    temp = path.with_name(path.name + ".tmp")
    temp.unlink(missing_ok=True)
    temp.symlink_to(FAKE_GPU_DEVICE)
    os.replace(temp, path)


def _link_system_slurm_conf(layout: StateLayout) -> None:
    """Point /etc/slurm/slurm.conf at our config so plain sbatch/srun/sacct/submitit find the cluster
    without SLURM_CONF. Refuses to replace a slurm.conf that is not ours."""
    link = SYSTEM_SLURM_CONF
    if link.is_symlink():
        if Path(os.readlink(link)) == layout.slurm_conf:
            return
        if not _is_our_conf(link):
            raise SystemExit(
                f"slurm_local: {link} links to {os.readlink(link)}, not to this cluster; remove it or set SLURM_CONF."
            )
    elif link.exists() and not _is_our_conf(link):
        raise SystemExit(
            f"slurm_local: {link} exists and is not ours (no '{MARKER}' header): this machine has a real Slurm "
            "configuration; refusing to replace it."
        )
    link.parent.mkdir(parents=True, exist_ok=True)
    temp = link.with_name("slurm.conf.slurm_local.tmp")
    temp.unlink(missing_ok=True)
    temp.symlink_to(layout.slurm_conf)
    os.replace(temp, link)


def _is_our_conf(path: Path) -> bool:
    try:
        return MARKER in path.read_text().splitlines()[0]
    except (OSError, IndexError):
        # A dangling link left by a state folder that was deleted by hand is ours to replace only if it
        # points at a file named like ours.
        return path.is_symlink() and Path(os.readlink(path)).name == "slurm.conf" and not path.exists()


def _unlink_system_slurm_conf(layout: StateLayout) -> bool:
    link = SYSTEM_SLURM_CONF
    if link.is_symlink() and Path(os.readlink(link)) == layout.slurm_conf:
        link.unlink()
        return True
    return False


def _slurm_command(layout: StateLayout, *argv: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    program = find_program(argv[0]) or argv[0]
    return subprocess.run(
        [program, *argv[1:]],
        capture_output=True,
        text=True,
        env=daemon_env(layout),
        timeout=timeout_s,
        check=False,
    )


def _log_hint(layout: StateLayout, name: str) -> str:
    """The last lines of a daemon's own log and of its console output, for a failure message."""
    return (
        f"Last lines of {layout.log_file(name)}:\n{tail(layout.log_file(name))}\n"
        f"Last lines of {layout.console_log(name)}:\n{tail(layout.console_log(name))}"
    )


def _start_and_wait(layout: StateLayout, name: str, argv: list[str], ready: Callable[[], bool], what: str) -> None:
    """Start daemon ``name`` and wait until ``ready``; on time-out, exit showing its logs."""
    say(f"starting {name}")
    start_foreground_daemon(argv, name=name, layout=layout)
    wait_until(ready, what, timeout_s=DAEMON_START_TIMEOUT_S, on_timeout=lambda: _log_hint(layout, name))


def _start_munged(settings: ClusterSettings) -> None:
    layout = settings.layout
    argv = [
        find_program("munged") or "munged",
        "--foreground",
        f"--socket={layout.munge_socket}",
        f"--key-file={layout.munge_key}",
        f"--pid-file={layout.munge_dir / 'munged.server.pid'}",
        f"--log-file={layout.log_file('munged')}",
        f"--seed-file={layout.munge_dir / 'munged.seed'}",
    ]
    _start_and_wait(layout, "munged", argv, layout.munge_socket.exists, f"munged socket {layout.munge_socket}")


def _start_slurmdbd(settings: ClusterSettings) -> None:
    port = settings.slurmdbd_port
    argv = [find_program("slurmdbd") or "slurmdbd", "-D"]
    _start_and_wait(settings.layout, "slurmdbd", argv, lambda: port_accepts(port), f"slurmdbd on 127.0.0.1:{port}")


def _register_cluster(settings: ClusterSettings) -> None:
    """Add the cluster to the accounting database before slurmctld registers (idempotent)."""
    layout = settings.layout
    listed = _slurm_command(layout, "sacctmgr", "-n", "-P", "list", "cluster", "format=cluster")
    if settings.cluster_name in listed.stdout.split():
        return
    added = _slurm_command(layout, "sacctmgr", "-i", "add", "cluster", settings.cluster_name)
    if added.returncode != 0 and "already exists" not in (added.stdout + added.stderr):
        detail = added.stderr.strip() or added.stdout.strip()
        raise SystemExit(f"slurm_local: sacctmgr add cluster {settings.cluster_name} failed: {detail}")


def _start_slurmctld(settings: ClusterSettings) -> None:
    port = settings.slurmctld_port
    argv = [find_program("slurmctld") or "slurmctld", "-D"]
    _start_and_wait(settings.layout, "slurmctld", argv, lambda: port_accepts(port), f"slurmctld on 127.0.0.1:{port}")


def _start_slurmd(settings: ClusterSettings, node: str) -> None:
    """Start one slurmd; readiness of all nodes is awaited together through sinfo."""
    say(f"starting slurmd-{node}")
    argv = [find_program("slurmd") or "slurmd", "-D", "-N", node]
    start_foreground_daemon(argv, name=f"slurmd-{node}", layout=settings.layout)


@dataclass(frozen=True)
class NodeInfo:
    """One node as ``sinfo`` reports it."""

    name: str
    state: str
    gres: str
    cpus: int
    memory_mib: int
    reason: str


def node_infos(layout: StateLayout) -> list[NodeInfo]:
    """Nodes of the cluster from ``sinfo -N``; empty if slurmctld does not answer."""
    try:
        result = _slurm_command(layout, "sinfo", "-N", "-h", "-o", "%N|%T|%G|%c|%m|%E", timeout_s=15)
    except subprocess.TimeoutExpired:
        return []
    if result.returncode != 0:
        return []
    nodes: dict[str, NodeInfo] = {}
    for line in result.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 6:
            name, state, gres, cpus, memory, reason = parts
            nodes[name] = NodeInfo(name, state, gres, int(cpus), int(memory), reason)
    return [nodes[name] for name in sorted(nodes)]


def _nodes_ready(settings: ClusterSettings) -> bool:
    infos = {info.name: info for info in node_infos(settings.layout)}
    for node in settings.node_names:
        info = infos.get(node)
        if info is None:
            return False
        state = info.state.rstrip("*~#%$@+").lower()
        if "drain" in state or state in ("down", "fail", "failing"):
            raise SystemExit(
                f"slurm_local: node {node} is {info.state} ({info.reason}); see {settings.layout.log_file(f'slurmd-{node}')} "
                "and the slurmctld log, then run `tools/slurm_local down` and `up` again."
            )
        if state not in ("idle", "mixed", "allocated", "completing"):
            return False
    return True


def _settle_dead_pid_files(settings: ClusterSettings) -> None:
    """Remove pid files of daemons that are gone, so a restarted daemon is not mistaken for a stale one."""
    layout = settings.layout
    for name in daemon_names(settings):
        pid_file = layout.pid_file(name)
        if pid_file.exists() and running_pid(pid_file, layout) is None:
            pid_file.unlink()


def up(settings: ClusterSettings) -> None:
    """Bring the cluster up; every step is skipped when already done, so ``up`` twice is fine."""
    require_root()
    started = time.monotonic()
    layout = settings.layout
    ensure_packages(layout.log_file("apt"))
    _settle_dead_pid_files(settings)
    config_changed = _prepare_state(settings)
    if config_changed and running_pid(layout.pid_file("slurmctld"), layout) is not None:
        say(
            "the rendered configuration changed while the cluster runs: run `tools/slurm_local down` then `up` to apply it"
        )
    _link_system_slurm_conf(layout)
    hosts_file.add_node_names(settings.node_names)

    if running_pid(layout.pid_file("munged"), layout) is None:
        _start_munged(settings)
    ensure_mariadb(settings)
    if running_pid(layout.pid_file("slurmdbd"), layout) is None:
        _start_slurmdbd(settings)
    _register_cluster(settings)
    if running_pid(layout.pid_file("slurmctld"), layout) is None:
        _start_slurmctld(settings)
    for node in settings.node_names:
        if running_pid(layout.pid_file(f"slurmd-{node}"), layout) is None:
            _start_slurmd(settings, node)
    wait_until(
        lambda: _nodes_ready(settings),
        f"nodes {', '.join(settings.node_names)} to register as idle",
        timeout_s=NODES_IDLE_TIMEOUT_S,
        on_timeout=lambda: "\n".join(_log_hint(layout, f"slurmd-{node}") for node in settings.node_names),
    )
    say(f"cluster up in {time.monotonic() - started:.1f} s (state folder {layout.root})")


def _cancel_all_jobs(layout: StateLayout) -> None:
    listed = _slurm_command(layout, "squeue", "-h", "-o", "%A", timeout_s=15)
    job_ids = sorted(set(listed.stdout.split())) if listed.returncode == 0 else []
    if not job_ids:
        return
    say(f"cancelling {len(job_ids)} job(s): {' '.join(job_ids)}")
    _slurm_command(layout, "scancel", *job_ids, timeout_s=15)

    def no_jobs_left() -> bool:
        result = _slurm_command(layout, "squeue", "-h", "-o", "%A", timeout_s=15)
        return result.returncode != 0 or not result.stdout.strip()

    try:
        wait_until(no_jobs_left, "cancelled jobs to leave the queue", timeout_s=JOBS_GONE_TIMEOUT_S)
    except SystemExit as error:
        say(f"{error}; stopping the daemons anyway")


def down(settings: ClusterSettings, keep_state: bool = False) -> None:
    """Cancel every job, stop every daemon and leftover step process of this cluster, remove the
    /etc/hosts line, the /etc/slurm/slurm.conf link and (unless ``keep_state``) the state folder.
    Fine to run when the cluster is already down."""
    require_root()
    layout = settings.layout
    if running_pid(layout.pid_file("slurmctld"), layout) is not None:
        try:
            _cancel_all_jobs(layout)
        except subprocess.TimeoutExpired:
            say("squeue/scancel did not answer; stopping the daemons anyway")
    for name in reversed(daemon_names(settings)):
        pid = running_pid(layout.pid_file(name), layout)
        if pid is not None:
            say(f"stopping {name} (pid {pid})")
            stop_pid(pid)
    leftovers = marked_pids(layout)
    for pid in leftovers:
        say(f"killing leftover process {pid} of this cluster")
        stop_pid(pid, timeout_s=3.0)
    if _unlink_system_slurm_conf(layout):
        say(f"removed the {SYSTEM_SLURM_CONF} link")
    if hosts_file.remove_node_names():
        say("removed the node names from /etc/hosts")
    if not keep_state and layout.root.exists():
        shutil.rmtree(layout.root)
        say(f"removed {layout.root}")
    say("cluster down")


@dataclass(frozen=True)
class ClusterStatus:
    """What runs: daemons (pid or None), nodes as sinfo reports them, and the system hooks."""

    state_dir: str
    cluster_name: str
    partition: str
    daemons: dict[str, int | None]
    nodes: list[NodeInfo]
    hosts_line: bool
    slurm_conf_linked: bool
    queue: list[str]

    @property
    def running(self) -> bool:
        """True when every daemon runs and every node is usable."""
        ready = {"idle", "mixed", "allocated", "completing"}
        return (
            all(pid is not None for pid in self.daemons.values())
            and bool(self.nodes)
            and all(node.state.rstrip("*~#%$@+").lower() in ready for node in self.nodes)
        )

    @property
    def stopped(self) -> bool:
        """True when nothing of the cluster runs."""
        return all(pid is None for pid in self.daemons.values())


def status(settings: ClusterSettings) -> ClusterStatus:
    """Collect the cluster's status without changing anything."""
    layout = settings.layout
    daemons = {name: running_pid(layout.pid_file(name), layout) for name in daemon_names(settings)}
    nodes = node_infos(layout) if daemons["slurmctld"] is not None else []
    queue: list[str] = []
    if daemons["slurmctld"] is not None:
        listed = _slurm_command(layout, "squeue", "-h", "-o", "%i|%j|%T|%N|%r", timeout_s=15)
        queue = listed.stdout.splitlines() if listed.returncode == 0 else []
    return ClusterStatus(
        state_dir=str(layout.root),
        cluster_name=settings.cluster_name,
        partition=settings.partition,
        daemons=daemons,
        nodes=nodes,
        hosts_line=hosts_file.has_node_names(),
        slurm_conf_linked=SYSTEM_SLURM_CONF.is_symlink() and Path(os.readlink(SYSTEM_SLURM_CONF)) == layout.slurm_conf,
        queue=queue,
    )


def stale_pid_files(settings: ClusterSettings) -> list[str]:
    """Daemons whose pid file names a process that is no longer alive (for status hints)."""
    layout = settings.layout
    return [
        name
        for name in daemon_names(settings)
        if (pid := read_pid(layout.pid_file(name))) is not None and not is_alive(pid)
    ]
