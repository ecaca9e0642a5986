"""The transport's settings, derived once from the recipe: each component takes its own typed part.

Producer, Consumer, the window, the store client, the master and the endpoints never see the
recipe; :meth:`TransportSettings.from_recipe` is the one place in the room that reads it for them.
The settings of the components whose modules need torch live here (this module stays torch-free,
so the master's command line starts without it); ``WindowLimits``, ``MasterSettings`` and
``Endpoints`` live with their light components.
The doors that load a resolved recipe (``dataplane.py``, ``loopback.py``, ``__main__.py``,
``synthetic.py``) call it and hand each component its part. What varies per process (the endpoints,
the segment a client mounts, the master's host) is filled in by :meth:`TransportSettings.client`,
:meth:`TransportSettings.master` and :meth:`TransportSettings.endpoints_from_env`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from runtime.recipe.capture_layout import capture_shares, nodes_per_engine
from runtime.recipe.schema import Recipe
from runtime.recipe.sizes import segment_shares
from runtime.transport.endpoints import Endpoints, MasterPorts
from runtime.transport.master import MasterSettings, eviction_ratio
from runtime.transport.window import WindowLimits


@dataclass(frozen=True)
class ProducerSettings:
    """The settings of a :class:`~runtime.transport.producer.Producer`."""

    store_id: str
    """Key prefix of this run in the store."""
    poll_interval_s: float
    """Pause between looks at the store while nothing can be captured."""
    wait_log_interval_s: float
    """Interval of the 'producer idle' and progress lines."""
    heartbeat_interval_s: float
    """Interval of the heartbeat thread's beats."""
    window: WindowLimits
    """The watermarks and the head of the window."""


@dataclass(frozen=True)
class ConsumerSettings:
    """The settings of a trainer rank's :class:`~runtime.transport.consumer.Consumer`."""

    store_id: str
    """Key prefix of this run in the store."""
    world_size: int
    """Trainer ranks (``job.trainer.nodes`` x ``tasks_per_node``)."""
    global_batch_size: int
    """G: samples of one optimizer step, over all ranks (the cursor moves by G)."""
    micro_batch_size: int
    gradient_accumulation_steps: int
    idle_timeout_s: float
    """Longest wait for one sample (and for the store to take the cursor)."""
    poll_interval_s: float
    """Pause between looks for a sample."""
    wait_log_interval_s: float
    """Interval of the 'waiting' lines."""
    heartbeat_interval_s: float
    """The producers' beat interval (the heartbeat is read at it while waiting)."""
    verify_checksums: bool
    """Check every field's CRC-32 / sum16 after reading it."""
    corrupt_read_retries: int
    """Reads of a corrupt sample again before failing (at least 1)."""
    capture_shares: int
    """Producers of the capture component; the one of share ``g % capture_shares`` captures g."""


@dataclass(frozen=True)
class ClientSettings:
    """Everything one Mooncake client (:class:`~runtime.transport.store.StoreClient`) needs."""

    endpoints: Endpoints
    protocol: str = "tcp"
    rdma_devices: tuple[str, ...] = ()
    segment_bytes: int = 0
    """Global segment this client contributes (the producer's; 0 for readers)."""
    pin_writes_to_own_segment: bool = True
    """Keep this client's writes in its own segment (when it has one). False lets Mooncake put each
    object in any mounted segment with room (a sample segment split over two nodes)."""
    local_buffer_bytes: int = 64 << 20
    transfer_timeout_s: int = 300
    max_retries: int = 5
    retry_backoff_s: float = 0.5
    connect_timeout_s: float = 300.0
    """How long to wait for the master to answer before setup."""

    def describe(self) -> str:
        """Address, ports and protocol, for error messages."""
        e = self.endpoints
        devices = f" devices {','.join(self.rdma_devices)}" if self.rdma_devices else ""
        return (
            f"master {e.master_address}, metadata {e.metadata_url}, local address {e.bind_address}, "
            f"protocol {self.protocol}{devices}"
        )


_NO_ENDPOINTS = Endpoints(master_address="", metadata_url="", bind_address="")
"""Stands in for the endpoints in the stored client settings; :meth:`TransportSettings.client`
replaces it (the endpoints are the process's, not the recipe's)."""


@dataclass(frozen=True)
class TransportSettings:
    """Every transport component's settings from one recipe."""

    store_id: str
    """Key prefix of this run in the store."""
    producer: ProducerSettings
    consumer: ConsumerSettings
    ports: MasterPorts
    """The master's RPC and metadata ports (what a client needs to find it)."""
    bind_address: str
    """``transport.bind_address`` as an explicit address; '' for ``auto`` (the launcher's env says)."""
    segment_placement: str
    """``transport.segment_placement``: capture, trainer or split."""
    capture_segment_bytes: int
    """The capture node's share of the sample segment (the producer mounts it)."""
    trainer_segment_bytes: int
    """The trainer node's share of the sample segment (trainer rank 0 mounts it)."""
    nodes_per_engine: int
    """Capture nodes one engine spans (one producer per engine)."""
    producer_may_start_at_zero: bool
    """A fresh run (no checkpoint) whose samples can be put before trainer rank 0 mounts its segment:
    a producer that finds no cursor anywhere starts at g=0 instead of waiting for one."""
    client_template: ClientSettings
    """The recipe's client settings; :meth:`client` adds the endpoints and the segment."""
    master_template: MasterSettings
    """The recipe's master settings; :meth:`master` adds the host."""

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> TransportSettings:
        """Read the recipe's ``transport`` section (and the trainer's batch shape) once."""
        tr, trainer = recipe.transport, recipe.trainer
        capture_bytes, trainer_bytes = segment_shares(tr.global_segment_bytes, tr.segment_placement)
        window = WindowLimits(
            high_samples=tr.high_watermark_samples,
            low_samples=tr.low_watermark_samples,
            high_bytes=tr.high_watermark_bytes,
            low_bytes=tr.low_watermark_bytes,
            head_samples=trainer.global_batch_size,
        )
        return cls(
            store_id=recipe.store_id,
            producer=ProducerSettings(
                store_id=recipe.store_id,
                poll_interval_s=tr.poll_interval_s,
                wait_log_interval_s=tr.wait_log_interval_s,
                heartbeat_interval_s=tr.heartbeat_interval_s,
                window=window,
            ),
            consumer=ConsumerSettings(
                store_id=recipe.store_id,
                world_size=recipe.trainer_world_size,
                global_batch_size=trainer.global_batch_size,
                micro_batch_size=trainer.micro_batch_size,
                gradient_accumulation_steps=trainer.gradient_accumulation_steps,
                idle_timeout_s=tr.idle_timeout_s,
                poll_interval_s=tr.poll_interval_s,
                wait_log_interval_s=tr.wait_log_interval_s,
                heartbeat_interval_s=tr.heartbeat_interval_s,
                verify_checksums=tr.verify_checksums,
                corrupt_read_retries=max(1, tr.max_retries),
                capture_shares=capture_shares(recipe),
            ),
            ports=MasterPorts(rpc_port=tr.master_rpc_port, metadata_http_port=tr.metadata_http_port),
            bind_address=tr.bind_address if tr.bind_address != "auto" else "",
            segment_placement=tr.segment_placement,
            capture_segment_bytes=capture_bytes,
            trainer_segment_bytes=trainer_bytes,
            nodes_per_engine=nodes_per_engine(recipe),
            # With the whole sample segment on the trainer node nothing can be put before trainer
            # rank 0 has mounted it: the producer waits for its cursor, published after mounting.
            producer_may_start_at_zero=trainer.checkpoint.resume_from is None and tr.segment_placement != "trainer",
            client_template=ClientSettings(
                endpoints=_NO_ENDPOINTS,
                protocol=tr.protocol,
                rdma_devices=tuple(tr.rdma_devices),
                local_buffer_bytes=tr.local_buffer_bytes,
                transfer_timeout_s=tr.transfer_timeout_s,
                max_retries=tr.max_retries,
                retry_backoff_s=tr.retry_backoff_s,
                connect_timeout_s=tr.connect_timeout_s,
            ),
            master_template=MasterSettings(
                # A placeholder that :meth:`master` replaces; loopback if it were ever used as is.
                host="127.0.0.1",
                rpc_port=tr.master_rpc_port,
                metadata_http_port=tr.metadata_http_port,
                metrics_port=tr.metrics_port,
                kv_lease_ttl_s=tr.kv_lease_ttl_s,
                eviction_high_watermark_ratio=eviction_ratio(tr.store_cap_bytes, tr.global_segment_bytes),
                client_ttl_s=tr.client_ttl_s,
            ),
        )

    @property
    def capture_shares(self) -> int:
        """Producers of the capture component; share ``k`` captures the g with ``g % shares == k``."""
        return self.consumer.capture_shares

    def client(self, endpoints: Endpoints, segment_bytes: int) -> ClientSettings:
        """Settings of a store client at ``endpoints`` that mounts ``segment_bytes`` (0: none)."""
        return dataclasses.replace(self.client_template, endpoints=endpoints, segment_bytes=segment_bytes)

    def master(self, host: str) -> MasterSettings:
        """Settings of a ``mooncake_master`` bound to ``host``."""
        return dataclasses.replace(self.master_template, host=host)

    def endpoints_from_env(self, env: Mapping[str, str] | None = None) -> Endpoints:
        """Endpoints from the launcher's environment contract (see :meth:`Endpoints.from_env`)."""
        return Endpoints.from_env(self.ports, self.bind_address, env)
