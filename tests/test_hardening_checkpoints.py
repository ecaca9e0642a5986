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
    assert "Fix: there is no older checkpoint in" in message


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
    assert "Fix: resume from the previous checkpoint, step_00000002" in str(err.value)

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


def _edit_a_digit(file: Path) -> None:
    """Change the first digit in ``file`` (text or binary) to another digit."""
    data = bytearray(file.read_bytes())
    at = next(i for i, byte in enumerate(data) if 0x30 <= byte <= 0x39)
    data[at] = 0x30 + (data[at] - 0x30 + 1) % 10
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["trainer_state.json", "seal", ".metadata", "shard", "extra file", "no seal"])
def test_an_edit_anywhere_in_a_checkpoint_is_refused_naming_the_file_and_the_previous_one(
    tmp_path: Path, kind: str
) -> None:
    """Every file kind of a checkpoint: trainer_state.json (its "step", say), its seal, DCP's metadata, a
    shard, a file added under dcp/, the seal removed. Each is one refusal naming the file and the previous
    checkpoint by name."""
    from runtime.shared.checkpoint_integrity import SEAL_FILE

    _save(tmp_path, step=2)
    _, _, path = _save(tmp_path, step=4)
    assert checkpoints.verify_checkpoint(path)["integrity"] == "sha256-seal/1"
    dcp_dir = path / checkpoints.DCP_DIR
    named = {
        "trainer_state.json": path / checkpoints.STATE_FILE,
        "seal": path / SEAL_FILE,
        ".metadata": dcp_dir / ".metadata",
        "shard": next(dcp_dir.glob("*.distcp")),
        "extra file": dcp_dir / "__9_0.distcp",
        "no seal": path / SEAL_FILE,
    }[kind]
    if kind == "trainer_state.json":
        text = named.read_text()
        assert '"step": 4' in text
        named.write_text(text.replace('"step": 4', '"step": 5', 1))
    elif kind == "extra file":
        named.write_bytes(b"0")
    elif kind == "no seal":
        named.unlink()
    elif kind == "shard":
        data = bytearray(named.read_bytes())
        data[len(data) // 2] ^= 0x01
        named.write_bytes(bytes(data))
    else:
        _edit_a_digit(named)
    with pytest.raises(checkpoints.CheckpointError) as err:
        checkpoints.verify_checkpoint(path)
    message = str(err.value)
    assert str(named) in message, message
    assert "Fix: resume from the previous checkpoint, step_00000002" in message, message
    assert "\n" not in message


def test_a_checkpoint_from_before_the_seal_is_accepted_as_legacy_and_said(tmp_path: Path, capsys) -> None:
    import json

    from runtime.shared.checkpoint_integrity import SEAL_FILE

    _, _, path = _save(tmp_path)
    state = json.loads((path / checkpoints.STATE_FILE).read_text())
    state.pop("integrity")
    (path / checkpoints.STATE_FILE).write_text(json.dumps(state))
    (path / SEAL_FILE).unlink()
    assert checkpoints.verify_checkpoint(path)["step"] == 2
    assert f"checkpoint {path} predates the seal of trainer_state.json" in capsys.readouterr().out
