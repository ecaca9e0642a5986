"""The feature cache's entry reader (runtime/trainer/entry_reader.py): it reads what safetensors
wrote, byte for byte, across chunk boundaries, dtypes and parallel readers, and names the file for
every kind of damage.
The GPU test (pinned chunks, copies queued on a side stream) runs on the H200 device machine."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runtime.trainer.entry_reader import EntryReader
from runtime.transport.errors import CorruptSampleError

NAMES = ("ids", "mask", "hs", "flags", "empty", "half")


def write_entry(path: Path) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    tensors = {
        "ids": torch.randint(-(2**40), 2**40, (37,), generator=gen, dtype=torch.int64),
        "mask": torch.randint(0, 2, (37,), generator=gen, dtype=torch.uint8),
        "hs": torch.randn(37, 11, generator=gen).to(torch.bfloat16),
        "flags": torch.rand(5, generator=gen) > 0.5,
        "empty": torch.empty(0, 4, dtype=torch.float32),
        "half": torch.randn(3, 3, generator=gen).to(torch.float16),
    }
    save_file(tensors, str(path), metadata={"meta": '{"g": 1}', "row_index": "4"})
    return tensors


@pytest.mark.parametrize(("chunk_bytes", "threads"), [(1, 8), (7, 3), (64, 1), (2**20, 8)])
def test_reads_what_safetensors_wrote_across_chunk_boundaries(tmp_path: Path, chunk_bytes: int, threads: int) -> None:
    path = tmp_path / "entry.safetensors"
    written = write_entry(path)
    reader = EntryReader(chunk_bytes=chunk_bytes, threads=threads)
    for _ in range(2):  # the chunk buffers are reused by the second read
        metadata, got = reader.read(path, NAMES)
        assert metadata == {"meta": '{"g": 1}', "row_index": "4"}
        for name in NAMES:
            assert got[name].dtype == written[name].dtype and got[name].shape == written[name].shape
            assert torch.equal(got[name].view(-1).view(torch.uint8), written[name].view(-1).view(torch.uint8)), name
    with safe_open(str(path), framework="pt") as handle:  # and agrees with safetensors' own reader
        assert torch.equal(handle.get_tensor("hs"), got["hs"])


def test_a_truncated_file_names_itself(tmp_path: Path) -> None:
    path = tmp_path / "entry.safetensors"
    write_entry(path)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CorruptSampleError, match=f"{path}: tensor .* claims bytes .* of a {len(data) - 10}-byte file"):
        EntryReader().read(path, NAMES)
    path.write_bytes(data[:5])
    with pytest.raises(CorruptSampleError, match="shorter than a safetensors header"):
        EntryReader().read(path, NAMES)


def test_a_damaged_header_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "entry.safetensors"
    write_entry(path)
    data = bytearray(path.read_bytes())
    (header_bytes,) = struct.unpack("<Q", data[:8])
    path.write_bytes(struct.pack("<Q", len(data)) + data[8:])  # a length past the end
    with pytest.raises(CorruptSampleError, match="header length .* does not fit"):
        EntryReader().read(path, NAMES)
    damaged = bytearray(data)
    damaged[8] = ord("x")  # not JSON any more
    path.write_bytes(bytes(damaged))
    with pytest.raises(CorruptSampleError, match=f"{path}: unreadable safetensors header"):
        EntryReader().read(path, NAMES)
    header = bytes(data[8 : 8 + header_bytes]).replace(b'"shape":[37,11]', b'"shape":[36,11]')
    assert len(header) == header_bytes
    path.write_bytes(bytes(data[:8]) + header + bytes(data[8 + header_bytes :]))
    with pytest.raises(CorruptSampleError, match="tensor 'hs' \\(BF16 \\[36, 11\\]\\) claims bytes"):
        EntryReader().read(path, NAMES)
    write_entry(path)
    with pytest.raises(CorruptSampleError, match="no tensor 'lhs'"):
        EntryReader().read(path, ("ids", "lhs"))


@pytest.mark.gpu
def test_reads_onto_the_gpu_through_pinned_chunks_on_a_side_stream(tmp_path: Path) -> None:
    path = tmp_path / "entry.safetensors"
    written = write_entry(path)
    big = torch.randn(4096, 1024).to(torch.bfloat16)  # 8 MiB: many 64 KiB chunks in rotation
    save_file({**written, "big": big}, str(path))
    reader = EntryReader(chunk_bytes=64 * 1024)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            _, got = reader.read(path, (*NAMES, "big"), torch.device("cuda"))
            queued_after = got["big"].float().sum()  # queued behind the copies on the same stream
    side.synchronize()
    for name, tensor in {**written, "big": big}.items():
        assert got[name].is_cuda and torch.equal(got[name].cpu(), tensor), name
    assert torch.allclose(queued_after.cpu(), big.float().sum(), rtol=1e-5)
