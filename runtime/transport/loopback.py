"""A data plane on 127.0.0.1 for tests and tools: a resolved recipe with given ports, a master, the env.

Other components' integration tests use this too, so that a real ``mooncake_master`` is one
context manager away::

    resolved = loopback_recipe(tmp_path, ports=(free_port(), free_port(), free_port()))
    with loopback_master(resolved):
        producer = open_producer(resolved, endpoints=Endpoints.loopback(resolved.recipe))
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

from runtime.recipe.loader import ResolvedRecipe, load_recipe, load_resolved, write_resolved
from runtime.shared.contracts import (
    ENV_BIND_ADDRESS,
    ENV_CAPTURE_HOST,
    ENV_MC_TCP_BIND_ADDRESS,
    ENV_MC_TRANSFER_TIMEOUT,
    ENV_MOONCAKE_MASTER,
    ENV_MOONCAKE_METADATA,
)
from runtime.transport.endpoints import Endpoints
from runtime.transport.master import MasterProcess, MasterSettings

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (the one helper tests and benchmarks use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def loopback_recipe(
    job_dir: Path,
    ports: tuple[int, int, int],
    overrides: list[str] | None = None,
    recipe_path: Path | None = None,
) -> ResolvedRecipe:
    """Resolve ``recipe_path`` (default ``recipes/tiny.yaml``) into ``job_dir`` with the master's
    RPC, metadata and metrics ports set to ``ports`` and every address on loopback."""
    repo_root = Path(__file__).resolve().parents[2]
    path = recipe_path or repo_root / "recipes" / "tiny.yaml"
    rpc, metadata, metrics = ports
    sets = [
        f"transport.master_rpc_port={rpc}",
        f"transport.metadata_http_port={metadata}",
        f"transport.metrics_port={metrics}",
        f"transport.bind_address={LOOPBACK}",
        *(overrides or []),
    ]
    loaded = load_recipe(path, sets)
    return load_resolved(write_resolved(loaded, job_dir, repo_root))


def loopback_env(resolved: ResolvedRecipe) -> dict[str, str]:
    """The launcher's environment contract for a component on this machine."""
    endpoints = Endpoints.loopback(resolved.recipe)
    return {
        ENV_MOONCAKE_MASTER: endpoints.master_address,
        ENV_MOONCAKE_METADATA: endpoints.metadata_url,
        ENV_BIND_ADDRESS: LOOPBACK,
        ENV_CAPTURE_HOST: LOOPBACK,
        ENV_MC_TCP_BIND_ADDRESS: LOOPBACK,
        ENV_MC_TRANSFER_TIMEOUT: str(resolved.recipe.transport.transfer_timeout_s),
    }


@contextlib.contextmanager
def loopback_master(resolved: ResolvedRecipe, log_path: Path | None = None) -> Iterator[MasterProcess]:
    """A running ``mooncake_master`` on 127.0.0.1 with the recipe's ports and limits."""
    settings = MasterSettings.from_recipe(resolved.recipe, LOOPBACK)
    master = MasterProcess(settings, log_path or resolved.job_dir / "mooncake_master.log")
    master.start()
    try:
        yield master
    finally:
        master.stop()
