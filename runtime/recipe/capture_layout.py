"""How the capture component is laid out over its nodes: how many nodes one engine spans, and how
many independent engine + producer pairs (capture shares) the job runs."""

from __future__ import annotations

import math

from runtime.recipe.schema import Recipe


def nodes_per_engine(recipe: Recipe) -> int:
    """Capture nodes one engine spans: an SGLang server whose ``tp_size`` exceeds a node's GPUs
    runs across nodes; the embedded engine stays on one node."""
    c, gpus = recipe.capture, recipe.job.capture.gpus_per_node
    if c.engine == "sglang" and gpus:
        return max(1, math.ceil(c.sglang.tp_size / gpus))
    return 1


def capture_shares(recipe: Recipe) -> int:
    """Independent engine + producer pairs of the capture component: ``job.capture.nodes`` over
    :func:`nodes_per_engine`. Share ``k`` captures the g with ``g % shares == k``."""
    return max(1, recipe.job.capture.nodes // nodes_per_engine(recipe))
