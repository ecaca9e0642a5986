"""How one sample is laid out in the store: raw tensor bytes per field plus a JSON ``meta``.

Each tensor field is stored as its contiguous bytes, nothing else (no pickling, no header), so a
put and a get move exactly ``numel * itemsize`` bytes straight from and into tensor memory. The
``meta`` object, written last, carries what a reader needs to rebuild the tensors (dtype, shape,
bytes) and a CRC-32 per field, next to the capture's own metadata (epoch, row id, T, H, ...).
All sizes are Python ints (int64 on the wire): a K3 ``hs`` field is above 2**31 bytes.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from runtime.transport.contract import META_FIELD, TENSOR_FIELDS
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


@dataclass(frozen=True)
class FieldLayout:
    """One tensor field as recorded in ``meta``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    num_bytes: int
    crc32: int | None

    @property
    def torch_dtype(self) -> torch.dtype:
        """The field's torch dtype."""
        return DTYPES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        """The JSON form stored in ``meta['fields']``."""
        return {"dtype": self.dtype, "shape": list(self.shape), "bytes": self.num_bytes, "crc32": self.crc32}


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


def crc32_of(tensor: torch.Tensor) -> int:
    """CRC-32 of a contiguous CPU tensor's bytes (zlib releases the GIL on large buffers)."""
    view = byte_view(tensor)
    if view.numel() == 0:
        return 0
    return zlib.crc32(memoryview(view.numpy()))


def describe_field(name: str, tensor: torch.Tensor, with_checksum: bool = True) -> FieldLayout:
    """The layout of one host tensor as ``meta`` records it."""
    dtype_name = DTYPE_NAMES.get(tensor.dtype)
    if dtype_name is None:
        raise ValueError(f"field {name}: dtype {tensor.dtype} is not storable; use one of {sorted(DTYPES)}")
    return FieldLayout(
        name=name,
        dtype=dtype_name,
        shape=tuple(int(d) for d in tensor.shape),
        num_bytes=tensor_nbytes(tuple(tensor.shape), tensor.dtype),
        crc32=crc32_of(tensor) if with_checksum else None,
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
        out.append(FieldLayout(name, dtype, shape, num_bytes, info.get("crc32")))
    return out


def sample_keys(store_id: str, g: int) -> list[str]:
    """The five keys of sample ``g``: the tensor fields in write order, then ``meta``."""
    from runtime.transport.contract import sample_key

    return [sample_key(store_id, g, name) for name in (*TENSOR_FIELDS, META_FIELD)]
