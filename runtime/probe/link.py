"""The probe's measurement of the capture-to-trainer link: Mooncake gets across the two nodes.

Capture rank 0 (:func:`serve_link_objects`) starts a ``mooncake_master`` at the recipe's ports on
its own address (the endpoint the trainer is handed), puts a few objects into its client's own
segment and waits until trainer rank 0 says it has read them. Trainer rank 0
(:func:`link_get_gbps`) joins that store as a client that mounts nothing and reads each object
into host memory: the bytes cross the link with the recipe's transport protocol, as samples do.
The rate is what a Mooncake transfer reaches, so the plan takes it with no efficiency factor.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from runtime.recipe.fit.slurm_request import PROBE_EVICTION_WATERMARK, PROBE_LINK_OBJECTS, probe_segment_bytes
from runtime.transport.endpoints import Endpoints
from runtime.transport.master import MasterProcess
from runtime.transport.settings import TransportSettings
from runtime.transport.store import StoreClient

LINK_KEY_PREFIX = "dspark-probe-link"
DONE_KEY = f"{LINK_KEY_PREFIX}/done"
"""Trainer rank 0 puts this key once it has read every object (or given up): the capture may stop."""
OBJECTS = PROBE_LINK_OBJECTS
"""Objects put and read; the first read pays for fresh allocations and is not counted."""
POLL_S = 0.2
MIB = 2**20


PATTERN_PERIOD = 251
"""The object's bytes repeat 0..250: not constant (a read of the wrong bytes or offset shows), and built
from one period, so making a 1 GiB object costs 1 GiB (an int64 ``arange`` of it took 16 GiB and had
the node's OOM killer end the probe)."""


def _pattern(object_bytes: int) -> torch.Tensor:
    """The bytes of every object (see :data:`PATTERN_PERIOD`)."""
    period = torch.arange(PATTERN_PERIOD, dtype=torch.int16).to(torch.uint8)
    return period.repeat(-(-object_bytes // PATTERN_PERIOD))[:object_bytes].contiguous()


def serve_link_objects(
    transport: TransportSettings, bind_address: str, object_bytes: int, log_dir: Path, timeout_s: float
) -> str:
    """Capture rank 0: serve :data:`OBJECTS` objects of ``object_bytes`` from a master on ``bind_address``
    until trainer rank 0 has read them or ``timeout_s`` has passed; returns what happened, in words."""
    # The recipe's eviction watermark is sized for its samples, not for these objects; the segment holds
    # them below the probe's own watermark, so the master never evicts one before it is read.
    master_settings = dataclasses.replace(
        transport.master(bind_address), eviction_high_watermark_ratio=PROBE_EVICTION_WATERMARK
    )
    endpoints = Endpoints.on_host(transport.ports, bind_address, bind_address)
    client_settings = transport.client(endpoints, segment_bytes=probe_segment_bytes(OBJECTS, object_bytes))
    source = _pattern(object_bytes)
    with (
        MasterProcess(master_settings, log_dir / "probe_link_mooncake_master.log"),
        StoreClient(client_settings, name="probe link (capture)").connect() as client,  # after the master is up
    ):
        keys = [f"{LINK_KEY_PREFIX}/{index}" for index in range(OBJECTS)]
        for key in keys:
            client.put_tensors([key], [source], what="a probe link object")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = client.exist_once([DONE_KEY])
            if found and found[0]:
                return f"served {OBJECTS} objects of {object_bytes / MIB:,.0f} MiB; trainer rank 0 has read them"
            time.sleep(POLL_S)
    return f"served {OBJECTS} objects for {timeout_s:.0f} s; trainer rank 0 never said it had read them"


def link_get_gbps(
    transport: TransportSettings, env: Mapping[str, str], object_bytes: int, timeout_s: float
) -> tuple[float, str]:
    """Trainer rank 0: GB/s of Mooncake gets of the capture's objects (median of all but the first),
    with how it was measured."""
    endpoints = transport.endpoints_from_env(env)
    # The capture starts its master after the route check: the client's connect waits for it.
    settings = dataclasses.replace(transport.client(endpoints, segment_bytes=0), connect_timeout_s=timeout_s)
    deadline = time.monotonic() + timeout_s
    client = StoreClient(settings, name="probe link (trainer)").connect()
    try:
        keys = [f"{LINK_KEY_PREFIX}/{index}" for index in range(OBJECTS)]
        while not all(client.exist_once(keys) or [False]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the capture's probe objects did not appear within {timeout_s:.0f} s")
            time.sleep(POLL_S)
        want = _pattern(object_bytes)
        target = torch.empty(object_bytes, dtype=torch.uint8)
        took_s: list[float] = []
        for key in keys:
            target.zero_()
            start = time.perf_counter()
            client.get_into_tensors([key], [target], what="a probe link object")
            took_s.append(time.perf_counter() - start)
            if not bool(torch.equal(target, want)):
                raise RuntimeError(f"the bytes read back of {key} differ from those the capture put")
    finally:
        try:
            client.put_bytes(DONE_KEY, b"1")
        finally:
            client.close()
    rate = object_bytes / statistics.median(took_s[1:]) / 1e9
    return rate, (
        f"{OBJECTS - 1} objects of {object_bytes / MIB:,.0f} MiB read by trainer rank 0 from the capture node's "
        f"segment through mooncake_master at {endpoints.master_address} ({settings.protocol}, local address "
        f"{endpoints.bind_address}): {rate:.2f} GB/s ({rate * 8:.1f} Gbit/s), median; a Mooncake transfer, so "
        "the plan takes it with link_efficiency 1"
    )
