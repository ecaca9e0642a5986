"""Where the Mooncake master and metadata server are, and which address this process binds to.

The launcher gives every component these through the environment (the one place the runtime reads
them); tests and tools pass an :class:`Endpoints` explicitly instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from runtime.shared.contracts import ENV_BIND_ADDRESS, ENV_CAPTURE_HOST, ENV_MOONCAKE_MASTER, ENV_MOONCAKE_METADATA


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
