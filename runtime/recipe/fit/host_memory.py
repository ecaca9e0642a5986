"""What lives in each node's host memory: its share of the Mooncake sample segment, and on the
capture node the streamed experts of all its GPUs."""

from __future__ import annotations

from runtime.recipe.fit.expert_streaming import target_streaming_split
from runtime.recipe.schema import Recipe
from runtime.recipe.sizes import segment_shares
from runtime.recipe.streaming_budget import StreamingBudgetError


def host_needs_per_node(recipe: Recipe, streamed_expert_bytes: int = 0) -> dict[str, dict[str, int]]:
    """What lives in the host memory of each node (``capture``, ``trainer``), by use: its share of
    the Mooncake sample segment, and on the capture node ``streamed_expert_bytes``."""
    tr = recipe.transport
    capture_share, trainer_share = segment_shares(tr.global_segment_bytes, tr.segment_placement)
    segment = f"Mooncake segment ({tr.segment_placement} share of transport.global_segment_bytes)"
    capture = {segment: capture_share}
    if streamed_expert_bytes:
        capture = {"streamed experts": streamed_expert_bytes, **capture}
    return {"capture": capture, "trainer": {segment: trainer_share}}


def streamed_expert_host_bytes(recipe: Recipe) -> int:
    """Expert bytes the capture node keeps in host memory for all its GPUs under
    ``capture.expert_streaming`` (0 when streaming is off or its split is refused)."""
    try:
        split = target_streaming_split(recipe)
    except (StreamingBudgetError, ValueError):
        return 0
    return 0 if split is None else split.host_bytes * recipe.job.capture.gpus_per_node
