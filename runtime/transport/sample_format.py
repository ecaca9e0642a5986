"""How one sample is laid out in the store: raw tensor bytes per field plus a JSON ``meta``.

Each tensor field is stored as its contiguous bytes, nothing else (no pickling, no header), so a
put and a get move exactly ``numel * itemsize`` bytes straight from and into tensor memory. The
``meta`` object, written last, carries what a reader needs to rebuild the tensors (dtype, shape,
bytes) and a checksum of every field, next to the capture's own metadata (epoch, row id, T, H, ...).
A field's checksum is either the CRC-32 of every 64 MiB chunk (host tensors: chunks, so that both
sides compute them on several cores; one CRC-32 stream runs at about 4.5 GB/s) or ``sum16``
(:mod:`runtime.transport.checksum`), which the capture GPU computes on the device for the big
``hs`` / ``lhs`` fields so the host pays no checksum at all; a reader verifies whichever is recorded.
All sizes are Python ints (int64 on the wire): a K3 ``hs`` field is above 2**31 bytes.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from runtime.shared.contracts import META_FIELD, TENSOR_FIELDS
from runtime.transport.checksum import SUM16_CHUNK_BYTES, sum16_values
from runtime.transport.errors import CorruptSampleError

SAMPLE_FORMAT = "dspark-sample/1"
"""Version tag of the stored layout; a reader refuses any other."""

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

# Keys the transport owns inside ``meta``; the capture's metadata may not set them differently.
TRANSPORT_META_KEYS = ("format", "g", "fields", "sample_bytes", "committed_at")

CRC_CHUNK_BYTES = 64 * 2**20
"""Bytes per CRC-32 chunk."""

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


@dataclass(frozen=True)
class FieldLayout:
    """One tensor field as recorded in ``meta``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    num_bytes: int
    crc32: tuple[int, ...] | None
    """CRC-32 of each ``crc32_chunk_bytes`` chunk of the field's bytes (None: not recorded)."""
    crc32_chunk_bytes: int = CRC_CHUNK_BYTES
    sum16: tuple[int, ...] | None = None
    """``s1, s2`` of each ``SUM16_CHUNK_BYTES`` chunk (None: not recorded)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        """The field's torch dtype."""
        return DTYPES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        """The JSON form stored in ``meta['fields']``."""
        out: dict[str, Any] = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "bytes": self.num_bytes,
            "crc32": None if self.crc32 is None else list(self.crc32),
            "crc32_chunk_bytes": self.crc32_chunk_bytes,
        }
        if self.sum16 is not None:
            out.update(sum16=list(self.sum16), sum16_chunk_bytes=SUM16_CHUNK_BYTES)
        return out


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``, exact in Python ints (no allocation)."""
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * torch.empty((), dtype=dtype).element_size()


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor's memory (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor; call .contiguous() first")
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def checksum_pool() -> ThreadPoolExecutor:
    """The process-wide threads that compute CRC-32 chunks (zlib releases the GIL on big buffers)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(
                max_workers=max(1, min(16, os.cpu_count() or 1)), thread_name_prefix="dspark-crc"
            )
        return _POOL


def _crc_of(chunk: torch.Tensor) -> int:
    return zlib.crc32(memoryview(chunk.numpy()))


def submit_crc32_chunks(tensor: torch.Tensor, chunk_bytes: int = CRC_CHUNK_BYTES) -> list[Future[int]]:
    """Start the CRC-32 of each chunk of a contiguous CPU tensor's bytes on the checksum threads."""
    view = byte_view(tensor)
    pool = checksum_pool()
    return [pool.submit(_crc_of, view[start : start + chunk_bytes]) for start in range(0, view.numel(), chunk_bytes)]


def crc32_chunks(tensor: torch.Tensor, chunk_bytes: int = CRC_CHUNK_BYTES) -> tuple[int, ...]:
    """CRC-32 of each chunk of a contiguous CPU tensor's bytes, computed in parallel."""
    return tuple(f.result() for f in submit_crc32_chunks(tensor, chunk_bytes))


def describe_field(
    name: str,
    tensor: torch.Tensor,
    with_checksum: bool = True,
    crc32: tuple[int, ...] | None = None,
    sum16: tuple[int, ...] | None = None,
) -> FieldLayout:
    """The layout of one host tensor as ``meta`` records it (``crc32`` / ``sum16``: a checksum
    already computed; with neither, the chunk CRC-32s are computed here)."""
    dtype_name = DTYPE_NAMES.get(tensor.dtype)
    if dtype_name is None:
        raise ValueError(f"field {name}: dtype {tensor.dtype} is not storable; use one of {sorted(DTYPES)}")
    if crc32 is None and sum16 is None and with_checksum:
        crc32 = crc32_chunks(tensor)
    return FieldLayout(
        name=name,
        dtype=dtype_name,
        shape=tuple(int(d) for d in tensor.shape),
        num_bytes=tensor_nbytes(tuple(tensor.shape), tensor.dtype),
        crc32=crc32,
        sum16=sum16,
    )


def verify_field(g: int, layout: FieldLayout, tensor: torch.Tensor) -> None:
    """Raise CorruptSampleError when the tensor's checksum differs from the layout's (CRC-32 on the
    host; ``sum16`` on the tensor's own device, so a GPU reader verifies where the bytes landed)."""
    if layout.sum16 is not None:
        got_sum = sum16_values(tensor)
        if got_sum != layout.sum16:
            bad = next((i for i, (a, b) in enumerate(zip(got_sum, layout.sum16, strict=False)) if a != b), 0) // 2
            raise CorruptSampleError(
                f"sample g={g}: field {layout.name} differs from what was committed in the chunk at byte "
                f"{bad * SUM16_CHUNK_BYTES} (sum16 checksum on {tensor.device.type})"
            )
    if layout.crc32 is None:
        return
    got = crc32_chunks(tensor.cpu(), layout.crc32_chunk_bytes)
    if got != layout.crc32:
        bad = next(
            (i for i, (a, b) in enumerate(zip(got, layout.crc32, strict=False)) if a != b),
            min(len(got), len(layout.crc32)),
        )
        raise CorruptSampleError(
            f"sample g={g}: field {layout.name} differs from what was committed in the chunk at byte "
            f"{bad * layout.crc32_chunk_bytes} (CRC-32 {got[bad] if bad < len(got) else None} vs "
            f"{layout.crc32[bad] if bad < len(layout.crc32) else None})"
        )


def build_meta(g: int, layouts: list[FieldLayout], capture_meta: Mapping[str, Any]) -> dict[str, Any]:
    """The stored ``meta``: the capture's metadata plus the transport's keys (format, g, fields)."""
    clash = [k for k in TRANSPORT_META_KEYS if k in capture_meta and k != "g"]
    if clash:
        raise ValueError(f"sample g={g}: meta keys {clash} are reserved for the transport; rename them")
    if "g" in capture_meta and int(capture_meta["g"]) != g:
        raise ValueError(f"sample g={g}: meta says g={capture_meta['g']}; the capture mixed up two samples")
    names = [layout.name for layout in layouts]
    if names != list(TENSOR_FIELDS):
        raise ValueError(f"sample g={g}: fields {names}, expected exactly {list(TENSOR_FIELDS)} in that order")
    meta = dict(capture_meta)
    meta.update(
        {
            "format": SAMPLE_FORMAT,
            "g": g,
            "fields": {layout.name: layout.to_json() for layout in layouts},
            "sample_bytes": sum(layout.num_bytes for layout in layouts),
            "committed_at": time.time(),
        }
    )
    return meta


def encode_meta(meta: Mapping[str, Any]) -> bytes:
    """``meta`` as compact UTF-8 JSON."""
    return json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()


def decode_meta(g: int, key: str, raw: bytes) -> dict[str, Any]:
    """Parse and check a stored ``meta``; raises CorruptSampleError naming the key."""
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptSampleError(f"{key}: meta is not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != SAMPLE_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CorruptSampleError(
            f"{key}: meta format is {found!r}, expected {SAMPLE_FORMAT!r}; the producer and the trainer run "
            "different versions of runtime/transport"
        )
    if meta.get("g") != g:
        raise CorruptSampleError(f"{key}: meta records g={meta.get('g')}, expected {g}")
    return meta


def field_layouts(meta: Mapping[str, Any]) -> list[FieldLayout]:
    """The tensor fields recorded in a decoded ``meta``, in write order."""
    fields = meta["fields"]
    out = []
    for name in TENSOR_FIELDS:
        info = fields[name]
        dtype = info["dtype"]
        if dtype not in DTYPES:
            raise CorruptSampleError(f"sample g={meta['g']}: field {name} has unknown dtype {dtype!r}")
        shape = tuple(int(d) for d in info["shape"])
        num_bytes = int(info["bytes"])
        if tensor_nbytes(shape, DTYPES[dtype]) != num_bytes:
            raise CorruptSampleError(
                f"sample g={meta['g']}: field {name} records {num_bytes} bytes for shape {shape} {dtype}"
            )
        crc = info.get("crc32")
        chunk = int(info.get("crc32_chunk_bytes", CRC_CHUNK_BYTES))
        sums = info.get("sum16")
        if sums is not None and int(info.get("sum16_chunk_bytes", SUM16_CHUNK_BYTES)) != SUM16_CHUNK_BYTES:
            raise CorruptSampleError(
                f"sample g={meta['g']}: field {name} records sum16 chunks of {info['sum16_chunk_bytes']} bytes, this "
                f"reader uses {SUM16_CHUNK_BYTES}; the producer and the trainer run different versions of runtime/transport"
            )
        out.append(
            FieldLayout(
                name,
                dtype,
                shape,
                num_bytes,
                None if crc is None else tuple(crc),
                chunk,
                None if sums is None else tuple(int(v) for v in sums),
            )
        )
    return out


def sample_keys(store_id: str, g: int) -> list[str]:
    """The five keys of sample ``g``: the tensor fields in write order, then ``meta``."""
    from runtime.shared.contracts import sample_key

    return [sample_key(store_id, g, name) for name in (*TENSOR_FIELDS, META_FIELD)]
