"""Mooncake's HTTP metadata service, bound to one address.

Mooncake clients keep their segment descriptors in a key-value service reached over HTTP:
``GET|PUT|DELETE /metadata?key=K`` (200 with the stored bytes, 404 when absent). ``mooncake_master``
0.3.13 has this service built in, but it listens on every interface whatever
``--http_metadata_server_host`` says, and it accepts unauthenticated PUT and DELETE of descriptors:
anyone who can reach the node could rewrite where clients send sample bytes. So the master runs
with its built-in service off and this one runs next to it, bound to the recipe's bind address
(loopback in ``--local`` and tests).

    python3 -m runtime.transport.metadata_server --host 127.0.0.1 --port 18180
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from urllib.parse import parse_qs, urlsplit

METADATA_PATH = "/metadata"


class MetadataStore:
    """The key-value map behind the service (thread-safe)."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        """The stored value, or None."""
        with self._lock:
            return self._values.get(key)

    def put(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (replaces an older one)."""
        with self._lock:
            self._values[key] = value

    def delete(self, key: str) -> bool:
        """Remove ``key``; False when it was absent."""
        with self._lock:
            return self._values.pop(key, None) is not None


class _Handler(BaseHTTPRequestHandler):
    server: MetadataServer
    protocol_version = "HTTP/1.1"

    def _key(self) -> str | None:
        parts = urlsplit(self.path)
        if parts.path != METADATA_PATH:
            self._reply(HTTPStatus.NOT_FOUND, b"unknown path")
            return None
        key = (parse_qs(parts.query).get("key") or [""])[0].strip()
        if not key:
            self._reply(HTTPStatus.BAD_REQUEST, b"metadata key is required")
            return None
        return key

    def _reply(self, status: HTTPStatus, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        key = self._key()
        if key is None:
            return
        value = self.server.store.get(key)
        if value is None:
            self._reply(HTTPStatus.NOT_FOUND, b"metadata not found")
        else:
            self._reply(HTTPStatus.OK, value)

    def do_PUT(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        key = self._key()
        if key is None:
            return
        self.server.store.put(key, body)
        self._reply(HTTPStatus.OK, b"metadata updated")

    def do_DELETE(self) -> None:  # noqa: N802
        key = self._key()
        if key is None:
            return
        if self.server.store.delete(key):
            self._reply(HTTPStatus.OK, b"metadata deleted")
        else:
            self._reply(HTTPStatus.NOT_FOUND, b"metadata not found")

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # one line per request would flood the capture log


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` would listen on every interface (empty, the unspecified v4/v6 address)."""
    try:
        return not host or ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False  # a host name: resolved to one address by bind()


class MetadataServer(ThreadingHTTPServer):
    """The HTTP metadata service on ``host:port`` (never a wildcard address)."""

    daemon_threads = True

    def __init__(self, host: str, port: int) -> None:
        if is_wildcard(host):
            raise ValueError(
                f"metadata server host {host!r} would listen on every interface; give the node's "
                "routable address (transport.bind_address) or 127.0.0.1"
            )
        self.store = MetadataStore()
        super().__init__((host, port), _Handler)


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True, help="address to bind (the capture node's bind address)")
    parser.add_argument("--port", type=int, required=True, help="port (transport.metadata_http_port)")
    args = parser.parse_args(argv)
    try:
        server = MetadataServer(args.host, args.port)
    except OSError as exc:
        print(
            f"metadata server: cannot bind {args.host}:{args.port} ({exc.strerror or exc}); "
            "another process holds the port (transport.metadata_http_port) or the address is not this node's",
            file=sys.stderr,
        )
        return 1

    def _stop(signum: int, frame: FrameType | None) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    server.serve_forever(poll_interval=0.2)
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
