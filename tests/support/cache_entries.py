"""Small captured samples for feature-cache tests."""

from __future__ import annotations

import torch

from runtime.shared.contracts import CapturedSample
from runtime.transport.sample_format import build_meta, crc32_chunks, describe_field


def make_sample(g: int, row: int, tokens: int = 6, width: int = 8) -> CapturedSample:
    """A small sample of data row ``row`` as the capture records it (CRC-32 per field), to store as a cache entry."""
    gen = torch.Generator().manual_seed(row)
    fields = {
        "ids": torch.arange(tokens, dtype=torch.int64) + row,
        "mask": torch.ones(tokens, dtype=torch.uint8),
        "hs": torch.randn(tokens, 2 * width, generator=gen).to(torch.bfloat16),
        "lhs": torch.randn(tokens, width, generator=gen).to(torch.bfloat16),
    }
    layouts = [describe_field(name, t, crc32=crc32_chunks(t)) for name, t in fields.items()]
    meta = build_meta(g, layouts, {"g": g, "epoch": 0, "row_index": row})
    return CapturedSample(g=g, meta=meta, **fields)
