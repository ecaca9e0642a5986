"""Read a feature-cache entry (a safetensors file) straight onto the trainer's device.

Why not ``safetensors.safe_open(...).get_tensor(name).to(device)``: that hands back a tensor in
pageable host memory, and a pageable host-to-device copy runs at about 8 GB/s on our H200 (MEASURED.md)
after the disk read, not beside it. A K3 entry is 5.25 GiB, read once per sample in every epoch after
the first, so the cache would bound those epochs at well under the NVMe's rate. Here each field's byte
range is read with plain ``readinto`` calls into a few reused chunk buffers (pinned on CUDA), and each
chunk's copy to the device is queued on the current stream while the next chunk is read from disk:
disk and PCIe overlap, and the rate is the slower of the two (pinned copies: about 55 GB/s). On the
CPU the same chunks are copied synchronously, so the CPU tests exercise the same offset arithmetic.

The file format is safetensors' own: an 8-byte little-endian header length, a JSON header naming
each tensor's dtype, shape and byte range in the data section, then the data. The header is checked
against the file (ranges inside it, sizes that match the shapes); any mismatch is a corrupt entry.
"""

from __future__ import annotations

import io
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.transport.errors import CorruptSampleError

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 * 2**20
"""A larger header is not one we wrote (ours are a few KB)."""
CHUNK_BYTES = 64 * 2**20
"""Bytes per disk read and per queued device copy."""
CHUNK_BUFFERS = 3
"""Chunk buffers in rotation: one being read while the copies of the others run."""


@dataclass(frozen=True)
class EntryField:
    """One tensor of the file: dtype, shape and absolute byte range."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: Path, handle: io.FileIO) -> tuple[dict[str, str], dict[str, EntryField]]:
    """The file's ``__metadata__`` and its tensors' layouts, checked against the file's size."""
    size = os.fstat(handle.fileno()).st_size
    prefix = handle.read(8)
    if len(prefix) != 8:
        raise CorruptSampleError(f"{path}: {size} bytes, shorter than a safetensors header")
    (header_bytes,) = struct.unpack("<Q", prefix)
    if header_bytes > min(MAX_HEADER_BYTES, size - 8):
        raise CorruptSampleError(f"{path}: header length {header_bytes} does not fit the file's {size} bytes")
    try:
        header = json.loads(handle.read(header_bytes))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptSampleError(f"{path}: unreadable safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise CorruptSampleError(f"{path}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_bytes
    fields: dict[str, EntryField] = {}
    for name, spec in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[spec["dtype"]]
            shape = tuple(int(d) for d in spec["shape"])
            begin, end = (data_start + int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptSampleError(f"{path}: tensor {name!r} has a malformed header entry ({exc})") from exc
        numel = 1
        for d in shape:
            numel *= d
        if not data_start <= begin <= end <= size or end - begin != numel * dtype.itemsize:
            raise CorruptSampleError(
                f"{path}: tensor {name!r} ({spec['dtype']} {list(shape)}) claims bytes {begin}..{end} of a "
                f"{size}-byte file (truncated or damaged)"
            )
        fields[name] = EntryField(dtype, shape, begin, end)
    return metadata, fields


class EntryReader:
    """Reads entries onto a device through reused chunk buffers (one reader per thread)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._buffers: list[torch.Tensor] = []
        self._pinned = False
        self._copied: list[torch.cuda.Event | None] = []
        self._next = 0

    def read(
        self, path: Path, names: tuple[str, ...], device: torch.device | str | None = None
    ) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
        """The file's metadata and the named tensors on ``device`` (CPU when None). On CUDA the
        copies are queued on the current stream: work queued after this call sees the data."""
        target = torch.device(device) if device is not None else torch.device("cpu")
        with open(path, "rb", buffering=0) as handle:
            metadata, fields = read_header(path, handle)
            missing = [name for name in names if name not in fields]
            if missing:
                raise CorruptSampleError(f"{path}: no tensor {missing[0]!r} in the file")
            tensors: dict[str, torch.Tensor] = {}
            for name in names:
                field = fields[name]
                tensor = torch.empty(field.shape, dtype=field.dtype, device=target)
                self._read_range(path, handle, field, tensor.view(-1).view(torch.uint8))
                tensors[name] = tensor
        return metadata, tensors

    def _read_range(self, path: Path, handle: io.FileIO, field: EntryField, dest: torch.Tensor) -> None:
        """Fill ``dest`` (the field's bytes on their device) from the file, chunk by chunk."""
        handle.seek(field.begin)
        total = field.end - field.begin
        offset = 0
        while offset < total:
            count = min(self.chunk_bytes, total - offset)
            index, buffer = self._free_buffer(pinned=dest.is_cuda)
            view = memoryview(buffer.numpy())[:count]
            got = 0
            while got < count:  # readinto may return less than asked
                n = handle.readinto(view[got:])
                if not n:
                    raise CorruptSampleError(f"{path}: ended {total - offset - got} bytes before its last tensor's end")
                got += n
            dest[offset : offset + count].copy_(buffer[:count], non_blocking=dest.is_cuda)
            if dest.is_cuda:
                self._copied[index] = torch.cuda.current_stream(dest.device).record_event()
            offset += count

    def _free_buffer(self, pinned: bool) -> tuple[int, torch.Tensor]:
        """The next chunk buffer in rotation, once the device copy out of it (if any) has finished."""
        if not self._buffers or self._pinned != pinned:
            for copied in self._copied:  # the old buffers may still be the source of a queued copy
                if copied is not None:
                    copied.synchronize()
            self._buffers = [
                torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(CHUNK_BUFFERS)
            ]
            self._pinned = pinned
            self._copied = [None] * CHUNK_BUFFERS
        index = self._next
        self._next = (index + 1) % CHUNK_BUFFERS
        copied = self._copied[index]
        if copied is not None:
            copied.synchronize()
            self._copied[index] = None
        return index, self._buffers[index]
