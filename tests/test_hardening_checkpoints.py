"""Issue 15, item 2: a checkpoint is verified before a run trusts it.

Real torch.distributed.checkpoint files are written, damaged the way disks and people damage them
(16 flipped bytes inside a tensor, a truncated shard, a broken ``trainer_state.json``, another draft
architecture, a truncated export), and every case must give one error naming the file and the fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runtime.trainer import checkpoints
from runtime.trainer.resume import check_resume_compatible
from tests.support.trainer_runs import save_one_rank


def _save(folder: Path, step: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer, Path]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).square().sum().backward()
    optimizer.step()
    saved = save_one_rank(folder, model, optimizer, step)
    return model, optimizer, saved.path


def _flip_inside(path: Path, tensor: torch.Tensor) -> Path:
    """Flip 16 bytes in the middle of ``tensor``'s bytes inside the checkpoint's shard file."""
    raw = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
    for shard in (path / checkpoints.DCP_DIR).glob("*.distcp"):
        data = bytearray(shard.read_bytes())
        at = data.find(raw)
        if at >= 0:
            middle = at + len(raw) // 2
            data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
            shard.write_bytes(bytes(data))
            return shard
    raise AssertionError("tensor bytes not found in any shard")


def _fresh_pair() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 64)).sum().backward()
    optimizer.step()  # materialise the optimizer state the checkpoint is loaded into
    return model, optimizer


def test_intact_checkpoint_verifies_and_resumes_exactly(tmp_path: Path) -> None:
    model, optimizer, path = _save(tmp_path)
    state = checkpoints.verify_checkpoint(path)
    assert state["files"] and state["optimizer_sha256"]
    fresh, fresh_opt = _fresh_pair()
    checkpoints.load_full(path, fresh, fresh_opt, state)
    assert torch.equal(fresh.weight, model.weight)


def test_flipped_bytes_in_a_weight_are_refused_naming_file_and_both_hashes(tmp_path: Path) -> None:
    model, _, path = _save(tmp_path)
    shard = _flip_inside(path, model.weight)
    with pytest.raises(checkpoints.CheckpointError) as err:
        checkpoints.verify_checkpoint(path)
    message = str(err.value)
    assert str(shard) in message and "is corrupt: sha256" in message and "when written" in message
    assert "Fix: resume from an older checkpoint" in message


def test_load_checks_weight_and_optimizer_hashes_even_without_file_records(tmp_path: Path) -> None:
    model, optimizer, path = _save(tmp_path)
    state = checkpoints.read_state(path)
    state.pop("files")  # a checkpoint from before file records: the loaded-tensor hashes still catch it
    _flip_inside(path, model.weight)
    fresh, fresh_opt = _fresh_pair()
    with pytest.raises(checkpoints.CheckpointError, match=r"loaded weights hash to sha256 \w+, but .* recorded \w+"):
        checkpoints.load_full(path, fresh, fresh_opt, state)

    _, _, other = _save(tmp_path / "b")
    moment = optimizer.state[model.weight]["exp_avg"]
    _flip_inside(other, moment)
    state = checkpoints.read_state(other)
    state.pop("files")
    fresh, fresh_opt = _fresh_pair()
    with pytest.raises(checkpoints.CheckpointError, match="loaded optimizer state hash"):
        checkpoints.load_full(other, fresh, fresh_opt, state)


def test_truncated_shard_and_broken_state_file_name_the_file(tmp_path: Path) -> None:
    _save(tmp_path, step=2)
    _, _, path = _save(tmp_path, step=4)
    shard = next((path / checkpoints.DCP_DIR).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(checkpoints.CheckpointError, match=rf"{shard} has \d+ bytes, \d+ were written") as err:
        checkpoints.verify_checkpoint(path)
    assert "older ones here: step_00000002" in str(err.value)

    (path / checkpoints.STATE_FILE).write_text('{"format": "dspark-trainer-state/1", "step": ')
    with pytest.raises(checkpoints.CheckpointError, match=rf"{path / checkpoints.STATE_FILE} is unreadable"):
        checkpoints.verify_checkpoint(path)


def test_another_draft_architecture_is_named(tmp_path: Path) -> None:
    _, _, path = _save(tmp_path)
    narrow = torch.nn.Linear(64, 32)
    with pytest.raises(
        checkpoints.CheckpointError, match="does not match this draft .*Fix: resume with the trainer.draft"
    ):
        checkpoints.load_weights(path, narrow)
    current = {"schedule_type": "cosine", "world_size": 4, "data_digest": "d", "prompt_seed": 1, "global_batch_size": 8}
    recorded = {
        "schedule": {"type": "cosine"},
        "world_size": 4,
        "data_digest": "d",
        "prompt_seed": 1,
        "global_batch_size": 8,
        "draft": {"num_layers": 1, "hidden_size": 256},
    }
    with pytest.raises(checkpoints.CheckpointError, match=r"draft architecture \(trainer.draft\).*num_layers 1 -> 2"):
        check_resume_compatible(recorded, {**current, "draft": {"num_layers": 2, "hidden_size": 256}}, path)


def test_corrupt_export_is_named(tmp_path: Path) -> None:
    export = tmp_path / "export"
    export.mkdir()
    file = export / "model.safetensors"
    save_file({"weight": torch.zeros(64, 64), "bias": torch.zeros(64)}, str(file))
    file.write_bytes(file.read_bytes()[:200])
    with pytest.raises(ValueError, match=rf"{file} is not a readable safetensors file .*Fix: export the draft again"):
        checkpoints.load_weights(export, torch.nn.Linear(64, 64))
    save_file({"weight": torch.zeros(32, 64), "bias": torch.zeros(32)}, str(file))
    with pytest.raises(checkpoints.CheckpointError, match=r"weight \(32, 64\) \(this draft: \(64, 64\)\)"):
        checkpoints.load_weights(export, torch.nn.Linear(64, 64))
