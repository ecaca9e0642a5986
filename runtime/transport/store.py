"""The Mooncake store client: setup, zero-copy tensor put/get, retries, clear errors.

Facts about ``mooncake-transfer-engine`` 0.3.13.post1 this module is built on (checked on loopback):
- ``put`` of an existing key returns 0 and keeps the OLD value; ``upsert`` replaces it. Everything
  here writes with ``upsert`` so a re-capture is an idempotent upsert.
- A get grants the reader a lease of ``--default_kv_lease_ttl``; a plain ``remove`` of a leased key
  fails with OBJECT_HAS_LEASE (-706) until it expires, so deletions use ``force=True``.
- A put into a full segment (or with no segment mounted at all) returns NO_AVAILABLE_HANDLE (-200)
  at once; while the segment's owner is dead but not yet expired by the master (``--client_ttl``)
  transfers fail with TRANSFER_FAIL (-800); while the master is down, RPC_FAIL (-900).
- ``get`` returns ``b''`` for a missing key AND for an unreachable master, so this module reads small
  objects with ``get_size`` + ``get_into`` whose return codes tell the two apart.
- ``setup`` against an unreachable master retries internally for about 90 s; this module first
  waits for the master's RPC port and metadata server itself, so the error comes fast and names them.
- Buffers need not be registered for TCP transfers (measured: same bandwidth either way), while
  registering a NEW buffer costs up to ~20 ms; RDMA needs registration. So transfer buffers are
  registered for RDMA only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from runtime.native_log import healthy_setup_line, held_native_output, initialise_glog
from runtime.shared.contracts import ENV_MC_TCP_BIND_ADDRESS, ENV_MC_TRANSFER_TIMEOUT
from runtime.transport.endpoints import Endpoints
from runtime.transport.errors import (
    EXPECTED_RETRY_CODES,
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
    TRANSIENT_CODES,
    StoreFullError,
    StoreOperationError,
    StoreSetupError,
    TransportError,
    code_name,
)
from runtime.transport.sample_format import byte_view
from runtime.transport.settings import ClientSettings

log = logging.getLogger("dspark.transport.store")

SCRATCH_MIN_BYTES = 1 << 16


def master_answers(endpoints: Endpoints, timeout_s: float = 1.0) -> str:
    """Empty when the master's RPC port accepts and its metadata server answers; else what failed."""
    try:
        with socket.create_connection((endpoints.master_host, endpoints.master_rpc_port), timeout=timeout_s):
            pass
    except OSError as exc:
        return f"RPC port {endpoints.master_address} does not accept connections ({exc.strerror or exc})"
    try:
        urllib.request.urlopen(f"{endpoints.metadata_url}?key=dspark_probe", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        pass  # 404 for an unknown key: the server is up
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"metadata server {endpoints.metadata_url} does not answer ({reason})"
    return ""


def wait_for_master(endpoints: Endpoints, timeout_s: float, log_interval_s: float = 10.0) -> None:
    """Block until the master answers; raise StoreSetupError naming what did not answer."""
    start = time.monotonic()
    last_log = start
    while True:
        problem = master_answers(endpoints)
        if not problem:
            return
        now = time.monotonic()
        if now - start >= timeout_s:
            raise StoreSetupError(
                f"Mooncake master not reachable after {timeout_s:.0f} s (transport.connect_timeout_s): {problem}. "
                "Check that the capture component started the master (its log says 'mooncake_master ready'), "
                "that DSPARK_MOONCAKE_MASTER / DSPARK_MOONCAKE_METADATA name the capture node's routable address, "
                "and that no firewall blocks the ports"
            )
        if now - last_log >= log_interval_s:
            log.info("waiting for the Mooncake master (%.0f s so far): %s", now - start, problem)
            last_log = now
        time.sleep(0.25)


def check_bind_address(address: str, name: str, settings: ClientSettings) -> None:
    """Raise StoreSetupError unless ``address`` belongs to this node.

    Mooncake accepts any address at setup and publishes it; peers then fail to reach this client
    much later with transfer errors. Binding a socket to it is the cheap early test.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
    except OSError as exc:
        raise StoreSetupError(
            f"{name}: bind address {address} is not an address of this node ({exc.strerror or exc}; "
            f"{settings.describe()}). Set DSPARK_BIND_ADDRESS / transport.bind_address to this node's routable "
            "IP (hostname -I lists them), never a container bridge address"
        ) from None


class StoreClient:
    """One Mooncake store client with typed, checked, retried operations."""

    def __init__(self, settings: ClientSettings, name: str = "client") -> None:
        self.settings = settings
        self.name = name
        self._store: Any = None
        # Native calls run on several threads (sample reads, heartbeat reads, the deadline threads of
        # a stop). Mooncake's close frees what a call on another thread still uses (a segfault seen in
        # CI), so close waits for the last call in flight (see _native and close).
        self._native_lock = threading.Lock()
        self._calls_in_flight = 0
        self._close_deferred: Any = None
        self._scratch: torch.Tensor | None = None
        self._scratch_lock = threading.Lock()
        self._write_config: Any = None  # ReplicateConfig naming the segment writes go to
        self._segment_configs: dict[str, Any] = {}  # for single puts placed elsewhere (put_bytes)
        self.hostname = ""
        self.setup_s = 0.0

    # -- lifecycle --------------------------------------------------------------------------

    def connect(self, quiet: bool = False) -> StoreClient:
        """Wait for the master, then set the client up (segment, local buffer, transport).

        The library's lines during setup are held: a failed setup writes them all to fd 2, a healthy one
        only those a healthy start does not always print (``quiet``: none, for a command whose stderr is
        the operator's console)."""
        initialise_glog()  # before the library's first line: no "Logging before InitGoogleLogging()" WARNING
        from mooncake.store import MooncakeDistributedStore

        s = self.settings
        check_bind_address(s.endpoints.bind_address, self.name, s)
        wait_for_master(s.endpoints, s.connect_timeout_s)
        # Mooncake's transfer engine reads these at setup; they follow the recipe and the endpoints
        # (the launcher exports the same values; explicit endpoints in tests must win).
        os.environ[ENV_MC_TCP_BIND_ADDRESS] = s.endpoints.bind_address
        os.environ[ENV_MC_TRANSFER_TIMEOUT] = str(s.transfer_timeout_s)
        if s.protocol == "rdma" and not s.rdma_devices:
            raise StoreSetupError(
                f"{self.name}: transport.protocol is rdma but transport.rdma_devices is empty ({s.describe()}); "
                "list the HCA names (ibv_devices shows them, e.g. mlx5_0) or use protocol tcp"
            )
        with held_native_output((lambda line: True) if quiet else healthy_setup_line) as held:
            store = MooncakeDistributedStore()
            start = time.monotonic()
            rc = store.setup(
                s.endpoints.bind_address,
                s.endpoints.metadata_url,
                int(s.segment_bytes),
                int(s.local_buffer_bytes),
                s.protocol,
                ",".join(s.rdma_devices),
                s.endpoints.master_address,
            )
            self.setup_s = time.monotonic() - start
            held.healthy = rc == 0
        if rc != 0:
            hint = (
                "the RDMA devices exist and are up (ibv_devinfo)"
                if s.protocol == "rdma"
                else f"{s.endpoints.bind_address} is an address of this node (MC_TCP_BIND_ADDRESS / DSPARK_BIND_ADDRESS)"
            )
            raise StoreSetupError(
                f"{self.name}: Mooncake client setup failed with code {rc} ({s.describe()}, segment "
                f"{s.segment_bytes} bytes, local buffer {s.local_buffer_bytes} bytes). Check that {hint}, "
                "and that the segment fits in this node's free memory"
            )
        self._store = store
        self.hostname = store.get_hostname()
        if s.segment_bytes and s.pin_writes_to_own_segment:
            self.prefer_segment(self.hostname)  # keep this client's writes in its own segment
        log.info("%s: Mooncake client up as %s in %.2f s (%s)", self.name, self.hostname, self.setup_s, s.describe())
        return self

    def prefer_segment(self, segment: str) -> None:
        """Place this client's writes in ``segment`` (a Mooncake segment name, the owner's ``ip:port``).

        Without it Mooncake picks any mounted segment with room, and trainer rank 0's small control
        segment is one of them.
        """
        from mooncake.store import ReplicateConfig

        if self._write_config is not None and self._write_config.preferred_segment == segment:
            return
        config = ReplicateConfig()
        config.preferred_segment = segment
        self._write_config = config
        log.info("%s: writes go to segment %s", self.name, segment)

    @property
    def preferred_segment(self) -> str:
        """Where this client's writes go ('' when Mooncake chooses)."""
        return self._write_config.preferred_segment if self._write_config is not None else ""

    @property
    def raw(self) -> Any:
        """The underlying ``MooncakeDistributedStore`` (benchmarks only)."""
        if self._store is None:
            raise TransportError(f"{self.name}: store client used before connect() or after close()")
        return self._store

    def close(self) -> None:
        """Release the client (its segment leaves the store).

        With calls still in flight on other threads (a read stuck on a stopped master, given up by its
        caller) the client is closed by the last of them when it returns, never under it; a call made
        after close raises.
        """
        with self._native_lock:
            store, self._store = self._store, None
            if store is not None and self._calls_in_flight:
                self._close_deferred = store
                log.info(
                    "%s: %d store call(s) still in flight; the client closes when they return",
                    self.name,
                    self._calls_in_flight,
                )
                return
        if store is not None:
            store.close()

    @contextlib.contextmanager
    def _native(self) -> Iterator[Any]:
        """The native store for one call, counted in flight so that :meth:`close` never frees it under
        the call."""
        with self._native_lock:
            if self._store is None:
                raise TransportError(f"{self.name}: store client used before connect() or after close()")
            self._calls_in_flight += 1
            store = self._store
        try:
            yield store
        finally:
            with self._native_lock:
                self._calls_in_flight -= 1
                deferred = self._close_deferred if self._calls_in_flight == 0 else None
                if deferred is not None:
                    self._close_deferred = None
            if deferred is not None:
                deferred.close()

    def _invoke(self, method: str, *args: Any) -> Any:
        """One native call, ``store.<method>(*args)``, counted in flight (see :meth:`_native`)."""
        with self._native() as store:
            return getattr(store, method)(*args)

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- tensors ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def registered(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """Register the tensors' memory for the duration of a transfer (RDMA only; TCP needs none)."""
        done: list[int] = []
        if self.settings.protocol != "rdma":
            yield
            return
        try:
            for tensor in tensors:
                ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
                if size == 0 or ptr in done:
                    continue
                rc = self._invoke("register_buffer", ptr, size)
                if rc != 0:
                    raise TransportError(f"{self.name}: register_buffer of {size} bytes failed: {code_name(rc)}")
                done.append(ptr)
            yield
        finally:
            for ptr in done:
                self._invoke("unregister_buffer", ptr)

    def put_tensors(self, keys: Sequence[str], tensors: Sequence[torch.Tensor], what: str = "") -> None:
        """Upsert contiguous host tensors under ``keys`` in one batch call, with retries."""
        views = [byte_view(t) for t in tensors]
        for key, view in zip(keys, views, strict=True):
            if view.numel() == 0:
                raise ValueError(f"{key}: refusing to store an empty tensor (Mooncake rejects zero-size objects)")
        pending = list(range(len(keys)))
        with self.registered(views):
            for attempt in range(self.settings.max_retries + 1):
                codes = self._call_batch(
                    "batch_upsert_from",
                    [keys[i] for i in pending],
                    [views[i].data_ptr() for i in pending],
                    [views[i].numel() for i in pending],
                )
                failed = [(i, c) for i, c in zip(pending, codes, strict=True) if c != 0]
                if not failed:
                    return
                self._raise_if_permanent("put", [(keys[i], c) for i, c in failed], what)
                if attempt == self.settings.max_retries:
                    break
                if attempt >= 1 and any(c == TRANSFER_FAIL for _, c in failed):
                    # A replica in the segment of a dead client blocks the upsert until the master
                    # expires it; dropping the stale object lets the retry allocate afresh.
                    self.remove([keys[i] for i, c in failed if c == TRANSFER_FAIL])
                pending = [i for i, _ in failed]
                self._backoff(attempt, "put", [(keys[i], c) for i, c in failed])
        codes_seen = {c for _, c in failed}
        detail = ", ".join(f"{keys[i]}: {code_name(c)}" for i, c in failed)
        if codes_seen == {NO_AVAILABLE_HANDLE}:
            raise StoreFullError(
                f"{self.name}: no room in the store for {what or 'the objects'} after {self.settings.max_retries} "
                f"retries ({detail}). Either no segment is mounted (the producer that owns it died) or the segment "
                "is full: check that trainer ranks delete consumed samples and that transport.high_watermark_bytes "
                "is below transport.store_cap_bytes"
            )
        raise TransportError(f"{self.name}: put of {what or 'objects'} failed after retries: {detail}")

    def get_into_tensors(self, keys: Sequence[str], tensors: Sequence[torch.Tensor], what: str = "") -> list[int]:
        """Read objects straight into contiguous host tensors of the exact size.

        Returns one code per key: 0 when read, OBJECT_NOT_FOUND when the key is absent. Transient
        failures are retried; a size mismatch or a permanent error raises.
        """
        views = [byte_view(t) for t in tensors]
        status = [1] * len(keys)  # 1: pending
        with self.registered(views):
            for attempt in range(self.settings.max_retries + 1):
                pending = [i for i, s in enumerate(status) if s == 1]
                codes = self._call_batch(
                    "batch_get_into",
                    [keys[i] for i in pending],
                    [views[i].data_ptr() for i in pending],
                    [views[i].numel() for i in pending],
                )
                failed = []
                for i, code in zip(pending, codes, strict=True):
                    if code == views[i].numel():
                        status[i] = 0
                    elif code == OBJECT_NOT_FOUND:
                        status[i] = OBJECT_NOT_FOUND
                    elif code >= 0:
                        raise TransportError(
                            f"{self.name}: {keys[i]} holds {code} bytes, expected {views[i].numel()} ({what})"
                        )
                    else:
                        failed.append((keys[i], code))
                if not failed:
                    return status
                self._raise_if_permanent("get", failed, what)
                if attempt < self.settings.max_retries:
                    self._backoff(attempt, "get", failed)
        detail = ", ".join(f"{k}: {code_name(c)}" for k, c in failed)
        raise TransportError(f"{self.name}: get of {what or 'objects'} failed after retries: {detail}")

    # -- small objects ----------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, *, segment: str = "", max_retries: int | None = None) -> None:
        """Upsert a small object (cursor, heartbeat, meta) through the local buffer.

        ``segment``: place this one object in that segment instead of where this client's writes
        usually go (the producer's heartbeat goes to trainer rank 0's). Mooncake treats it as a
        preference: a segment that is not mounted (any more) is passed over silently, and an
        upsert of an object of the same size keeps the old replica where it is (remove it first
        to move it). ``max_retries`` overrides ``transport.max_retries`` for this call.
        """
        config = self._config_for(segment) if segment else self._write_config
        retries = self.settings.max_retries if max_retries is None else max_retries
        for attempt in range(retries + 1):
            rc = self._invoke("upsert", key, data, config) if config is not None else self._invoke("upsert", key, data)
            if rc == 0:
                return
            self._raise_if_permanent("put", [(key, rc)], key)
            if attempt < retries:
                self._backoff(attempt, "put", [(key, rc)])
        raise StoreOperationError(
            f"{self.name}: put of {key} failed after {retries} retries: {code_name(rc)}", frozenset({rc})
        )

    def _config_for(self, segment: str) -> Any:
        """A ReplicateConfig naming ``segment`` (kept: the heartbeat asks for the same one every beat)."""
        from mooncake.store import ReplicateConfig

        if self._write_config is not None and self._write_config.preferred_segment == segment:
            return self._write_config
        cached = self._segment_configs.get(segment)
        if cached is None:
            cached = ReplicateConfig()
            cached.preferred_segment = segment
            self._segment_configs = {segment: cached}  # one at a time: rank 0's segment changes rarely
        return cached

    def segment_of(self, key: str) -> str:
        """The segment holding ``key``'s first replica (``ip:port`` of its owner; '' when absent).

        One metadata call to the master (no transfer): the replica descriptor's transport endpoint,
        which is the owning client's segment name (``get_hostname()``). The producer checks with it
        that its heartbeat landed in trainer rank 0's segment.
        """
        replicas = self._invoke("get_replica_desc", key)
        if not replicas:
            return ""
        return str(replicas[0].get_memory_descriptor().buffer_descriptor.transport_endpoint)

    def get_bytes(self, key: str) -> bytes | None:
        """A small object's bytes, or None when the key is absent."""
        with self._scratch_lock:
            for attempt in range(self.settings.max_retries + 1):
                size = self._invoke("get_size", key)
                if size == OBJECT_NOT_FOUND:
                    return None
                if size >= 0:
                    scratch = self._scratch_of(size)
                    rc = self._invoke("get_into", key, scratch.data_ptr(), scratch.numel())
                    if rc == OBJECT_NOT_FOUND:
                        return None
                    if rc >= 0:
                        return bytes(scratch[:rc].numpy())
                else:
                    rc = size
                # -600 here: the object grew between get_size and get_into (a heartbeat upsert); retry.
                if rc != -600:
                    self._raise_if_permanent("get", [(key, rc)], key)
                if attempt < self.settings.max_retries:
                    self._backoff(attempt, "get", [(key, rc)])
        raise TransportError(f"{self.name}: get of {key} failed after retries: {code_name(rc)}")

    def _scratch_of(self, size: int) -> torch.Tensor:
        if self._scratch is None or self._scratch.numel() < size:
            if self._scratch is not None:
                self._invoke("unregister_buffer", self._scratch.data_ptr())
            self._scratch = torch.empty(max(SCRATCH_MIN_BYTES, 2 * size), dtype=torch.uint8)
            self._invoke("register_buffer", self._scratch.data_ptr(), self._scratch.numel())
        return self._scratch

    # -- keys -------------------------------------------------------------------------------

    def exist(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key exists, in one call (retried while the master is unreachable)."""
        if not keys:
            return []
        for attempt in range(self.settings.max_retries + 1):
            codes = self._invoke("batch_is_exist", list(keys))
            if all(c in (0, 1) for c in codes):
                return [c == 1 for c in codes]
            if attempt < self.settings.max_retries:
                self._backoff(attempt, "exist", [(k, c) for k, c in zip(keys, codes, strict=True) if c not in (0, 1)])
        raise TransportError(f"{self.name}: existence check of {len(keys)} keys failed (master unreachable?)")

    def exist_once(self, keys: Sequence[str]) -> list[bool] | None:
        """Like :meth:`exist` without retries: None when the store cannot answer right now."""
        codes = self._invoke("batch_is_exist", list(keys))
        if all(c in (0, 1) for c in codes):
            return [c == 1 for c in codes]
        return None

    def remove(self, keys: Sequence[str]) -> int:
        """Force-remove keys (leases included); absent keys are fine. Returns how many were removed."""
        if not keys:
            return 0
        removed = 0
        pending = list(keys)
        for attempt in range(self.settings.max_retries + 1):
            codes = self._invoke("batch_remove", pending, True)
            failed = []
            for key, code in zip(pending, codes, strict=True):
                if code == 0:
                    removed += 1
                elif code != OBJECT_NOT_FOUND:
                    failed.append((key, code))
            if not failed:
                return removed
            pending = [k for k, _ in failed]
            if attempt < self.settings.max_retries:
                self._backoff(attempt, "remove", failed)
        raise TransportError(
            f"{self.name}: remove failed after retries: " + ", ".join(f"{k}: {code_name(c)}" for k, c in failed)
        )

    # -- helpers ----------------------------------------------------------------------------

    def _call_batch(self, method: str, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        if method == "batch_upsert_from" and self._write_config is not None:
            return list(self._invoke(method, keys, ptrs, sizes, self._write_config))
        return list(self._invoke(method, keys, ptrs, sizes))

    def _raise_if_permanent(self, op: str, failures: list[tuple[str, int]], what: str) -> None:
        permanent = [(k, c) for k, c in failures if c not in TRANSIENT_CODES]
        if permanent:
            detail = ", ".join(f"{k}: {code_name(c)}" for k, c in permanent)
            raise TransportError(f"{self.name}: {op} of {what or 'objects'} failed: {detail}")

    def _backoff(self, attempt: int, op: str, failures: list[tuple[str, int]]) -> None:
        delay = self.settings.retry_backoff_s * (2**attempt)
        first_key, first_code = failures[0]
        # A replica still being written (-703) is the normal race of a reader behind a writer:
        # debug until the last retries, so a healthy run's log stays quiet.
        expected = all(code in EXPECTED_RETRY_CODES for _, code in failures)
        level = logging.DEBUG if expected and attempt + 2 < self.settings.max_retries else logging.WARNING
        log.log(
            level,
            "%s: %s of %d object(s) failed (%s: %s); retry %d/%d in %.1f s",
            self.name,
            op,
            len(failures),
            first_key,
            code_name(first_code),
            attempt + 1,
            self.settings.max_retries,
            delay,
        )
        time.sleep(delay)
