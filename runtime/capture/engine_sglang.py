"""The SGLang capture engine: launches the patched ``sglang.launch_server`` for the target and asks
it to capture samples, which its server-side sink commits to the store (``sglang_sink``).

Torch-free on purpose: this side only renders a command, manages a process and speaks HTTP (stdlib
``urllib``), so the launcher and tests can import it anywhere. It implements
:class:`runtime.capture.engine.CaptureEngine`:

- ``start()`` refuses an SGLang that does not carry the recipe's patch target (the fix is
  ``tools/check_patch --apply``), launches the server with every ``capture.sglang`` setting, waits for
  ``/health`` with a timeout (reporting progress and, on failure, the tail of the server log), and
  checks through ``/server_info`` that the server runs the capture sink;
- ``capture(batch)`` sends one prefill-only ``/generate`` per sample and returns a ``SampleRef`` per
  receipt; transient failures are retried (a capture is an idempotent upsert), refusals are not;
- ``close()`` stops the server's whole process group (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from runtime.capture.engine import CaptureRequest, SampleRef
from runtime.capture.sglang_settings import SGLangServerSettings
from runtime.capture.sglang_wire import CaptureReceipt, CaptureTicket, WireError, encode_loss_mask, generate_body
from runtime.recipe.schema import SGLangSettings
from runtime.shared.lifecycle import die_with_parent

log = logging.getLogger("dspark.capture.sglang")

SERVER_MODULE = "sglang.launch_server"
PATCH_FIX = "tools/check_patch --apply"
PROGRESS_LOG_INTERVAL_S = 60.0
RETRYABLE_HTTP_STATUS = (502, 503, 504)
REPO_ROOT = Path(__file__).resolve().parents[2]


class SGLangEngineError(RuntimeError):
    """The SGLang server cannot be used; the message says why and what to do."""


class SGLangPatchError(SGLangEngineError):
    """The installed SGLang does not carry the recipe's capture patch."""


class SGLangCaptureError(SGLangEngineError):
    """One capture failed (refused by the server, or no usable answer)."""


# ----------------------------------------------------------------------------------------------
# the server command
# ----------------------------------------------------------------------------------------------


def server_arguments(
    server: SGLangServerSettings,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
) -> list[str]:
    """``sglang.launch_server`` arguments for every ``capture.sglang`` setting of ``server``.

    Flag names are those of SGLang 0.5.23's parser plus the patch's (checked by a test that parses
    this list with the patched parser). ``server.recipe_file`` is the resolved recipe the server's
    sink reads its store settings from; ``server.target_path`` the target folder.
    """
    s = server.sglang
    args = serving_arguments(s, model_path=server.target_path)
    # DSPARK aux capture on the target alone (no draft is loaded): the layer ids name layer outputs.
    args += ["--enable-return-aux-hidden-states", "--speculative-algorithm", "DSPARK"]
    args += ["--return-aux-hidden-state-layer-ids", *(str(i) for i in server.aux_layer_ids)]
    args += ["--dspark-capture-sink", s.capture_sink, "--dspark-capture-recipe", str(server.recipe_file)]
    if nnodes > 1:
        if not dist_init_addr:
            raise SGLangEngineError("a multi-node server needs dist_init_addr (the first capture node's host:port)")
        args += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]
    args += list(s.extra_args)
    return args


def serving_arguments(s: SGLangSettings, *, model_path: str | Path) -> list[str]:
    """The server's shape from ``capture.sglang`` (address, parallelism, memory, backends, expert
    offload) serving the target at ``model_path``, shared by the capture server and the eval's
    DSpark serving."""
    args = [
        "--model-path", str(model_path),
        "--host", s.host,
        "--port", str(s.port),
        "--tp-size", str(s.tp_size),
        "--mem-fraction-static", repr(s.mem_fraction_static),
        "--context-length", str(s.context_length),
        "--max-running-requests", str(s.max_running_requests),
        "--max-total-tokens", str(s.max_total_tokens),
        "--attention-backend", s.attention_backend,
        "--moe-runner-backend", s.moe_runner_backend,
        "--mamba-radix-cache-strategy", s.mamba_radix_cache_strategy,
        "--max-mamba-cache-size", str(s.max_mamba_cache_size),
        "--chunked-prefill-size", str(s.chunked_prefill_size),
    ]  # fmt: skip
    if s.device != "cuda":
        args += ["--device", s.device]
    if s.disable_cuda_graph:
        args += ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    if s.skip_tokenizer_init:
        args.append("--skip-tokenizer-init")
    if s.trust_remote_code:
        args.append("--trust-remote-code")
    if s.expert_offload == "paged_experts":
        args += ["--enable-paged-experts"]
        if s.paged_experts_num_resident is not None:
            args += ["--paged-experts-num-resident", str(s.paged_experts_num_resident)]
    elif s.expert_offload == "cpu_offload":
        args += ["--cpu-offload-gb", str(s.cpu_offload_gib_per_gpu)]
    return args


def server_command(
    server: SGLangServerSettings,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
) -> list[str]:
    """The full argv: ``python3 -m sglang.launch_server ...`` (``server.python``, else this interpreter)."""
    return [
        server.python or sys.executable,
        "-m",
        SERVER_MODULE,
        *server_arguments(
            server,
            nnodes=nnodes,
            node_rank=node_rank,
            dist_init_addr=dist_init_addr,
        ),
    ]


def _prepend_paths(env: dict[str, str], name: str, first: Sequence[str]) -> None:
    paths = [p for p in env.get(name, "").split(os.pathsep) if p]
    env[name] = os.pathsep.join([*first, *(p for p in paths if p not in first)])


def server_environment(
    base: Mapping[str, str] | None = None,
    *,
    library_dirs: Sequence[str | Path] = (),
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The server's environment: the component's (Mooncake endpoints, bind address) plus this
    repository on PYTHONPATH, so SGLang's scheduler processes can import the capture sink;
    ``library_dirs`` in front of LD_LIBRARY_PATH and ``extra`` (``capture.sglang.library_dirs`` and
    ``server_env``) for this process only."""
    env = dict(os.environ if base is None else base)
    env.update(extra or {})
    _prepend_paths(env, "PYTHONPATH", [str(REPO_ROOT)])
    if library_dirs:
        _prepend_paths(env, "LD_LIBRARY_PATH", [str(d) for d in library_dirs])
    return env


# ----------------------------------------------------------------------------------------------
# the server process and its log
# ----------------------------------------------------------------------------------------------


def log_tail(path: Path | None, lines: int) -> str:
    """The last ``lines`` lines of a log file (empty when there is none)."""
    if path is None or not path.exists():
        return ""
    with path.open("rb") as handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - 256 * 1024))
        text = handle.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


class ServerProcess:
    """``sglang.launch_server`` as a child process in its own session (it spawns one scheduler
    process per GPU; stopping the group stops them all), logging to a file."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str], log_path: Path) -> None:
        self.command = list(command)
        self.env = dict(env)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Launch the server (its output goes to ``log_path``)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            out.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} launching: {' '.join(self.command)}\n".encode())
            out.flush()
            # Its own session (stop() signals the whole group), and SIGTERM when this process dies: a
            # producer or test killed with SIGKILL must not leave a server (and its ports) behind.
            self.proc = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        log.info("SGLang server started (pid %d), log %s", self.proc.pid, self.log_path)

    @property
    def returncode(self) -> int | None:
        """Exit status once it has exited, else None."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float) -> None:
        """SIGTERM to the process group, SIGKILL after ``grace_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("SGLang server did not stop within %.0f s; killing its process group", grace_s)
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        # scheduler children outlive a parent that exited on SIGTERM without reaping them
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


# ----------------------------------------------------------------------------------------------
# HTTP
# ----------------------------------------------------------------------------------------------


class TransientHttpError(SGLangEngineError):
    """No answer, or an answer that says try again (connection refused or reset, HTTP 502/503/504)."""


class HttpRefusal(SGLangEngineError):
    """The server answered and refused (HTTP 4xx, or 5xx other than 502/503/504)."""

    def __init__(self, status: int, body: str) -> None:
        self.status = status
        self.body = body
        super().__init__(f"HTTP {status}: {body[:2000]}")


class RequestTimeout(SGLangEngineError):
    """The server took longer than the request timeout."""


def http_request(
    url: str, *, payload: Any | None = None, timeout_s: float, method: str | None = None
) -> tuple[int, bytes]:
    """One HTTP request; returns (status, body) for 2xx, raises the errors above otherwise."""
    data = None if payload is None else json.dumps(payload, separators=(",", ":")).encode()
    request = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"))
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        if exc.code in RETRYABLE_HTTP_STATUS:
            raise TransientHttpError(f"HTTP {exc.code} from {url}: {body[:500]}") from None
        raise HttpRefusal(exc.code, body) from None
    except TimeoutError:
        raise RequestTimeout(f"{url} did not answer within {timeout_s:.0f} s") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise RequestTimeout(f"{url} did not answer within {timeout_s:.0f} s") from None
        raise TransientHttpError(f"{url}: {exc.reason}") from None
    except (ConnectionError, OSError) as exc:
        raise TransientHttpError(f"{url}: {exc}") from None


def _find_key(tree: Any, key: str) -> Any:
    """The first value of ``key`` anywhere in a JSON tree (server_info nests some namespaces)."""
    if isinstance(tree, Mapping):
        if key in tree:
            return tree[key]
        values: Any = tree.values()
    elif isinstance(tree, list):
        values = tree
    else:
        return None
    for value in values:
        found = _find_key(value, key)
        if found is not None:
            return found
    return None


# ----------------------------------------------------------------------------------------------
# the engine
# ----------------------------------------------------------------------------------------------


def installed_patch_check(python: str | Path | None = None) -> Callable[[str], Any]:
    """The patch check of the SGLang that ``python`` (default: this interpreter) imports."""

    def check(target: str) -> Any:
        from runtime.shared.sglang_patch_check import check_installed

        return check_installed(target, python=python)

    return check


_default_patch_check = installed_patch_check()


class SGLangEngine:
    """Capture engine backed by the patched SGLang server (see the module docstring)."""

    name = "sglang"

    def __init__(
        self,
        server: SGLangServerSettings,
        *,
        log_path: Path | None = None,
        command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        launch: bool = True,
        base_url: str | None = None,
        nnodes: int | None = None,
        node_rank: int = 0,
        dist_init_host: str | None = None,
        patch_check: Callable[[str], Any] | None = _default_patch_check,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.server = server
        self.settings = server.sglang
        self.log_path = log_path or server.server_log_path
        self.nnodes = nnodes or server.nodes_per_engine  # several capture shares: one server per node
        self.node_rank = node_rank
        dist_init_addr = f"{dist_init_host}:{self.settings.dist_init_port}" if dist_init_host else None
        self.python = server.python
        self.command = list(command) if command is not None else server_command(
            server,
            nnodes=self.nnodes,
            node_rank=node_rank,
            dist_init_addr=dist_init_addr,
        )  # fmt: skip
        self.env = server_environment(env, library_dirs=server.library_dirs, extra=self.settings.server_env)
        self.launch = launch
        self.base_url = (base_url or f"http://{self.settings.host}:{self.settings.port}").rstrip("/")
        if patch_check is _default_patch_check and self.python is not None:
            patch_check = installed_patch_check(self.python)  # the server's interpreter, not ours
        self.patch_check = patch_check
        self.sleep = sleep
        self.process: ServerProcess | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Check the patch, launch the server, wait until it is healthy and runs the sink."""
        self.check_patch()
        if self.launch:
            self.process = ServerProcess(self.command, self.env, self.log_path)
            self.process.start()
        if self.node_rank > 0:
            return  # a follower node serves no HTTP; node 0's server drives it
        self.wait_until_healthy()
        self.check_server_runs_sink()

    def check_patch(self) -> None:
        """Refuse an SGLang without the recipe's patch target (runs before anything is launched)."""
        if self.patch_check is None:
            return
        target = self.settings.patch_target
        report = self.patch_check(target)
        for notice in getattr(report, "notices", []):
            log.warning("%s", notice)
        if not report.ok:
            raise SGLangPatchError(
                f"the installed SGLang cannot capture for this recipe (capture.sglang.patch_target: {target}):\n"
                f"{report.render()}\nfix: {PATCH_FIX}"
                + (f" --target {target}" if target else "")
                + " on the capture node (in the environment the job activates), then submit again"
            )

    def wait_until_healthy(self) -> float:
        """Poll ``/health`` until it answers 200; returns the seconds it took. Fails (with the log
        tail) when the server exits or ``health_timeout_s`` passes."""
        s = self.settings
        start = time.monotonic()
        last_report = start
        last_problem = "no answer yet"
        url = f"{self.base_url}/health"
        while True:
            self._raise_if_exited("while starting")
            try:
                status, _ = http_request(url, timeout_s=min(30.0, s.health_poll_interval_s * 4))
                if status == 200:
                    elapsed = time.monotonic() - start
                    log.info("SGLang server healthy after %.0f s at %s", elapsed, self.base_url)
                    return elapsed
            except (TransientHttpError, RequestTimeout, HttpRefusal) as exc:
                last_problem = str(exc)
            now = time.monotonic()
            elapsed = now - start
            if elapsed >= s.health_timeout_s:
                raise SGLangEngineError(
                    f"the SGLang server at {self.base_url} was not healthy after {elapsed:.0f} s "
                    f"(capture.sglang.health_timeout_s = {s.health_timeout_s:g}); last answer: {last_problem}"
                    + self._tail_message()
                )
            if now - last_report >= PROGRESS_LOG_INTERVAL_S:
                last_report = now
                log.info(
                    "waiting for SGLang health at %s: %.0f s of %.0f s (%s); last log line: %s",
                    url, elapsed, s.health_timeout_s, last_problem, log_tail(self.log_path, 1) or "-",
                )  # fmt: skip
            self.sleep(s.health_poll_interval_s)

    def check_server_runs_sink(self) -> None:
        """``/server_info`` must show the patch's ``dspark_capture_sink`` as the recipe sets it."""
        status, body = http_request(f"{self.base_url}/server_info", timeout_s=60.0)
        info = json.loads(body or b"{}")
        sink = _find_key(info, "dspark_capture_sink")
        if sink != self.settings.capture_sink:
            raise SGLangPatchError(
                f"the server at {self.base_url} reports dspark_capture_sink={sink!r}, the recipe needs "
                f"{self.settings.capture_sink!r}: it is not the patched SGLang this engine launched (another "
                f"server on port {self.settings.port}?) or it runs without the patch; fix: {PATCH_FIX}"
            )

    def check_health(self) -> None:
        """Raise with a useful message when the server cannot serve."""
        self._raise_if_exited("")
        try:
            http_request(f"{self.base_url}/health", timeout_s=30.0)
        except SGLangEngineError as exc:
            raise SGLangEngineError(f"the SGLang server at {self.base_url} is not healthy: {exc}") from None

    def wait(self) -> int:
        """Block until the launched server exits (a follower node's whole job); its exit status."""
        if self.process is None or self.process.proc is None:
            raise SGLangEngineError("no server was launched by this engine")
        return self.process.proc.wait()

    def close(self) -> None:
        """Stop the server this engine launched (nothing for an attached server)."""
        if self.process is not None:
            self.process.stop(self.settings.shutdown_timeout_s)
            self.process = None

    # -- capture --------------------------------------------------------------------------------

    def ticket(self, request: CaptureRequest) -> CaptureTicket:
        """The ``dspark_capture`` ticket of one request."""
        return CaptureTicket(
            g=request.g,
            epoch=request.epoch,
            row_index=request.row_index,
            row_id=request.row_id,
            loss_mask=encode_loss_mask(request.loss_mask),
            store_id=self.server.store_id,
            aux_layer_ids=self.server.aux_layer_ids,
            hidden_size=self.server.hidden_size,
        )

    def capture(self, batch: list[CaptureRequest]) -> list[SampleRef]:
        """Capture every request (one prefill each, in order); the server's sink commits them."""
        return [self.capture_one(request) for request in batch]

    def capture_one(self, request: CaptureRequest) -> SampleRef:
        """One sample: POST the prefill-only request, check the receipt."""
        try:
            body = generate_body(self.ticket(request), request.input_ids)
        except WireError as exc:
            raise SGLangCaptureError(f"sample g={request.g} (row {request.row_id}): {exc}") from None
        started = time.monotonic()
        answer = self._post_with_retries("/generate", body, what=f"capture of sample g={request.g}")
        try:
            receipt = CaptureReceipt.from_response(json.loads(answer))
        except (WireError, json.JSONDecodeError) as exc:
            raise SGLangCaptureError(f"capture of sample g={request.g}: {exc}") from None
        if receipt.status == "error":
            raise SGLangCaptureError(f"the server's capture sink refused sample g={request.g}: {receipt.error}")
        if receipt.g != request.g:
            raise SGLangCaptureError(
                f"asked to capture sample g={request.g}, the server answered for g={receipt.g}: responses mixed up"
            )
        if receipt.num_tokens != len(request.input_ids):
            raise SGLangCaptureError(
                f"sample g={request.g}: sent {len(request.input_ids)} tokens, the server captured {receipt.num_tokens}"
            )
        log.debug("sample g=%d: %s in %.2f s", request.g, receipt.status, time.monotonic() - started)
        meta = {**receipt.raw, "wall_s": round(time.monotonic() - started, 3)}
        return SampleRef(g=request.g, num_tokens=receipt.num_tokens, bytes_written=receipt.bytes_written, meta=meta)

    # -- internals ------------------------------------------------------------------------------

    def _post_with_retries(self, path: str, payload: Mapping[str, Any], what: str) -> bytes:
        s = self.settings
        url = f"{self.base_url}{path}"
        delay = s.retry_backoff_s
        for attempt in range(s.request_retries + 1):
            self._raise_if_exited(f"during the {what}")
            try:
                _, body = http_request(url, payload=payload, timeout_s=s.request_timeout_s)
                return body
            except HttpRefusal as exc:
                raise SGLangCaptureError(f"the server refused the {what}: {exc}") from None
            except RequestTimeout:
                raise SGLangCaptureError(
                    f"the {what} took longer than capture.sglang.request_timeout_s = {s.request_timeout_s:g} s "
                    "(not retried: the server may still be working on it)" + self._tail_message()
                ) from None
            except TransientHttpError as exc:
                if attempt == s.request_retries:
                    raise SGLangCaptureError(
                        f"the {what} failed {attempt + 1} times; last error: {exc}" + self._tail_message()
                    ) from None
                log.warning(
                    "%s failed (%s); retry %d of %d in %.0f s", what, exc, attempt + 1, s.request_retries, delay
                )
                self.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def _raise_if_exited(self, when: str) -> None:
        if self.process is None:
            return
        code = self.process.returncode
        if code is not None:
            raise SGLangEngineError(
                f"the SGLang server exited with status {code} {when}".rstrip() + self._tail_message()
            )

    def _tail_message(self) -> str:
        tail = log_tail(self.log_path, self.settings.log_tail_lines) if self.process is not None else ""
        return f"\nlast lines of {self.log_path}:\n{tail}" if tail else ""
