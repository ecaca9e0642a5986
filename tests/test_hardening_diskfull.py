"""Issue 15, item 6: a checkpoint save on a full disk says "disk full at PATH, need N bytes" in its
error (which the trainer's refusal line says once on stderr; issue 35: not twice), leaves no temp files, and keeps the previous checkpoint intact. A real
tmpfs of 1 MiB stands in for the full disk (needs root to mount)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from runtime.trainer import checkpoints
from tests.support.trainer_runs import save_one_rank

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_disk_full_names_path_and_bytes_and_leaves_no_temp_files(small_disk: Path, capfd) -> None:
    small = torch.nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(small.parameters())
    first = save_one_rank(small_disk, small, optimizer, 1, keep_last=5)  # fits
    big = torch.nn.Linear(512, 512)  # 1 MiB of weights + 2 MiB of moments: does not fit
    big_optimizer = torch.optim.AdamW(big.parameters())
    big(torch.randn(2, 512)).sum().backward()
    big_optimizer.step()
    with pytest.raises(checkpoints.CheckpointError) as err:
        save_one_rank(small_disk, big, big_optimizer, 2, keep_last=5)
    message = str(err.value)
    assert message.startswith(f"disk full at {small_disk} while saving step_00000002: need about ")
    assert "bytes" in message and "previous checkpoints are intact" in message
    assert message not in capfd.readouterr().err, "said once, by the trainer's refusal line, not here too"
    assert not list(small_disk.glob(f"{checkpoints.TMP_PREFIX}*")), "no temp folder left"
    assert checkpoints.find_latest(small_disk) == first.path
    checkpoints.verify_checkpoint(first.path)  # still whole
