"""Lifecycle of ``mooncake_master``: start it from recipe values, wait until it answers, stop it.

Flags checked against ``mooncake_master --help`` of 0.3.13.post1: ``--rpc_port``, ``--rpc_address``,
``--enable_http_metadata_server``, ``--http_metadata_server_host``, ``--http_metadata_server_port``,
``--metrics_port``, ``--metrics_host``, ``--default_kv_lease_ttl`` (milliseconds or ``5m``-style),
``--eviction_high_watermark_ratio``, ``--client_ttl`` (seconds a silent client's segment stays
mounted). The built-in HTTP metadata server of this version listens on every interface whatever
``--http_metadata_server_host`` says (measured with ``ss -ltnp``) and takes unauthenticated PUT and
DELETE of segment descriptors, so it stays off: ``runtime.transport.metadata_server`` runs next to the
master, bound to the same address, and no etcd is needed. RPC and metrics servers bind ``host``.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from runtime.native_log import pump_native_output
from runtime.shared.lifecycle import die_with_parent
from runtime.transport.endpoints import Endpoints
from runtime.transport.errors import MasterStartError

log = logging.getLogger("dspark.transport.master")

MASTER_BINARY = "mooncake_master"


@dataclass(frozen=True)
class MasterSettings:
    """What ``mooncake_master`` is started with."""

    host: str
    """Address the RPC, metadata and metrics servers bind to (the capture node's routable IP)."""
    rpc_port: int
    metadata_http_port: int
    metrics_port: int
    kv_lease_ttl_s: int
    eviction_high_watermark_ratio: float
    client_ttl_s: int = 10
    binary: str = MASTER_BINARY
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    @property
    def endpoints_for_clients(self) -> Endpoints:
        """Endpoints a client on the master's node uses (bind address = master host)."""
        return Endpoints(
            master_address=f"{self.host}:{self.rpc_port}",
            metadata_url=f"http://{self.host}:{self.metadata_http_port}/metadata",
            bind_address=self.host,
        )

    def ports(self) -> dict[str, int]:
        """Each port with the recipe field that sets it."""
        return {
            "transport.master_rpc_port": self.rpc_port,
            "transport.metadata_http_port": self.metadata_http_port,
            "transport.metrics_port": self.metrics_port,
        }

    def command(self) -> list[str]:
        """The ``mooncake_master`` command line."""
        return [
            self.binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=false",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.kv_lease_ttl_s}s",
            f"--eviction_high_watermark_ratio={self.eviction_high_watermark_ratio:.6f}",
            f"--client_ttl={self.client_ttl_s}",
            *self.extra_args,
        ]

    def metadata_command(self) -> list[str]:
        """The command line of the HTTP metadata service that runs next to the master."""
        return [
            sys.executable,
            "-m",
            "runtime.transport.metadata_server",
            f"--host={self.host}",
            f"--port={self.metadata_http_port}",
        ]


def eviction_ratio(store_cap_bytes: int, global_segment_bytes: int) -> float:
    """The master's eviction high-watermark ratio: ``store_cap_bytes / global_segment_bytes``."""
    if global_segment_bytes <= 0:
        raise ValueError("transport.global_segment_bytes must be positive")
    ratio = store_cap_bytes / global_segment_bytes
    if not 0 < ratio <= 1:
        raise ValueError(
            f"eviction ratio transport.store_cap_bytes {store_cap_bytes} / transport.global_segment_bytes "
            f"{global_segment_bytes} = {ratio:.3f} is outside (0, 1]; make the store cap at most the segment"
        )
    return ratio


def port_in_use(host: str, port: int) -> bool:
    """Whether ``host:port`` cannot be bound right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _die_with_parent() -> None:
    # The master must not outlive the capture process that owns it: an orphan would hold the ports
    # and a stale, empty store across a restart. Or pass die_with_parent=False.
    die_with_parent(signal.SIGTERM)


class MasterProcess:
    """A running ``mooncake_master``; use as a context manager or call start/stop."""

    def __init__(self, settings: MasterSettings, log_path: Path | None = None, die_with_parent: bool = True) -> None:
        self.settings = settings
        self.log_path = log_path
        self.die_with_parent = die_with_parent
        self.process: subprocess.Popen[bytes] | None = None
        self.metadata_process: subprocess.Popen[bytes] | None = None
        self._log_file = None
        self._pump: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """Process id while running."""
        return self.process.pid if self.process else None

    def start(self, ready_timeout_s: float = 30.0) -> MasterProcess:
        """Start the master and wait until it answers; MasterStartError names the port on failure."""
        s = self.settings
        from runtime.transport.metadata_server import is_wildcard

        if is_wildcard(s.host):  # refused before anything listens, not after the master is up
            raise MasterStartError(
                f"mooncake_master host {s.host!r} would listen on every interface (its RPC, metrics and our metadata "
                "server); nothing was started. Fix: give the node's routable address (transport.bind_address, "
                "--host) or 127.0.0.1"
            )
        # A venv's console scripts sit next to its interpreter; `.venv/bin/python3 -m ...` without an
        # activated venv does not put them on PATH.
        beside_python = Path(sys.executable).parent / s.binary
        binary = str(beside_python) if beside_python.is_file() else shutil.which(s.binary)
        if binary is None:
            raise MasterStartError(
                f"{s.binary} is not on PATH; install the Mooncake wheel (pip install "
                "mooncake-transfer-engine-non-cuda==0.3.13.post1, or mooncake-transfer-engine on GPU nodes) "
                "into the environment the capture component runs in"
            )
        for name, port in s.ports().items():
            if port_in_use(s.host, port):
                raise MasterStartError(
                    f"cannot start mooncake_master: port {port} ({name}) on {s.host} is already in use. Another "
                    f"master (or another program) holds it; stop it (ss -ltnp 'sport = :{port}' shows the owner) or "
                    f"choose a free port for {name} in the recipe"
                )
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        command = [binary, *s.command()[1:]]
        log.info("starting mooncake_master: %s", " ".join(command))
        self.metadata_process = self._spawn(s.metadata_command())
        self.process = self._spawn(command, through_pipe=self._log_file is not None)
        if self._log_file is not None and self.process.stdout is not None:
            # without the WARNINGs every healthy master prints (glog's preamble, segment_already_exists)
            self._pump = pump_native_output(self.process.stdout, self._log_file)
        try:
            self.wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        log.info(
            "mooncake_master ready (pid %d) on %s rpc %d metadata %d metrics %d",
            self.process.pid,
            s.host,
            s.rpc_port,
            s.metadata_http_port,
            s.metrics_port,
        )
        return self

    def _spawn(self, command: list[str], through_pipe: bool = False) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            command,
            stdout=subprocess.PIPE if through_pipe else self._log_file or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if self.die_with_parent else None,
            # Its own process group: a SIGTERM to the component's group (local supervisor, srun)
            # must not stop the master before the component's clients unregister; the component
            # stops it last, and the parent-death signal covers a component that is killed.
            start_new_session=self.die_with_parent,
        )

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until the RPC port accepts, the metadata server answers and /health says ready."""
        deadline = time.monotonic() + timeout_s
        problem = "not started"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise MasterStartError(self._exit_message())
            if self.metadata_process is not None and self.metadata_process.poll() is not None:
                raise MasterStartError(
                    f"the metadata server (python3 -m runtime.transport.metadata_server) exited with code "
                    f"{self.metadata_process.returncode} while starting: {self.log_tail()}"
                )
            problem = self.check()
            if not problem:
                return
            time.sleep(0.1)
        raise MasterStartError(
            f"mooncake_master (pid {self.pid}) did not become ready within {timeout_s:.0f} s: {problem}; "
            f"see {self.log_path or 'its output'}"
        )

    def check(self) -> str:
        """Empty when the master answers on all three ports; else what does not."""
        s = self.settings
        try:
            with socket.create_connection((s.host, s.rpc_port), timeout=1.0):
                pass
        except OSError as exc:
            return f"RPC port {s.host}:{s.rpc_port} refuses connections ({exc.strerror or exc})"
        try:
            urllib.request.urlopen(f"http://{s.host}:{s.metadata_http_port}/metadata?key=dspark_probe", timeout=1.0)
        except urllib.error.HTTPError:
            pass  # 404: up
        except (urllib.error.URLError, OSError) as exc:
            return f"metadata server {s.host}:{s.metadata_http_port} does not answer ({exc})"
        try:
            with urllib.request.urlopen(f"http://{s.host}:{s.metrics_port}/health", timeout=1.0) as resp:
                health = json.loads(resp.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return f"metrics port {s.host}:{s.metrics_port} /health does not answer ({exc})"
        if not health.get("service_ready", False):
            return f"/health says not ready: {health}"
        return ""

    def _exit_message(self) -> str:
        s = self.settings
        code = self.process.returncode if self.process else None
        tail = self.log_tail()
        culprit = ""
        for name, port in s.ports().items():
            if f":{port}" in tail and ("in use" in tail or "Failed to start" in tail or "bind" in tail.lower()):
                culprit = f" Port {port} ({name}) on {s.host} could not be bound: another process holds it."
                break
        return (
            f"mooncake_master exited with code {code} while starting.{culprit} Last output:\n{tail}"
            if tail
            else f"mooncake_master exited with code {code} while starting.{culprit}"
        )

    def log_tail(self, max_chars: int = 2000) -> str:
        """The end of the master's log file (empty without one)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        if self._pump is not None and self.process is not None and self.process.poll() is not None:
            self._pump.join(timeout=2.0)  # an ended master's last lines are still on their way
        if self._log_file:
            self._log_file.flush()
        text = self.log_path.read_bytes()[-max_chars:].decode(errors="replace")
        return text

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the master's exit code."""
        code = None
        if self.metadata_process is not None and self.metadata_process.poll() is None:
            self.metadata_process.terminate()
            try:
                self.metadata_process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.metadata_process.kill()
                self.metadata_process.wait()
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning(
                        "mooncake_master (pid %d) ignored SIGTERM for %.0f s; killing it", self.process.pid, timeout_s
                    )
                    self.process.kill()
                    self.process.wait()
            code = self.process.returncode
        if self._pump is not None:
            self._pump.join(timeout=5.0)  # the master's last lines, up to its end of file
            self._pump = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    def kill(self) -> None:
        """SIGKILL at once, with its metadata server (fault tests: the store and its descriptors are gone)."""
        for process in (self.process, self.metadata_process):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()

    def __enter__(self) -> MasterProcess:
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
