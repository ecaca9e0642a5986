"""The SGLang capture engine (runtime/capture/engine_sglang.py): the rendered K3 server command
(golden, and parsed by the real patched 0.5.23 argument parser), and an HTTP test double standing
in for the server -- its /generate runs the real capture sink -- for health waiting, retries,
timeouts, refusals, process handling, and one capture end to end into a real Mooncake store."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.capture.engine import CaptureRequest
from runtime.capture.engine_sglang import (
    SGLangCaptureError,
    SGLangEngine,
    SGLangEngineError,
    SGLangPatchError,
    server_arguments,
    server_environment,
)
from runtime.capture.setup import sglang_server_settings
from runtime.capture.sglang_settings import SGLangServerSettings
from runtime.capture.sglang_sink import capture_from_sglang, close_sinks
from runtime.recipe.loader import ResolvedRecipe, load_recipe, write_resolved
from runtime.recipe.schema import Recipe
from runtime.transport.loopback import free_port, loopback_endpoints, transport_of
from tests.test_sglang_server import require_capture_venv

REPO = Path(__file__).resolve().parent.parent
K3_GOLDEN = [
    "--model-path", "/models/kimi-k3",
    "--host", "127.0.0.1",
    "--port", "30000",
    "--tp-size", "8",
    "--mem-fraction-static", "0.76",
    "--context-length", "66048",
    "--max-running-requests", "1",
    "--max-total-tokens", "66048",
    "--attention-backend", "trtllm_mla",
    "--moe-runner-backend", "marlin",
    "--mamba-radix-cache-strategy", "extra_buffer",
    "--max-mamba-cache-size", "5",
    "--chunked-prefill-size", "-1",
    "--cuda-graph-backend-decode", "disabled",
    "--cuda-graph-backend-prefill", "disabled",
    "--skip-tokenizer-init",
    "--trust-remote-code",
    "--enable-return-aux-hidden-states",
    "--speculative-algorithm", "DSPARK",
    "--return-aux-hidden-state-layer-ids", "7", "23", "51", "67", "83",
    "--dspark-capture-sink", "mooncake",
    "--dspark-capture-recipe", "/jobs/kimi_k3_v1c/recipe.resolved.json",
]  # fmt: skip


def _k3():
    return load_recipe(REPO / "recipes" / "kimi_k3_v1c.yaml").recipe


def _server_of(recipe: Recipe, recipe_file: str, model_path: str | None = None) -> SGLangServerSettings:
    """The server settings of an in-memory recipe, as its job folder's ``recipe_file`` would give them."""
    resolved = ResolvedRecipe(recipe, "", Path(recipe_file), REPO, "", False, [])
    server = sglang_server_settings(resolved)
    return server if model_path is None else replace(server, target_path=Path(model_path))


# ----------------------------------------------------------------------------------------------
# the rendered command
# ----------------------------------------------------------------------------------------------


def test_k3_server_command_golden() -> None:
    args = server_arguments(_server_of(_k3(), "/jobs/kimi_k3_v1c/recipe.resolved.json", "/models/kimi-k3"))
    assert args == K3_GOLDEN


def test_multi_node_offload_and_extra_arguments() -> None:
    recipe = load_recipe(
        REPO / "recipes" / "kimi_k3_v1c.yaml",
        [
            "job.capture.nodes=2",
            "capture.sglang.tp_size=16",
            "capture.sglang.expert_offload=cpu_offload",
            "capture.sglang.cpu_offload_gib_per_gpu=40",
            "capture.sglang.extra_args=[--log-level, debug]",
        ],
    ).recipe
    args = server_arguments(_server_of(recipe, "r.json"), nnodes=2, node_rank=1, dist_init_addr="node1:20000")
    assert args[args.index("--tp-size") + 1] == "16"
    assert args[args.index("--cpu-offload-gb") + 1] == "40"
    assert args[-8:] == ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "node1:20000", "--log-level", "debug"]
    with pytest.raises(SGLangEngineError, match="needs dist_init_addr"):
        server_arguments(_server_of(recipe, "r.json"), nnodes=2)


def test_server_environment_puts_the_repository_on_pythonpath() -> None:
    env = server_environment({"PYTHONPATH": "/elsewhere", "DSPARK_MOONCAKE_MASTER": "10.0.0.1:50051"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/elsewhere"]
    assert env["DSPARK_MOONCAKE_MASTER"] == "10.0.0.1:50051"


def _patched_full_tree() -> Path:
    """The whole 0.5.23 ``sglang/`` tree with the patch applied, built once per patch version."""
    from runtime.sglang_patching.pinned_wheel import fetch_wheel
    from runtime.sglang_patching.tree import check_tree
    from runtime.shared.sglang_patch_check import RECORD_NAME
    from runtime.shared.sglang_patch_manifest import load_manifest

    target = load_manifest().resolve(None)[0]
    final = REPO / ".cache" / "sglang" / f"patched-{target.patch_sha256[:12]}"
    if (final / "sglang" / RECORD_NAME).is_file():
        return final
    wheel = fetch_wheel(target)
    staging = Path(tempfile.mkdtemp(prefix="patched-", dir=final.parent))
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(staging, [n for n in archive.namelist() if n.startswith("sglang/")])
    report = check_tree(staging, apply=True)
    assert report.ok, report.render()
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    return final


PARSE_SCRIPT = r"""
import json, sys
from sglang.srt.server_args import prepare_server_args
from sglang.srt.arg_groups.validation_hook import handle_aux_hidden_state_capture
args = prepare_server_args(json.loads(sys.argv[1]))
handle_aux_hidden_state_capture(args)
names = json.loads(sys.argv[2])
print(json.dumps({n: getattr(args, n) for n in names}))
"""


@pytest.mark.sglang_server
def test_k3_command_parses_with_the_patched_sglang_0_5_23_parser() -> None:
    # The parser imports much of SGLang's serving stack (orjson, IPython, zmq, ...): it runs in the
    # capture venv that tools/bootstrap_sglang builds, hence the SGLang tier.
    python = require_capture_venv()
    tree = _patched_full_tree()
    names = [
        "model_path", "tp_size", "mem_fraction_static", "context_length", "max_running_requests",
        "max_total_tokens", "attention_backend", "moe_runner_backend", "mamba_radix_cache_strategy",
        "max_mamba_cache_size", "chunked_prefill_size", "cuda_graph_backend_decode", "cuda_graph_backend_prefill",
        "skip_tokenizer_init", "trust_remote_code", "enable_return_aux_hidden_states", "speculative_algorithm",
        "return_aux_hidden_state_layer_ids", "dspark_capture_sink", "dspark_capture_recipe", "port", "host",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(
        [python, "-c", PARSE_SCRIPT, json.dumps(K3_GOLDEN), json.dumps(names)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    s = _k3().capture.sglang
    assert parsed["tp_size"] == s.tp_size and parsed["mem_fraction_static"] == s.mem_fraction_static
    assert (parsed["context_length"], parsed["max_total_tokens"]) == (s.context_length, s.max_total_tokens)
    assert parsed["max_running_requests"] == s.max_running_requests
    assert (parsed["attention_backend"], parsed["moe_runner_backend"]) == (s.attention_backend, s.moe_runner_backend)
    assert parsed["mamba_radix_cache_strategy"] == s.mamba_radix_cache_strategy
    assert parsed["max_mamba_cache_size"] == s.max_mamba_cache_size
    assert parsed["chunked_prefill_size"] == s.chunked_prefill_size
    assert "disabled" in str(parsed["cuda_graph_backend_decode"]).lower()
    assert "disabled" in str(parsed["cuda_graph_backend_prefill"]).lower()
    assert parsed["skip_tokenizer_init"] is True and parsed["trust_remote_code"] is True
    assert parsed["enable_return_aux_hidden_states"] is True and parsed["speculative_algorithm"] == "DSPARK"
    assert parsed["return_aux_hidden_state_layer_ids"] == [7, 23, 51, 67, 83]
    assert parsed["dspark_capture_sink"] == "mooncake"
    assert parsed["dspark_capture_recipe"] == "/jobs/kimi_k3_v1c/recipe.resolved.json"

    # the patch's validation: a sink without DSPARK aux capture is refused before anything loads
    bad = [a for a in K3_GOLDEN if a != "--enable-return-aux-hidden-states"]
    proc = subprocess.run(
        [python, "-c", PARSE_SCRIPT, json.dumps(bad), "[]"], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode != 0 and "--dspark-capture-sink needs --enable-return-aux-hidden-states" in proc.stderr


# ----------------------------------------------------------------------------------------------
# the HTTP test double
# ----------------------------------------------------------------------------------------------


def synthetic_states(g: int, num_tokens: int, num_aux: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the double 'computes' for sample g: deterministic bf16 aux and final hidden states."""
    gen = torch.Generator().manual_seed(1000 + g)
    aux = torch.randn(num_tokens, num_aux * hidden, generator=gen).to(torch.bfloat16)
    return aux, torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)


class Double:
    """Behaviour and counters of the stand-in server."""

    def __init__(self, sink_kind: str = "discard", recipe_path: str | None = None) -> None:
        self.sink_kind = sink_kind
        self.recipe_path = recipe_path
        self.health_failures = 0
        self.generate_failures = 0
        self.generate_status: int | None = None
        self.generate_delay_s = 0.0
        self.computed_hidden_size: int | None = None  # a server whose model disagrees with the ticket
        self.server_info: dict[str, Any] = {"version": "0.5.23", "exec": {"dspark_capture_sink": sink_kind}}
        self.health_calls = 0
        self.generate_calls = 0
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def handle_generate(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.generate_calls += 1
            self.bodies.append(body)
            if self.generate_failures > 0:
                self.generate_failures -= 1
                return 503, {"error": "server busy"}
        if self.generate_status is not None:
            return self.generate_status, {"error": "dspark_capture needs a server launched with --dspark-capture-sink"}
        time.sleep(self.generate_delay_s)
        ticket = body["dspark_capture"]
        ids = body["input_ids"]
        assert body["sampling_params"] == {"max_new_tokens": 0} and body["return_hidden_states"] is True
        hidden = self.computed_hidden_size or ticket["hidden_size"]
        aux, last = synthetic_states(ticket["g"], len(ids), len(ticket["aux_layer_ids"]), hidden)
        try:  # as the patch's hook does: a sink error becomes an error receipt
            receipt = capture_from_sglang(
                sink_kind=self.sink_kind, recipe_path=self.recipe_path, request=ticket, input_ids=ids,
                num_cached_tokens=0, aux_hidden_states=aux, last_hidden_states=last, start=0,
                num_tokens=len(ids), is_commit_rank=True, patch="double",
            )  # fmt: skip
        except Exception as exc:
            receipt = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        meta = {"id": body["rid"], "finish_reason": {"type": "length", "length": 0}, "dspark_capture": [receipt]}
        return 200, {"output_ids": [], "meta_info": meta}


def _handler(double: Double) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, payload: Any | None = None) -> None:
            data = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                with double.lock:
                    double.health_calls += 1
                    healthy = double.health_calls > double.health_failures
                self._send(200 if healthy else 503)
            elif self.path == "/server_info":
                self._send(200, double.server_info)
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                status, payload = double.handle_generate(body)
                self._send(status, payload)
            except (BrokenPipeError, ConnectionResetError):
                pass

    return Handler


@pytest.fixture
def double() -> Iterator[tuple[Double, str]]:
    state = Double()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        close_sinks()


def _server(tmp_path: Path, extra: list[str] | None = None) -> SGLangServerSettings:
    """The SGLang server settings of the tiny recipe resolved into ``tmp_path``, with ``extra`` set."""
    from runtime.recipe.loader import load_resolved

    sets = [
        "capture.engine=sglang",
        "job.capture.gpus_per_node=1",
        "capture.sglang.tp_size=1",
        "capture.sglang.capture_sink=discard",
        "capture.sglang.health_poll_interval_s=0.01",
        "capture.sglang.health_timeout_s=60",  # generous: a loaded 2-core CI machine
        "capture.sglang.request_timeout_s=60",
        "capture.sglang.retry_backoff_s=0.01",
        "capture.sglang.request_retries=2",
        "capture.sglang.shutdown_timeout_s=5",
        "capture.sglang.log_tail_lines=5",
        *(extra or []),
    ]
    loaded = load_recipe(REPO / "recipes" / "tiny.yaml", sets)
    return sglang_server_settings(load_resolved(write_resolved(loaded, tmp_path, REPO)))


def _request(g: int, n: int) -> CaptureRequest:
    return CaptureRequest(g, 0, g, f"row-{g}", tuple(range(3, 3 + n)), tuple(i % 3 == 0 for i in range(n)))


class Report:
    def __init__(self, ok: bool) -> None:
        self.ok, self.notices = ok, ["patch target '9acd9cb' is an alias"]

    def render(self) -> str:
        return "patch target kimi_k3_dspark_sglang_0.5.23 on installed sglang: state pristine\n  result: FAILED"


def test_waits_for_health_then_checks_the_sink_and_captures(double, tmp_path: Path) -> None:
    state, url = double
    state.health_failures = 3
    engine = SGLangEngine(_server(tmp_path), launch=False, base_url=url, patch_check=lambda t: Report(True))
    engine.start()
    assert state.health_calls == 4
    refs = engine.capture([_request(4, 9), _request(5, 17)])
    assert [(r.g, r.num_tokens, r.meta["status"]) for r in refs] == [(4, 9, "discarded"), (5, 17, "discarded")]
    first = state.bodies[0]
    assert first["input_ids"] == list(range(3, 12))
    assert first["dspark_capture"]["loss_mask"] == "100100100" and first["dspark_capture"]["store_id"] == "tiny"
    assert first["dspark_capture"]["aux_layer_ids"] == [1, 3, 5] and first["dspark_capture"]["hidden_size"] == 256
    assert state.bodies[0]["cache_salt"] != state.bodies[1]["cache_salt"]  # never a prefix-cache hit
    assert refs[1].meta["fields"]["hs"]["shape"] == [17, 768]


def test_health_timeout_names_the_setting_and_the_last_answer(double, tmp_path: Path) -> None:
    state, url = double
    state.health_failures = 10**9
    engine = SGLangEngine(
        _server(tmp_path, ["capture.sglang.health_timeout_s=0.3"]), launch=False, base_url=url, patch_check=None
    )
    with pytest.raises(
        SGLangEngineError, match=r"not healthy after 0 s \(capture.sglang.health_timeout_s = 0.3\).*HTTP 503"
    ):
        engine.start()
    assert state.health_calls > 3


def test_a_server_without_the_sink_is_refused(double, tmp_path: Path) -> None:
    state, url = double
    state.server_info = {"version": "0.5.23"}
    engine = SGLangEngine(_server(tmp_path), launch=False, base_url=url, patch_check=None)
    with pytest.raises(
        SGLangPatchError, match="dspark_capture_sink=None, the recipe needs 'discard'.*check_patch --apply"
    ):
        engine.start()


def test_unpatched_sglang_is_refused_before_anything_starts(tmp_path: Path) -> None:
    marker = tmp_path / "launched"
    engine = SGLangEngine(
        _server(tmp_path),
        command=[sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        patch_check=lambda target: Report(False),
    )
    with pytest.raises(SGLangPatchError) as info:
        engine.start()
    message = str(info.value)
    assert "capture.sglang.patch_target: kimi_k3_dspark_sglang_0.5.23" in message
    assert "fix: tools/check_patch --apply --target kimi_k3_dspark_sglang_0.5.23" in message
    assert "state pristine" in message
    assert engine.process is None and not marker.exists()


def test_transient_failures_are_retried_and_refusals_are_not(double, tmp_path: Path) -> None:
    state, url = double
    naps: list[float] = []
    engine = SGLangEngine(_server(tmp_path), launch=False, base_url=url, patch_check=None, sleep=naps.append)
    state.generate_failures = 2
    assert engine.capture([_request(1, 5)])[0].meta["status"] == "discarded"
    assert state.generate_calls == 3 and naps == [0.01, 0.02]

    state.generate_calls, state.generate_failures = 0, 3
    with pytest.raises(SGLangCaptureError, match=r"failed 3 times; last error: HTTP 503"):
        engine.capture([_request(2, 5)])
    assert state.generate_calls == 3

    state.generate_calls, state.generate_failures, state.generate_status = 0, 0, 400
    with pytest.raises(SGLangCaptureError, match="refused the capture of sample g=3: HTTP 400.*--dspark-capture-sink"):
        engine.capture([_request(3, 5)])
    assert state.generate_calls == 1


def test_sink_errors_and_timeouts_are_reported_not_retried(double, tmp_path: Path) -> None:
    state, url = double
    engine = SGLangEngine(_server(tmp_path), launch=False, base_url=url, patch_check=None)
    state.computed_hidden_size = 64
    with pytest.raises(SGLangCaptureError, match=r"capture sink refused sample g=7: .*\(4, 192\), expected \(4, 768\)"):
        engine.capture([_request(7, 4)])
    state.computed_hidden_size = None

    slow = SGLangEngine(
        _server(tmp_path / "slow", ["capture.sglang.request_timeout_s=0.3"]), launch=False, base_url=url,
        patch_check=None,
    )  # fmt: skip
    state.generate_calls, state.generate_delay_s = 0, 1.0
    with pytest.raises(SGLangCaptureError, match="took longer than capture.sglang.request_timeout_s = 0.3 s"):
        slow.capture([_request(8, 4)])
    assert state.generate_calls == 1


def test_a_server_that_dies_at_start_is_reported_with_its_log_tail(tmp_path: Path) -> None:
    script = "import sys; print('loading 93 layers'); print('torch.OutOfMemoryError: CUDA out of memory', file=sys.stderr); sys.exit(3)"
    engine = SGLangEngine(
        _server(tmp_path, [f"capture.sglang.port={free_port()}"]),
        command=[sys.executable, "-c", script],
        patch_check=None,
        log_path=tmp_path / "server.log",
    )
    with pytest.raises(SGLangEngineError) as info:
        engine.start()
    message = str(info.value)
    assert "exited with status 3 while starting" in message
    assert "torch.OutOfMemoryError: CUDA out of memory" in message and "loading 93 layers" in message
    engine.close()


SERVE_DOUBLE = r"""
import sys, threading
from http.server import ThreadingHTTPServer
from tests.test_sglang_engine import Double, _handler
import tests.test_sglang_engine as t
state = Double()
print("double server starting", flush=True)
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), _handler(state)).serve_forever()
"""


def test_launches_the_server_process_and_stops_its_process_group(tmp_path: Path) -> None:
    port = free_port()
    engine = SGLangEngine(
        _server(tmp_path, [f"capture.sglang.port={port}", "capture.sglang.health_timeout_s=60"]),
        command=[sys.executable, "-c", SERVE_DOUBLE, str(port)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        patch_check=lambda target: Report(True),
    )
    engine.start()
    try:
        pid = engine.process.proc.pid
        ref = engine.capture([_request(11, 6)])[0]
        assert ref.g == 11 and ref.meta["status"] == "discarded"
        engine.check_health()
    finally:
        engine.close()
    assert engine.process is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "double server starting" in (tmp_path / "capture" / "sglang_server.log").read_text()


ORPHAN_PARENT = r"""
import sys, time
from pathlib import Path
from runtime.capture.engine_sglang import ServerProcess
server = ServerProcess([sys.executable, "-c", "import time; time.sleep(600)"], {}, Path(sys.argv[1]))
server.start()
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # exited; only its new parent has not reaped it yet


def test_a_server_dies_with_a_producer_killed_by_sigkill(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_PARENT, str(tmp_path / "server.log")],
        cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert parent.stdout is not None
    server_pid = int(parent.stdout.readline())
    assert not _gone(server_pid)
    parent.kill()  # no cleanup code runs: only the kernel's parent-death signal can stop the server
    parent.wait(timeout=30)
    deadline = time.monotonic() + 30
    while not _gone(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not _gone(server_pid):
        os.kill(server_pid, signal.SIGKILL)
        pytest.fail(f"the server (pid {server_pid}) outlived its SIGKILLed parent")


@pytest.mark.mooncake
def test_end_to_end_into_a_real_mooncake_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.transport.dataplane import open_consumer, open_producer
    from runtime.transport.loopback import loopback_env, loopback_master, loopback_recipe

    resolved = loopback_recipe(
        tmp_path,
        (free_port(), free_port(), free_port()),
        [
            "capture.engine=sglang",
            "job.capture.gpus_per_node=1",
            "capture.sglang.tp_size=1",
            "transport.store_id=e2e",
            "transport.kv_lease_ttl_s=5",
            "transport.connect_timeout_s=20",
            "job.trainer.tasks_per_node=1",
            "trainer.gradient_accumulation_steps=4",
            "trainer.global_batch_size=4",
            "transport.high_watermark_samples=8",
            "transport.low_watermark_samples=4",
        ],
    )
    for key, value in loopback_env(resolved).items():
        monkeypatch.setenv(key, value)
    state = Double(sink_kind="mooncake", recipe_path=str(resolved.path))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoints = loopback_endpoints(resolved)
    try:
        with (
            loopback_master(resolved),
            open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints, start_cursor=0) as producer,
        ):
            engine = SGLangEngine(
                sglang_server_settings(resolved),
                launch=False,
                base_url=f"http://127.0.0.1:{server.server_address[1]}",
                patch_check=None,
            )
            engine.start()
            gs = [producer.next_to_capture() for _ in range(3)]
            requests = [_request(g, n) for g, n in zip(gs, (50, 7, 130), strict=True)]
            refs = engine.capture(requests)
            # The sink's commit pipeline (one batch of staging slots by default) commits behind the
            # receipts; the consumer's fetch waits for each sample's meta.
            assert [r.meta["status"] for r in refs] == ["queued"] * 3 and all(r.bytes_written for r in refs)
            with open_consumer(transport_of(resolved), 0, 1, endpoints=endpoints) as consumer:
                for request in requests:
                    got = consumer.fetch(request.g)
                    aux, last = synthetic_states(request.g, len(request.input_ids), 3, 256)
                    assert got.ids.tolist() == list(request.input_ids)
                    assert got.mask.tolist() == [int(v) for v in request.loss_mask]
                    assert torch.equal(got.hs, aux) and torch.equal(got.lhs, last)
                    assert got.meta["engine"] == "sglang" and got.meta["row_id"] == request.row_id
    finally:
        server.shutdown()
        server.server_close()
        close_sinks()


def test_a_cpu_server_gets_its_interpreter_device_library_path_and_environment(tmp_path: Path) -> None:
    from runtime.capture.sglang_cpu import cpu_server_overrides

    engine = SGLangEngine(
        _server(tmp_path, [*cpu_server_overrides(31234), "job.capture.gpus_per_node=0"]),
        env={"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib"},
        launch=False,
        patch_check=None,
    )
    assert engine.command[:3] == [str(REPO / ".cache" / "sgl-venv" / "bin" / "python"), "-m", "sglang.launch_server"]
    assert engine.command[engine.command.index("--device") + 1] == "cpu"
    assert engine.command[engine.command.index("--dtype") + 1] == "float32"
    assert engine.env["LD_LIBRARY_PATH"].split(os.pathsep) == [
        str(REPO / ".cache" / "sgl-venv" / "cuda-stub"),
        "/opt/lib",
    ]
    assert engine.env["SGLANG_USE_CPU_ENGINE"] == "1" and "SGLANG_USE_CPU_ENGINE" not in os.environ
    # a GPU server of the same recipe gets none of it
    gpu = SGLangEngine(_server(tmp_path / "gpu"), env={"PATH": "/usr/bin"}, launch=False, patch_check=None)
    assert "--device" not in gpu.command and "LD_LIBRARY_PATH" not in gpu.env


def test_the_patch_check_looks_at_the_servers_interpreter(tmp_path: Path) -> None:
    """``capture.sglang.python`` set: the check runs against that interpreter's sglang (here one
    that has none), not this process's."""
    from runtime.shared.sglang_patch_check import check_installed

    other = tmp_path / "python"
    other.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    other.chmod(0o755)
    report = check_installed(None, python=other)
    assert not report.ok and report.state == "missing" and str(other) in report.problems[0]
    assert report.fix.endswith(f"{other} tools/check_patch --apply")
