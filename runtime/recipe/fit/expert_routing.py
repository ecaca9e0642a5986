"""How many routed experts a prefill touches (uniform routing).

A prefill of T tokens routes T x top_k entries over E experts per layer, so an expert is left
untouched with probability (1 - 1/E)^(T x top_k): zero in practice for K3 at any T above a few
hundred tokens, so every expert held in host memory crosses PCIe once per prefill.
"""

from __future__ import annotations

import math

K3_ROUTED_EXPERTS = 896
K3_TOP_K = 16
MXFP4_BITS_PER_WEIGHT = 4.25
"""E2M1 value (4 bits) plus one 8-bit E8M0 scale per 32 weights."""


def untouched_expert_fraction(num_tokens: int, top_k: int, num_experts: int) -> float:
    """Expected fraction of experts no token of a prefill routes to (uniform routing)."""
    return math.exp(num_tokens * top_k * math.log1p(-1.0 / num_experts))
