"""Expert parallelism on a real (tiny, random) Hugging Face Qwen3-MoE model: the hidden states a
capture reads are the same with EP = 2 over gloo as with the unsharded model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.moe.hf_adapter import HFExpertParallelBlock, shard_moe_experts
from runtime.transport.loopback import free_port

transformers = pytest.importorskip("transformers")
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from tests.support.tiny_moe import tiny_moe_config  # noqa: E402

BATCHES = {0: (2, 11), 1: (1, 7)}  # (batch, length) per rank: uneven on purpose


def _config() -> Qwen3MoeConfig:
    return tiny_moe_config()


def _model(state_path: Path) -> Qwen3MoeForCausalLM:
    model = Qwen3MoeForCausalLM(_config()).float().eval()
    model.load_state_dict(torch.load(state_path, weights_only=True))
    return model


def _input_ids(rank: int) -> torch.Tensor:
    batch, length = BATCHES[rank]
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(100 + rank))


def _hidden_states(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack(model(input_ids=ids, output_hidden_states=True).hidden_states)


def _worker(rank: int, world: int, port: int, state_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = _model(Path(state_path))
        sharded = shard_moe_experts(model, dist.group.WORLD, "nccl")
        first = _hidden_states(model, _input_ids(rank))
        # second step: rank 1 has no sample left and only takes part in the MoE collectives
        second = _hidden_states(model, _input_ids(rank)) if rank == 0 else None
        if rank == 1:
            sharded.idle_step(torch.device("cpu"), torch.float32)
        result = {
            "first": first,
            "second": second,
            "experts_per_rank": sharded.experts_per_rank,
            "blocks": len(sharded.blocks),
        }
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny_model_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_config()).float().eval()
    path = tmp_path_factory.mktemp("tiny_moe") / "state.pt"
    torch.save(model.state_dict(), path)
    return path


def test_ep1_adapter_reproduces_the_hf_model(tiny_model_state: Path) -> None:
    reference = _hidden_states(_model(tiny_model_state), _input_ids(0))
    model = _model(tiny_model_state)
    sharded = shard_moe_experts(model, None, "nccl")
    assert len(sharded.blocks) == 2 and all(
        isinstance(layer.mlp, HFExpertParallelBlock) for layer in model.model.layers
    )
    torch.testing.assert_close(_hidden_states(model, _input_ids(0)), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
def test_ep2_hidden_states_equal_the_unsharded_model(tiny_model_state: Path, tmp_path: Path) -> None:
    mp.spawn(_worker, args=(2, free_port(), str(tiny_model_state), str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    reference_model = _model(tiny_model_state)
    for rank in range(2):
        assert results[rank]["experts_per_rank"] == 4 and results[rank]["blocks"] == 2
        expected = _hidden_states(reference_model, _input_ids(rank))
        torch.testing.assert_close(results[rank]["first"], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        results[0]["second"], _hidden_states(reference_model, _input_ids(0)), rtol=1e-5, atol=1e-5
    )


def test_a_model_without_moe_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="no MoE block"):
        shard_moe_experts(torch.nn.Sequential(torch.nn.Linear(4, 4)), None)
