"""The real patched SGLang 0.5.23 server (tier ``sglang_server``), serving the tiny Qwen3-MoE target on
the CPU from the capture venv that ``tools/bootstrap_sglang`` builds.

The server is started by ``runtime/capture/engine_sglang.py`` exactly as production starts it (the
rendered command, the health wait, the sink check through ``/server_info``); its capture sink
commits into a real ``mooncake_master`` on loopback; the trainer's consumer reads the samples back
and they pass the sample contract; and the hidden states agree with the embedded transformers
engine's for the same prompts.

Agreement tolerance: both engines compute in float32 (``--dtype float32`` / ``capture.compute_dtype:
float32``) and store bf16. The two float32 computations differ only by summation order (SGLang's
fused MoE and torch-native attention vs transformers' eager modules), relative error around 1e-6,
so after rounding to bf16 (8 mantissa bits) an element either rounds to the same bf16 value or to
its neighbour: at most one bf16 step, 2**-8 relative to the element's magnitude. We allow
``|a - b| <= 2**-7 * max(|a|, |b|) + 1e-5`` per element (one bf16 step with a factor 2 of margin,
plus an absolute floor for values near zero) and check that at least 99% of the elements are
bit-identical. A layer-id mix-up (Qwen3-MoE's DSPARK capture falls back to
``set_dflash_layers_to_capture``, which shifts ids by one) moves every value by a whole layer's
update and fails both by orders of magnitude; the test also checks that the neighbouring layers
do NOT match, so it could catch that shift.
"""

from __future__ import annotations

import json
import os
import time
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.capture.engine import CaptureRequest
from runtime.capture.engine_embedded import EmbeddedEngine
from runtime.capture.engine_sglang import SGLangEngine, SGLangPatchError
from runtime.capture.producer import CaptureSource
from runtime.capture.setup import data_setup, embedded_settings, sglang_server_settings
from runtime.capture.sglang_cpu import (
    CAPTURE_VENV_PYTHON,
    CpuServer,
    capture_venv_ready,
    cpu_server_overrides,
    serve_on_cpu,
    tiny_asset_overrides,
)
from runtime.recipe.loader import ResolvedRecipe
from runtime.shared.contracts import sample_problems
from tests.conftest import free_port

pytestmark = [pytest.mark.sglang_server, pytest.mark.mooncake, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
NUM_PROMPTS = 8
BF16_STEP_RELATIVE = 2.0**-7
ABSOLUTE_FLOOR = 1e-5


def require_capture_venv() -> str:
    """The capture venv's python; skips (or fails, under DSPARK_REQUIRE_SGLANG_SERVER=1 as in CI)
    when ``tools/bootstrap_sglang`` has not built it."""
    if capture_venv_ready(REPO):
        return str(REPO / CAPTURE_VENV_PYTHON)
    message = "the capture venv is not built: run tools/bootstrap_sglang (a 7.5 GB venv, 9 GB free needed; see README)"
    if os.environ.get("DSPARK_REQUIRE_SGLANG_SERVER") == "1":
        pytest.fail(message)
    pytest.skip(message)


class RecordingSink:
    """Keeps what the embedded engine commits (the comparison's reference), in memory."""

    def __init__(self) -> None:
        self.samples: dict[int, dict[str, torch.Tensor]] = {}

    def commit(self, g: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> int:
        self.samples[g] = {name: t.detach().clone() for name, t in tensors.items()}
        return sum(t.numel() * t.element_size() for t in tensors.values())


def _loopback_env(resolved: ResolvedRecipe) -> dict[str, str]:
    from runtime.transport.loopback import loopback_env

    return {**os.environ, **loopback_env(resolved)}


@pytest.fixture(scope="module")
def live(sglang_tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpuServer]:
    """A mooncake_master on loopback, the capture side's producer (it mounts the segment the
    server's sink writes into), and the real server started by the engine."""
    require_capture_venv()
    job_dir = tmp_path_factory.mktemp("sglang-server")
    ports = (free_port(), free_port(), free_port())
    overrides = [*tiny_asset_overrides(sglang_tiny_assets), f"transport.store_id=sgl{os.getpid()}"]
    with serve_on_cpu(job_dir, ports, free_port(), overrides) as server:
        yield server


def _requests(resolved: ResolvedRecipe, gs: list[int]) -> list[CaptureRequest]:
    source = CaptureSource.open(data_setup(resolved))
    return [source.request(g) for g in gs]


def _report(name: str, value: Any) -> None:
    """Numbers for the issue note (pytest -s shows them; the log keeps them)."""
    print(f"[sglang-server] {name}: {value}", flush=True)


def test_server_captures_into_mooncake_pass_the_contract_and_agree_with_the_embedded_engine(live: CpuServer) -> None:
    from runtime.transport.dataplane import open_consumer
    from runtime.transport.loopback import transport_of

    recipe = live.resolved.recipe
    _report("server start to healthy (s)", round(live.start_s, 1))
    gs = [live.producer.next_to_capture() for _ in range(NUM_PROMPTS)]
    requests = _requests(live.resolved, gs)
    tokens = sum(len(r.input_ids) for r in requests)

    started = time.monotonic()
    refs = live.engine.capture(requests)
    server_s = time.monotonic() - started
    # The sink commits through the commit pipeline (capture.commit_staging_slots: one batch by default),
    # so receipts say "queued"; the consumer reads below prove the commits landed.
    assert [r.meta["status"] for r in refs] == ["queued"] * NUM_PROMPTS
    assert [r.g for r in refs] == gs and all(r.bytes_written > 0 for r in refs)

    sink = RecordingSink()
    embedded = EmbeddedEngine(embedded_settings(live.resolved), sink)
    embedded.start()
    started = time.monotonic()
    for request in requests:  # one sample per forward, as the tiny recipe's embedded engine runs
        embedded.capture([request])
    embedded.flush()  # its commit pipeline hands the last samples to the sink
    embedded_s = time.monotonic() - started
    _report(
        "capture tokens/s, same prompts",
        f"server {tokens / server_s:.0f}, embedded {tokens / embedded_s:.0f} "
        f"({tokens} tokens; server/embedded {embedded_s / server_s:.2f}x)",
    )

    aux = list(recipe.capture.aux_layer_ids)
    hidden = recipe.capture.hidden_size
    worst_ratio, identical, total = 0.0, 0, 0
    with open_consumer(transport_of(live.resolved), 0, recipe.trainer_world_size, endpoints=live.endpoints) as consumer:
        for request in requests:
            got = consumer.fetch(request.g)
            assert sample_problems(got, aux, hidden, recipe.data.max_length) == []
            assert got.ids.tolist() == list(request.input_ids)
            assert got.mask.tolist() == list(request.loss_mask)
            assert got.meta["engine"] == "sglang" and got.meta["row_id"] == request.row_id
            reference = sink.samples[request.g]
            for name in ("hs", "lhs"):
                a, b = got.__dict__[name].float(), reference[name].float()
                bound = BF16_STEP_RELATIVE * torch.maximum(a.abs(), b.abs()) + ABSOLUTE_FLOOR
                ratio = float(((a - b).abs() / bound).max())
                worst_ratio = max(worst_ratio, ratio)
                assert ratio <= 1.0, f"g={request.g} {name}: differs by {ratio:.1f}x the bf16 tolerance"
                identical += int((a == b).sum())
                total += a.numel()
            # The layer-id convention: each aux block matches its own layer (above), and most of its
            # elements are outside the tolerance against the next layer's (what a shift by one gives).
            ours = got.hs.float().view(-1, len(aux), hidden)
            theirs = reference["hs"].float().view(-1, len(aux), hidden)
            for i in range(len(aux) - 1):
                a, b = ours[:, i], theirs[:, i + 1]
                bound = BF16_STEP_RELATIVE * torch.maximum(a.abs(), b.abs()) + ABSOLUTE_FLOOR
                within = float(((a - b).abs() <= bound).float().mean())
                assert within < 0.5, f"aux block {i} matches layer {aux[i + 1]} for {within:.0%}: ids shifted by one?"
    _report("agreement", f"{identical / total:.4%} bit-identical bf16 elements, worst {worst_ratio:.2f} of the bound")
    assert identical / total >= 0.99


def test_an_unpatched_sglang_is_refused_before_anything_starts(live: CpuServer, tmp_path: Path) -> None:
    """An interpreter whose ``sglang`` is the pristine 0.5.23 (the wheel unpacked in front of the
    venv's site-packages) is refused with the fix, and no server is launched."""
    from runtime.sglang_patching.pinned_wheel import fetch_wheel
    from runtime.shared.sglang_patch_manifest import load_manifest
    from runtime.transport.loopback import loopback_recipe

    target = load_manifest().resolve(None)[0]
    pristine = tmp_path / "pristine"
    with zipfile.ZipFile(fetch_wheel(target)) as archive:
        archive.extractall(pristine, [n for n in archive.namelist() if n.startswith("sglang")])
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={pristine} exec {REPO / CAPTURE_VENV_PYTHON} "$@"\n')
    wrapper.chmod(0o755)
    port = free_port()
    resolved = loopback_recipe(
        tmp_path / "job",
        (free_port(), free_port(), free_port()),
        [*cpu_server_overrides(port), f"capture.sglang.python={wrapper}"],
    )
    engine = SGLangEngine(sglang_server_settings(resolved), env=_loopback_env(resolved))
    with pytest.raises(SGLangPatchError) as info:
        engine.start()
    message = str(info.value)
    assert "is not patched" in message and "tools/check_patch --apply" in message and str(wrapper) in message
    assert engine.process is None and not (resolved.job_dir / "capture" / "sglang_server.log").exists()


def test_a_bad_ticket_gets_an_error_receipt_and_the_server_stays_up(live: CpuServer) -> None:
    from runtime.capture.engine_sglang import SGLangCaptureError

    (request,) = _requests(live.resolved, [live.producer.next_to_capture()])
    broken = CaptureRequest(
        request.g, request.epoch, request.row_index, request.row_id, request.input_ids, request.loss_mask[:-1]
    )
    with pytest.raises(SGLangCaptureError, match="refused|mask"):
        live.engine.capture([broken])
    live.engine.check_health()
    assert live.engine.capture([request])[0].meta["status"] == "queued"  # handed to the commit pipeline


def test_the_server_log_and_command_are_what_production_renders(live: CpuServer) -> None:
    from runtime.capture.engine_sglang import http_request

    log_text = (live.resolved.job_dir / "capture" / "sglang_server.log").read_text(errors="replace")
    assert "launching: " + " ".join(live.engine.command) in log_text
    assert live.engine.command[:3] == [str(REPO / CAPTURE_VENV_PYTHON), "-m", "sglang.launch_server"]
    _, body = http_request(f"{live.engine.base_url}/server_info", timeout_s=30.0)
    info = json.loads(body)
    assert info["dspark_capture_sink"] == "mooncake" and info["device"] == "cpu"


def test_streamed_experts_capture_exactly_what_resident_experts_capture(
    live: CpuServer, sglang_tiny_assets: Path, tmp_path: Path
) -> None:
    """capture.expert_streaming in the patched server (6 of the 8 MoE layers' experts created in host
    memory and copied into a device buffer before each layer runs): the same requests give the same
    bytes as the all-resident server (``live``)."""
    from runtime.transport.dataplane import open_consumer
    from runtime.transport.loopback import transport_of

    gs = [live.producer.next_to_capture() for _ in range(4)]
    requests = _requests(live.resolved, gs)
    live.engine.capture(requests)
    world = live.resolved.recipe.trainer_world_size
    with open_consumer(transport_of(live.resolved), 0, world, endpoints=live.endpoints) as consumer:
        resident = {g: consumer.fetch(g) for g in gs}

    overrides = [
        *tiny_asset_overrides(sglang_tiny_assets),
        f"transport.store_id=sgls{os.getpid()}",
        "capture.expert_streaming.enabled=true",
        "capture.expert_streaming.resident_fraction=0.25",
    ]
    ports = (free_port(), free_port(), free_port())
    with serve_on_cpu(tmp_path / "streamed", ports, free_port(), overrides) as server:
        refs = server.engine.capture(requests)
        assert [r.g for r in refs] == gs
        with open_consumer(transport_of(server.resolved), 0, world, endpoints=server.endpoints) as consumer:
            streamed = {g: consumer.fetch(g) for g in gs}
        log_text = (server.resolved.job_dir / "capture" / "sglang_server.log").read_text(errors="replace")
    assert "expert streaming on cpu: 2 of 8 MoE layers resident, 6 streamed" in log_text, log_text[-3000:]
    for g in gs:
        for name in ("ids", "mask", "hs", "lhs"):
            assert torch.equal(getattr(streamed[g], name), getattr(resident[g], name)), f"g={g} {name}"
    _report("streamed experts", f"{len(gs)} samples byte-identical to the all-resident server")
