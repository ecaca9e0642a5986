"""Errors of the data plane and the names of Mooncake's return codes.

Mooncake's Python client reports failures as negative integers (``mooncake-store``'s ``ErrorCode``);
this module turns them into names and into exceptions whose messages say what to check.
"""

from __future__ import annotations

MOONCAKE_ERROR_NAMES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -708: "OBJECT_HAS_REPLICATION_TASK",
    -710: "REPLICA_NOT_FOUND",
    -712: "REPLICA_IS_GONE",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
}

OBJECT_NOT_FOUND = -704
NO_AVAILABLE_HANDLE = -200
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901

# Codes worth a retry with backoff: the master or the segment owner may be restarting, a replica
# may still be in flight, or (NO_AVAILABLE_HANDLE) consumers may free space in a moment.
# RPC_TIMEOUT (-901) is what every call returns while the master is stopped or unreachable.
TRANSIENT_CODES: frozenset[int] = frozenset({-1, -10, -200, -703, -707, -712, -800, -900, -901, -1010})
EXPECTED_RETRY_CODES: frozenset[int] = frozenset({-703})
"""Transient codes that a healthy run meets (a reader behind a writer): retried quietly."""


def code_name(code: int) -> str:
    """``-704`` -> ``OBJECT_NOT_FOUND (-704)``."""
    return f"{MOONCAKE_ERROR_NAMES.get(code, 'UNKNOWN')} ({code})"


class TransportError(RuntimeError):
    """A data-plane operation failed for good (after its retries)."""


class StoreOperationError(TransportError):
    """A store operation still failed after its retries; ``codes`` are Mooncake's return codes."""

    def __init__(self, message: str, codes: frozenset[int]) -> None:
        super().__init__(message)
        self.codes = codes


class StoreSetupError(TransportError):
    """The Mooncake client could not connect; the message names address, port and protocol."""


class StoreFullError(TransportError):
    """A put found no room in the store (NO_AVAILABLE_HANDLE after every retry)."""


class IdleTimeoutError(TransportError):
    """A trainer rank waited ``transport.idle_timeout_s`` for one sample."""


class CorruptSampleError(TransportError):
    """A sample's bytes do not match the sizes or checksums its ``meta`` records."""


class MasterStartError(RuntimeError):
    """``mooncake_master`` could not start (a port is taken, the binary is missing, it exited)."""
