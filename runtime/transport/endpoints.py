"""Where the Mooncake master and metadata server are, and which address this process binds to.

The launcher gives every component these through the environment (the one place the runtime reads
them); tests and tools pass an :class:`Endpoints` explicitly instead.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from runtime.files import atomic_write_text
from runtime.shared.contracts import ENV_BIND_ADDRESS, ENV_CAPTURE_HOST, ENV_MOONCAKE_MASTER, ENV_MOONCAKE_METADATA

ENDPOINTS_FILE = Path("transport") / "endpoints.json"
"""In the job folder: where the job's Mooncake master and metadata server answer, written by the
process that starts the master, so that a look from outside the job (``python3 -m runtime.transport
status --job DIR`` on the login node) finds them without the job's environment."""


@dataclass(frozen=True)
class MasterPorts:
    """The master's ports a client needs (``transport.master_rpc_port``, ``transport.metadata_http_port``)."""

    rpc_port: int
    metadata_http_port: int


@dataclass(frozen=True)
class Endpoints:
    """Addresses one Mooncake client needs."""

    master_address: str
    """``host:rpc_port`` of ``mooncake_master``."""
    metadata_url: str
    """``http://host:port/metadata`` of the master's HTTP metadata server."""
    bind_address: str
    """This node's routable address (``MC_TCP_BIND_ADDRESS``, Mooncake's local hostname)."""

    @property
    def master_host(self) -> str:
        """Host part of :attr:`master_address`."""
        return self.master_address.rsplit(":", 1)[0]

    @property
    def master_rpc_port(self) -> int:
        """Port part of :attr:`master_address`."""
        return int(self.master_address.rsplit(":", 1)[1])

    @classmethod
    def on_host(cls, ports: MasterPorts, master_host: str, bind_address: str) -> Endpoints:
        """Endpoints of a master on ``master_host`` with ``ports``."""
        return cls(
            master_address=f"{master_host}:{ports.rpc_port}",
            metadata_url=f"http://{master_host}:{ports.metadata_http_port}/metadata",
            bind_address=bind_address,
        )

    @classmethod
    def loopback(cls, ports: MasterPorts) -> Endpoints:
        """Everything on 127.0.0.1 (``--local`` mode and tests)."""
        return cls.on_host(ports, "127.0.0.1", "127.0.0.1")

    @classmethod
    def from_env(cls, ports: MasterPorts, bind_address: str, env: Mapping[str, str] | None = None) -> Endpoints:
        """Endpoints from the launcher's environment contract.

        ``DSPARK_MOONCAKE_MASTER`` / ``DSPARK_MOONCAKE_METADATA`` win; without them the master is
        assumed on ``DSPARK_CAPTURE_HOST`` with ``ports``. ``DSPARK_BIND_ADDRESS`` is required unless
        ``bind_address`` (``transport.bind_address`` as an explicit IP, '' for ``auto``) is given.
        """
        env = os.environ if env is None else env
        bind = env.get(ENV_BIND_ADDRESS) or bind_address
        if not bind:
            raise ValueError(
                f"{ENV_BIND_ADDRESS} is not set and transport.bind_address is 'auto': this process does not "
                "know which address to bind Mooncake to. The launcher sets it (the node's routable IP, "
                "127.0.0.1 with --local); when running by hand, export DSPARK_BIND_ADDRESS=<this node's IP>"
            )
        host = env.get(ENV_CAPTURE_HOST, "")
        master = env.get(ENV_MOONCAKE_MASTER) or (f"{host}:{ports.rpc_port}" if host else "")
        metadata = env.get(ENV_MOONCAKE_METADATA) or (
            f"http://{host}:{ports.metadata_http_port}/metadata" if host else ""
        )
        if not master or not metadata:
            raise ValueError(
                f"{ENV_MOONCAKE_MASTER} / {ENV_MOONCAKE_METADATA} are not set and neither is {ENV_CAPTURE_HOST}: this process "
                "cannot find the Mooncake master. The launcher sets them; when running by hand, export "
                f"{ENV_MOONCAKE_MASTER}=<capture host>:{ports.rpc_port} and "
                f"{ENV_MOONCAKE_METADATA}=http://<capture host>:{ports.metadata_http_port}/metadata"
            )
        if ":" not in master or not master.rsplit(":", 1)[1].isdigit():
            raise ValueError(
                f"{ENV_MOONCAKE_MASTER}={master!r} is not host:port; fix: set it to <capture host>:<rpc port>"
            )
        return cls(master_address=master, metadata_url=metadata, bind_address=bind)


def record_endpoints(job_dir: Path, endpoints: Endpoints, recorder: str = "capture") -> Path:
    """Write the master's and the metadata server's addresses into ``job_dir`` (:data:`ENDPOINTS_FILE`),
    with who wrote them (``recorder``: ``capture``, whose producer beats with this pid and host, or
    ``master`` run by hand), so that a look from outside can tell this job's store from a later job's
    on the same ports."""
    target = job_dir / ENDPOINTS_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "master_address": endpoints.master_address,
        "metadata_url": endpoints.metadata_url,
        "recorder": recorder,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started_at": time.time(),
    }
    atomic_write_text(target, json.dumps(record, indent=2) + "\n")
    return target


def mark_endpoints_ended(job_dir: Path) -> None:
    """Record in :data:`ENDPOINTS_FILE` that the process that recorded it has stopped its part of the data
    plane (the master with it): a look from outside then says the job has ended, at once."""
    record = endpoints_record(job_dir)
    if record is not None:
        record["ended_at"] = time.time()
        atomic_write_text(job_dir / ENDPOINTS_FILE, json.dumps(record, indent=2) + "\n")


def endpoints_record(job_dir: Path) -> dict[str, object] | None:
    """The record :func:`record_endpoints` wrote in ``job_dir``, None when there is none readable."""
    try:
        record = json.loads((job_dir / ENDPOINTS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def endpoints_of_job(job_dir: Path, bind_address: str = "") -> Endpoints:
    """The endpoints a job's master recorded (:func:`record_endpoints`), for a client on this machine:
    it binds to ``bind_address``, else to the address this machine routes to the master with.
    ValueError, naming the file, when the job has not recorded them (its capture never started)."""
    path = job_dir / ENDPOINTS_FILE
    try:
        record = json.loads(path.read_text())
        master, metadata = str(record["master_address"]), str(record["metadata_url"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path} is missing or unreadable ({exc}): the job's capture has not started its Mooncake master "
            "(or the job predates this file); run the command inside the job instead, with its environment"
        ) from exc
    host = master.rsplit(":", 1)[0]
    return Endpoints(master_address=master, metadata_url=metadata, bind_address=bind_address or route_address(host))


def route_address(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP socket's local end after connect():
    no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return str(probe.getsockname()[0])
