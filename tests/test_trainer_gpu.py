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
