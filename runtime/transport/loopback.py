"""A data plane on 127.0.0.1 for tests and tools: a resolved recipe with given ports, a master, the env.

Other components' integration tests use this too, so that a real ``mooncake_master`` is one
context manager away::

    resolved = loopback_recipe(tmp_path, ports=(free_port(), free_port(), free_port()))
    with loopback_master(resolved):
        producer = open_producer(transport_of(resolved), resolved.job_dir, endpoints=loopback_endpoints(resolved))
"""

from __future__ import annotations

import contextlib
import os
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
from runtime.transport.master import MasterProcess
from runtime.transport.settings import TransportSettings

LOOPBACK = "127.0.0.1"


# Where free_port looks when several test processes run at once (pytest-xdist): "LO-HI", inclusive.
# Each process gets its own range below the kernel's ephemeral range (32768-60999 by default), so one
# process never hands out a port another just took, and no outgoing connection's port lands in it.
ENV_PORT_RANGE = "DSPARK_PORT_RANGE"
_next_in_range: dict[tuple[int, int], int] = {}


def port_range() -> tuple[int, int] | None:
    """The bounds of ``DSPARK_PORT_RANGE`` (LOW-HIGH), or None when it is not set."""
    text = os.environ.get(ENV_PORT_RANGE, "").strip()
    if not text:
        return None
    low, _, high = text.partition("-")
    try:
        bounds = int(low), int(high)
    except ValueError:
        raise ValueError(f"{ENV_PORT_RANGE}={text!r}: write LOW-HIGH, e.g. 20000-21499") from None
    if not 1024 <= bounds[0] <= bounds[1] <= 65535:
        raise ValueError(f"{ENV_PORT_RANGE}={text!r}: LOW-HIGH with 1024 <= LOW <= HIGH <= 65535")
    return bounds


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (the one helper tests and benchmarks use).

    Without ``DSPARK_PORT_RANGE`` the kernel picks one. With it, ports come from that range in turn,
    from an offset of this process's own (skipping any that cannot be bound), so successive calls in
    one process never repeat a port until the range wraps around."""
    bounds = port_range()
    if bounds is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOOPBACK, 0))
            return int(sock.getsockname()[1])
    low, high = bounds
    span = high - low + 1
    # A child process inherits the range but not this process's place in it: start each process at its
    # own offset, so a child's first ports are not the ones its parent handed out first.
    start = _next_in_range.get(bounds, low + (os.getpid() * 97) % span)
    for offset in range(span):
        port = low + (start - low + offset) % span
        if _bindable(port):
            _next_in_range[bounds] = low + (port - low + 1) % span
            return port
    raise OSError(f"no free port in {ENV_PORT_RANGE}={low}-{high} on {LOOPBACK}")


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


def transport_of(resolved: ResolvedRecipe) -> TransportSettings:
    """The transport's settings of a resolved recipe, for tests and tools (a process entry builds
    them once in its setup)."""
    return TransportSettings.from_recipe(resolved.recipe)


def loopback_endpoints(resolved: ResolvedRecipe) -> Endpoints:
    """The endpoints of the master :func:`loopback_master` starts, for a client on this machine."""
    return Endpoints.loopback(transport_of(resolved).ports)


def loopback_env(resolved: ResolvedRecipe) -> dict[str, str]:
    """The launcher's environment contract for a component on this machine."""
    settings = transport_of(resolved)
    endpoints = Endpoints.loopback(settings.ports)
    return {
        ENV_MOONCAKE_MASTER: endpoints.master_address,
        ENV_MOONCAKE_METADATA: endpoints.metadata_url,
        ENV_BIND_ADDRESS: LOOPBACK,
        ENV_CAPTURE_HOST: LOOPBACK,
        ENV_MC_TCP_BIND_ADDRESS: LOOPBACK,
        ENV_MC_TRANSFER_TIMEOUT: str(settings.client_template.transfer_timeout_s),
    }


@contextlib.contextmanager
def loopback_master(resolved: ResolvedRecipe, log_path: Path | None = None) -> Iterator[MasterProcess]:
    """A running ``mooncake_master`` on 127.0.0.1 with the recipe's ports and limits."""
    settings = transport_of(resolved).master(LOOPBACK)
    master = MasterProcess(settings, log_path or resolved.job_dir / "mooncake_master.log")
    master.start()
    try:
        yield master
    finally:
        master.stop()
