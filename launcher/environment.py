"""The environment contract of a component process, derived in this one place.

Every component process gets an explicit environment:
- inherited rendezvous variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, NODE_RANK,
  ...) are cleared first, so a component never joins a process group it did not ask for;
- ``DSPARK_*`` variables (named in :mod:`runtime.shared.contracts`) name the job folder, the
  resolved recipe, the component, this node's routable bind address and the capture node with its
  Mooncake endpoints;
- Mooncake client settings (``MC_TCP_BIND_ADDRESS``, ``MC_TRANSFER_TIMEOUT``) come from the recipe;
- trainer ranks get RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT /
  NODE_RANK derived from their own het group's Slurm variables (or from the local launcher).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from runtime.recipe import Recipe
from runtime.shared import contracts

COMPONENTS: tuple[str, ...] = ("capture", "trainer")
THREADS_VARIABLE = "OMP_NUM_THREADS"
"""How many CPU threads a component task computes with (torch reads it when it loads)."""
"""Het group order: group 0 is capture, group 1 is trainer."""

RENDEZVOUS_VARIABLES: tuple[str, ...] = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)
"""Variables a component must never inherit (a stale MASTER_ADDR joins the wrong group)."""

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class TaskPlacement:
    """Where one task of a component runs: its rank inside the component and the nodes it uses."""

    component: str
    rank: int
    """Rank within the component (SLURM_PROCID of its het group)."""
    local_rank: int
    """Rank within its node."""
    world_size: int
    """Tasks of the component."""
    local_world_size: int
    """Tasks of the component on this node."""
    node_rank: int
    """Index of this node within the component."""
    first_node: str
    """Host name of the component's first node (the trainer's MASTER_ADDR)."""
    capture_host: str
    """Routable address of the capture node (Mooncake master)."""
    bind_address: str
    """Routable address of this node."""


def het_group_index(component: str) -> int:
    """Het group number of ``component`` (capture 0, trainer 1)."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}; expected one of {', '.join(COMPONENTS)}")
    return COMPONENTS.index(component)


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list such as ``node[1-3,7],gpu01`` (no scontrol call needed)."""
    hosts: list[str] = []
    for group in _split_top_level(hostlist):
        if "[" not in group:
            if group:
                hosts.append(group)
            continue
        prefix, rest = group.split("[", 1)
        ranges, suffix = rest.split("]", 1)
        for part in ranges.split(","):
            if "-" in part:
                low, high = part.split("-", 1)
                width = len(low)
                hosts += [f"{prefix}{n:0{width}d}{suffix}" for n in range(int(low), int(high) + 1)]
            else:
                hosts.append(f"{prefix}{part}{suffix}")
    return hosts


def _split_top_level(hostlist: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in hostlist:
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += char == "["
        depth -= char == "]"
        current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def resolve_address(recipe: Recipe, host: str, local: bool) -> str:
    """The address Mooncake binds to / dials for ``host``: loopback in local mode, the recipe's
    explicit ``transport.bind_address``, or ``host`` resolved through the resolver."""
    if local:
        return LOOPBACK
    configured = recipe.transport.bind_address
    if configured != "auto":
        return configured
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise RuntimeError(
            f"cannot resolve host {host!r} to an address for Mooncake ({exc}); set "
            "transport.bind_address to this node's routable IP in the recipe"
        ) from exc


def slurm_placement(recipe: Recipe, component: str, env: Mapping[str, str]) -> TaskPlacement:
    """Placement of the current srun task from its het group's Slurm variables. A ``job.layout: one_node``
    job has no het groups: both components read the job's one node list, or their own node, which is the
    same node, and the world size is their step's ``--ntasks``."""
    group = het_group_index(component)
    capture_nodes = _group_nodelist(env, 0)
    own_nodes = _group_nodelist(env, group)
    this_node = env.get("SLURMD_NODENAME") or socket.gethostname()
    world = int(env.get("SLURM_NTASKS") or env.get(f"SLURM_NTASKS_HET_GROUP_{group}", "1"))
    nodes = max(1, len(own_nodes))
    return TaskPlacement(
        component=component,
        rank=int(env.get("SLURM_PROCID", "0")),
        local_rank=int(env.get("SLURM_LOCALID", "0")),
        world_size=world,
        local_world_size=max(1, world // nodes),
        node_rank=int(env.get("SLURM_NODEID", "0")),
        first_node=own_nodes[0] if own_nodes else this_node,
        capture_host=resolve_address(recipe, capture_nodes[0] if capture_nodes else this_node, local=False),
        bind_address=resolve_address(recipe, this_node, local=False),
    )


def _group_nodelist(env: Mapping[str, str], group: int) -> list[str]:
    value = env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{group}") or ""
    if not value and group == 0:
        value = env.get("SLURM_JOB_NODELIST", "")
    return expand_hostlist(value)


def local_placement(component: str, rank: int, world_size: int) -> TaskPlacement:
    """Placement of a task in ``--local`` mode: everything on this machine, on loopback."""
    return TaskPlacement(
        component=component,
        rank=rank,
        local_rank=rank,
        world_size=world_size,
        local_world_size=world_size,
        node_rank=0,
        first_node=LOOPBACK,
        capture_host=LOOPBACK,
        bind_address=LOOPBACK,
    )


def component_environment(
    recipe: Recipe,
    placement: TaskPlacement,
    job_dir: Path,
    recipe_path: Path,
    base_env: Mapping[str, str],
    requeue_count: int = 0,
) -> dict[str, str]:
    """The full environment of one component task: ``base_env`` minus rendezvous variables, plus
    the recipe's ``job.env`` and the contract variables. ``requeue_count`` tells a component that
    its job was requeued (the trainer then resumes from its run's latest checkpoint)."""
    env = {k: v for k, v in base_env.items() if k not in RENDEZVOUS_VARIABLES}
    env.update(recipe.job.env)
    if THREADS_VARIABLE not in env:
        # A task computes on the cores it is given (job.<component>.cpus_per_task), not torch's default
        # of every core of the machine: the tasks of one node, and two jobs that share a machine, would
        # otherwise run several threads per core and wait on each other (4 tiny builds at once on 2
        # cores took 7x their CPU time). job.env or the caller's environment may say otherwise.
        env[THREADS_VARIABLE] = str(getattr(recipe.job, placement.component).cpus_per_task)
    transport = recipe.transport
    env.update(
        {
            contracts.ENV_JOB_DIR: str(job_dir),
            contracts.ENV_RECIPE: str(recipe_path),
            contracts.ENV_COMPONENT: placement.component,
            contracts.ENV_TASK_RANK: str(placement.rank),
            contracts.ENV_REQUEUE_COUNT: str(requeue_count),
            contracts.ENV_BIND_ADDRESS: placement.bind_address,
            contracts.ENV_CAPTURE_HOST: placement.capture_host,
            contracts.ENV_MOONCAKE_MASTER: f"{placement.capture_host}:{transport.master_rpc_port}",
            contracts.ENV_MOONCAKE_METADATA: f"http://{placement.capture_host}:{transport.metadata_http_port}/metadata",
            contracts.ENV_MC_TCP_BIND_ADDRESS: placement.bind_address,
            contracts.ENV_MC_TRANSFER_TIMEOUT: str(transport.transfer_timeout_s),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if transport.protocol == "rdma" and transport.rdma_devices:
        env[contracts.ENV_RDMA_DEVICES] = ",".join(transport.rdma_devices)
    if placement.component == "trainer":
        env.update(
            {
                "RANK": str(placement.rank),
                "LOCAL_RANK": str(placement.local_rank),
                "WORLD_SIZE": str(placement.world_size),
                "LOCAL_WORLD_SIZE": str(placement.local_world_size),
                "NODE_RANK": str(placement.node_rank),
                "MASTER_ADDR": placement.first_node,
                "MASTER_PORT": str(recipe.job.master_port),
            }
        )
    return env


def current_environment() -> dict[str, str]:
    """A copy of this process's environment (one place that reads it)."""
    return dict(os.environ)
