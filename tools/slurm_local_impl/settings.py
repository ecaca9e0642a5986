"""Settings of the local test cluster and the layout of its one state folder."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

STATE_DIR_ENV = "DSPARK_SLURM_LOCAL_DIR"
"""Environment variable that moves the state folder (default ``DEFAULT_STATE_DIR``)."""

DEFAULT_STATE_DIR = Path("/var/tmp/dspark-slurm-local")

MARKER = "dspark slurm_local"
"""Written into every file and /etc/hosts line this tool owns, so ``down`` removes only its own things."""

PROCESS_MARKER_ENV = "DSPARK_SLURM_LOCAL_STATE"
"""Set in the environment of every daemon we start (and so of every slurmstepd they fork), holding the
state folder: ``down`` finds leftover processes of this cluster by it, and nothing else."""

SYSTEM_SLURM_CONF = Path("/etc/slurm/slurm.conf")
"""Where Slurm clients (sbatch, srun, sacct, submitit) look by default; ``up`` links it to our config."""


@dataclass(frozen=True)
class ClusterSettings:
    """Shape and ports of the local cluster. Defaults fit the tiny recipe and the Kimi K3 job shape
    (capture: 8 GPUs x 64 CPUs; trainer: 4 tasks x 1 GPU x 16 CPUs) on three fake nodes (a job
    with two capture nodes and a trainer node fits)."""

    state_dir: Path
    cluster_name: str = "dspark"
    partition: str = "local"
    node_names: tuple[str, ...] = ("node1", "node2", "node3")
    cpus_per_node: int = 64
    real_memory_mib: int = 512 * 1024
    gpus_per_node: int = 8
    slurmctld_port: int = 16817
    slurmdbd_port: int = 16819
    first_slurmd_port: int = 17001
    mariadb_port: int = 16306
    hostname: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    """Short host name: slurmctld matches SlurmctldHost against it, and every node's NodeHostname is it."""

    @property
    def slurmd_ports(self) -> dict[str, int]:
        """One slurmd port per node, consecutive from ``first_slurmd_port``."""
        return {name: self.first_slurmd_port + index for index, name in enumerate(self.node_names)}

    @property
    def layout(self) -> StateLayout:
        """Paths inside the state folder."""
        return StateLayout(self.state_dir)


@dataclass(frozen=True)
class StateLayout:
    """Every file the cluster writes lives below ``root``; nothing else is written except the
    /etc/hosts lines and the /etc/slurm/slurm.conf link, both removed by ``down``."""

    root: Path

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def gres_conf(self) -> Path:
        return self.etc / "gres.conf"

    @property
    def slurmdbd_conf(self) -> Path:
        return self.etc / "slurmdbd.conf"

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    @property
    def munge_key(self) -> Path:
        return self.munge_dir / "munge.key"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket"

    @property
    def mariadb_dir(self) -> Path:
        return self.root / "mariadb"

    @property
    def mariadb_data(self) -> Path:
        return self.mariadb_dir / "data"

    @property
    def mariadb_socket(self) -> Path:
        return self.mariadb_dir / "mariadb.sock"

    @property
    def db_password_file(self) -> Path:
        """Random per-cluster password of the slurmdbd database user (mode 600, never committed)."""
        return self.mariadb_dir / "slurm-user.password"

    @property
    def run(self) -> Path:
        """Pid files."""
        return self.root / "run"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    @property
    def ctld_state(self) -> Path:
        return self.spool / "slurmctld"

    @property
    def fake_gpus(self) -> Path:
        """Plain files standing in for /dev/nvidiaN (gres.conf ``File=``), one folder per node."""
        return self.root / "gpus"

    def pid_file(self, daemon: str) -> Path:
        """Pid file of one daemon (``munged``, ``mariadbd``, ``slurmdbd``, ``slurmctld``, ``slurmd-node1``)."""
        return self.run / f"{daemon}.pid"

    def log_file(self, daemon: str) -> Path:
        """The daemon's own log file."""
        return self.log / f"{daemon}.log"

    def console_log(self, daemon: str) -> Path:
        """The daemon's stdout and stderr (start-up errors before its own log opens)."""
        return self.log / f"{daemon}.console.log"


def resolve_state_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The state folder: ``explicit`` if given, else ``$DSPARK_SLURM_LOCAL_DIR``, else the folder the
    live /etc/slurm/slurm.conf link points into (a cluster already up), else ``DEFAULT_STATE_DIR``."""
    if explicit:
        return Path(explicit).resolve()
    from_env = os.environ.get(STATE_DIR_ENV)
    if from_env:
        return Path(from_env).resolve()
    linked = linked_state_dir()
    if linked is not None:
        return linked
    return DEFAULT_STATE_DIR


def linked_state_dir() -> Path | None:
    """The state folder the system slurm.conf link points into, if that link is ours."""
    if not SYSTEM_SLURM_CONF.is_symlink():
        return None
    target = Path(os.readlink(SYSTEM_SLURM_CONF))
    if target.name == "slurm.conf" and target.parent.name == "etc":
        return target.parent.parent
    return None
