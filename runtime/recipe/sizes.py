"""Byte arithmetic of the capture contract, exact in Python integers.

Python ints never overflow, so these are the reference that int64 code elsewhere is checked
against: for K3, ``T * n_aux * H = 65,536 * 5 * 7,168`` is above 2**31.
"""

from __future__ import annotations

from dataclasses import dataclass

FEATURE_BYTES_PER_ELEMENT = 2  # hs and lhs are bf16
META_BUDGET_BYTES = 4096  # generous bound on the JSON meta object


@dataclass(frozen=True)
class SampleSize:
    """Bytes of every field of one captured sample of ``num_tokens`` tokens."""

    num_tokens: int
    num_aux_layers: int
    hidden_size: int

    @property
    def ids_bytes(self) -> int:
        """``ids``: int64 [T]."""
        return self.num_tokens * 8

    @property
    def mask_bytes(self) -> int:
        """``mask``: uint8 [T]."""
        return self.num_tokens

    @property
    def hs_bytes(self) -> int:
        """``hs``: bf16 [T, n_aux * H]."""
        return self.num_tokens * self.num_aux_layers * self.hidden_size * FEATURE_BYTES_PER_ELEMENT

    @property
    def lhs_bytes(self) -> int:
        """``lhs``: bf16 [T, H]."""
        return self.num_tokens * self.hidden_size * FEATURE_BYTES_PER_ELEMENT

    @property
    def feature_bytes(self) -> int:
        """``T x (n_aux + 1) x H x 2``: the hidden-state features alone."""
        return self.hs_bytes + self.lhs_bytes

    @property
    def total_bytes(self) -> int:
        """Every field including a bound on ``meta``: what one sample occupies in the store."""
        return self.ids_bytes + self.mask_bytes + self.feature_bytes + META_BUDGET_BYTES

    def field_bytes(self) -> dict[str, int]:
        """Bytes per tensor field, keyed by field name."""
        return {
            "ids": self.ids_bytes,
            "mask": self.mask_bytes,
            "hs": self.hs_bytes,
            "lhs": self.lhs_bytes,
        }


def segment_shares(global_segment_bytes: int, placement: str) -> tuple[int, int]:
    """Bytes of the sample segment on (the capture node, the trainer node) for
    ``transport.segment_placement``."""
    if placement == "capture":
        return global_segment_bytes, 0
    if placement == "trainer":
        return 0, global_segment_bytes
    if placement == "split":
        return global_segment_bytes // 2, global_segment_bytes - global_segment_bytes // 2
    raise ValueError(f"transport.segment_placement {placement!r} is not capture, trainer or split")
