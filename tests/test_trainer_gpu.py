"""The trainer on CUDA: NCCL, FSDP2 in bf16 with fp32 master weights and reduction, compiled
flex_attention, the GPU sample copy stream, DCP checkpoint + reload hash and export, through the
smoke gate. One rank per visible GPU (up to 4). Skipped, and counted, without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.trainer_runs import launch, make_inputs, make_run

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


def test_smoke_gate_on_gpu_ranks(tmp_path: Path, port_factory) -> None:
    world = max(1, min(4, torch.cuda.device_count()))
    target, samples = make_inputs(tmp_path / "inputs", count=8)
    run = make_run(
        tmp_path,
        "gpu",
        world_size=world,
        target=target,
        samples=samples,
        overrides=[
            "trainer.device=cuda",
            f"job.trainer.gpus_per_node={world}",
            "trainer.param_dtype=bfloat16",
            "trainer.attention_backend=flex",
            f"trainer.global_batch_size={world}",
        ],
        smoke=True,
    )
    result = launch(run, port_factory(), timeout_s=480)
    assert result.ok, result.text()
    gate = json.loads((run.job_dir / "trainer_gate.json").read_text())
    assert gate["passed"] is True, gate
    assert gate["world_size"] == world and gate["checkpoint"]["reload_matches"] is True
    assert "device cuda" in result.logs[0] and "attention flex" in result.logs[0]


def test_hashes_of_cuda_tensors_equal_those_of_their_host_copies() -> None:
    """CUDA tensors are hashed through a few reused pinned buffers: more tensors than buffers, of
    several sizes and dtypes, must hash exactly as their host copies do, in both schemes."""
    from runtime.shared.checkpoint_folders import SEQUENTIAL_HASH_SCHEME
    from runtime.trainer.state_hash import STAGING_BUFFERS, state_dict_sha256

    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {
        f"layer.{i}": torch.randn(1 + 37 * i, 64, device="cuda", generator=g).to(
            torch.bfloat16 if i % 2 else torch.float32
        )
        for i in range(3 * STAGING_BUFFERS)
    }
    tensors["empty"] = torch.zeros(0, device="cuda")
    host = {name: tensor.cpu() for name, tensor in tensors.items()}
    for scheme in ("sha256-per-tensor/1", SEQUENTIAL_HASH_SCHEME):
        assert state_dict_sha256(tensors, scheme) == state_dict_sha256(host, scheme)
