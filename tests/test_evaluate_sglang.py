"""The eval's SGLang route, as far as a CPU machine can take it: the serving command and
environment, the refusal off GPU (in SGLang 0.5.23's own words, checked against the pinned wheel),
and the client against an HTTP fake on loopback that answers with 0.5.23's response shapes
(``meta_info`` of ``/generate``, ``internal_states`` of ``/server_info``). Serving a DSpark draft
needs a GPU: that part runs only on a cluster."""

from __future__ import annotations

import json
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from runtime.evaluate.eval_sets import Prompt
from runtime.evaluate.sglang_route import (
    DEVICE_REFUSAL,
    EvalClient,
    SGLangRouteError,
    outcome_figures,
    refuse_off_accelerator,
    refuse_simulated_acceptance,
    serving_command,
    serving_environment,
)
from runtime.recipe import load_recipe
from runtime.shared.acceptance_length import MEAN_OF_DECODES_KEY, POOLED_KEY
from tests.conftest import REPO_ROOT
from tests.support.launcher_cli import launch

K3 = REPO_ROOT / "recipes" / "kimi_k3_v1c.yaml"


def test_the_serving_command_adds_the_draft_to_the_capture_servers_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3_TARGET_DIR", "/models/k3")
    recipe = load_recipe(K3).recipe
    command = serving_command(
        recipe.capture.sglang, Path("/runs/k3/1/checkpoints/export-step_1"), python="py", model_path=Path("/models/k3"),
        batch_size=16, block_size=7,
    )  # fmt: skip
    assert command[:3] == ["py", "-m", "sglang.launch_server"]
    flags = dict(zip(command[3::1], command[4::1], strict=False))
    assert flags["--model-path"] == "/models/k3" and flags["--tp-size"] == "8"
    assert flags["--max-running-requests"] == "16"
    assert flags["--speculative-algorithm"] == "DSPARK"
    assert flags["--speculative-draft-model-path"] == "/runs/k3/1/checkpoints/export-step_1"
    assert flags["--speculative-dspark-block-size"] == "7"
    # nothing of the capture server: no aux-state return, no capture sink
    assert not any(a.startswith(("--enable-return-aux", "--dspark-capture", "--return-aux")) for a in command)


def test_the_environment_uses_the_confidence_head_and_never_simulates_acceptance() -> None:
    env = serving_environment({"SGLANG_SIMULATE_ACC_LEN": "3.5", "PATH": "/bin"}, "cap-accept")
    assert env == {"PATH": "/bin", "SGLANG_RAGGED_VERIFY_MODE": "cap-accept"}
    with pytest.raises(SGLangRouteError, match="capture.sglang.server_env sets SGLANG_SIMULATE_ACC_LEN"):
        refuse_simulated_acceptance({"SGLANG_SIMULATE_ACC_LEN": "3"})


def test_off_gpu_the_route_refuses_with_sglangs_own_reason() -> None:
    with pytest.raises(SGLangRouteError) as info:
        refuse_off_accelerator("cpu")
    assert DEVICE_REFUSAL in str(info.value) and "eval.route: embedded" in str(info.value)
    refuse_off_accelerator("cuda")
    wheels = sorted((REPO_ROOT / ".cache" / "sglang").glob("sglang-0.5.23-*.whl"))
    if not wheels:
        pytest.skip("the pinned SGLang wheel is not cached (tools/bootstrap caches it)")
    with zipfile.ZipFile(wheels[0]) as wheel:
        hook = wheel.read("sglang/srt/arg_groups/speculative_hook.py").decode()
        ragged = wheel.read("sglang/srt/speculative/ragged_verify.py").decode()
        manager = wheel.read("sglang/srt/managers/tokenizer_manager.py").decode()
    assert DEVICE_REFUSAL in hook  # the words we quote are the pinned release's
    assert 'CAP_ACCEPT = "cap-accept"' in ragged and 'STATIC = "static"' in ragged
    for key in ("spec_verify_ct", "spec_accept_length", "spec_correct_drafts_histogram"):
        assert f'meta_info["{key}"]' in manager


class _FakeSGLang(BaseHTTPRequestHandler):
    """Answers like a DSpark-serving SGLang 0.5.23 (completion tokens, verify steps, histogram)."""

    answers: dict[int, dict] = {}

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        first = request["input_ids"][0]
        body = self.answers[first]
        self._send(body)

    def do_GET(self) -> None:  # noqa: N802
        self._send(
            {"version": "0.5.23", "internal_states": [{"avg_spec_accept_length": 2.75, "last_gen_throughput": 9.0}]}
        )

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def _answer(completion: int, verify: int, histogram: list[int] | None) -> dict:
    meta = {
        "id": "x",
        "prompt_tokens": 3,
        "completion_tokens": completion,
        "spec_verify_ct": verify,
        "spec_accept_length": completion / verify,
        "spec_accept_rate": 0.3,
        "finish_reason": {"type": "stop", "matched": 2},
    }
    if histogram is not None:
        meta["spec_correct_drafts_histogram"] = histogram
    return {"output_ids": list(range(completion)), "meta_info": meta}


@pytest.fixture
def fake_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSGLang)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_client_reads_acceptance_from_sglangs_answers(fake_server: str) -> None:
    # prompt 1: 9 tokens in 4 verify steps, accepted drafts 0,1,2,3 once each (block size 3)
    # prompt 2: 5 tokens in 2 steps, accepted 0 and 3
    _FakeSGLang.answers = {1: _answer(9, 4, [1, 1, 1, 1]), 2: _answer(5, 2, [1, 0, 0, 1])}
    client = EvalClient(fake_server, timeout_s=10)
    prompts = [Prompt("a", [1, 7, 7]), Prompt("b", [2, 7])]
    outcomes, wall_s = client.generate_all(prompts, batch_size=2, temperature=0.0, max_new_tokens=16, stop_ids=[2])
    assert [o.prompt_id for o in outcomes] == ["a", "b"] and outcomes[0].output_ids == list(range(9))
    figures = outcome_figures(outcomes, block_size=3, wall_s=wall_s)
    assert figures["verify_steps"] == 6 and figures["generated_tokens"] == 14
    assert figures[POOLED_KEY] == pytest.approx(14 / 6)
    assert figures[MEAN_OF_DECODES_KEY] == pytest.approx((9 / 4 + 5 / 2) / 2)  # each prompt weighs the same
    # histogram [2, 1, 1, 2]: slot 1 reached 6, accepted 4; slot 2 reached 4, accepted 3; slot 3: 3 and 2
    assert [(s["reached"], s["accept_rate"]) for s in figures["slots"]] == [
        (6, pytest.approx(4 / 6)),
        (4, 0.75),
        (3, pytest.approx(2 / 3)),
    ]
    assert client.server_accept_length() == 2.75
    # a server that is not speculating is named, not averaged
    _FakeSGLang.answers = {1: {"output_ids": [1], "meta_info": {"completion_tokens": 1}}}
    with pytest.raises(SGLangRouteError, match="not serving with --speculative-algorithm DSPARK"):
        client.generate(Prompt("a", [1]), temperature=0.0, max_new_tokens=4, stop_ids=[])


def test_an_sglang_eval_on_a_cpu_machine_refuses_before_starting_anything(tmp_path: Path) -> None:
    job = tmp_path / "job"
    done = launch(["resolve", "tiny", "--job-dir", str(job), "--set", "eval.route=sglang"])
    assert done.returncode == 0, done.stderr
    checkpoint = job / "checkpoints" / "step_00000008"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "runtime.evaluate", "--recipe", str(job / "recipe.resolved.json")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert DEVICE_REFUSAL in done.stderr and not (job / "eval" / "step_00000008" / "sglang_server.log").exists()
