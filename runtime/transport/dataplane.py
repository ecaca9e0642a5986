"""The two doors into the data plane: :func:`open_producer` (capture) and :func:`open_consumer` (trainer).

Nobody else touches Mooncake. Endpoints come from the launcher's environment contract
(``DSPARK_MOONCAKE_MASTER``, ``DSPARK_MOONCAKE_METADATA``, ``DSPARK_BIND_ADDRESS``) unless given
explicitly (tests, tools). The master itself is started by the capture component through
:mod:`runtime.transport.master` when ``capture.owns_master`` is set.

Typical use::

    with open_producer(resolved) as producer:            # capture node
        while True:
            for g in producer.wait_next(max_count=batch):
                producer.commit(g, tensors_of(g), meta_of(g))

    consumer = open_consumer(resolved, rank, world)        # each trainer rank
    consumer.publish_cursor(cursor_from_checkpoint)        # rank 0, first thing
    for g in consumer.samples_of_step(step):
        sample = consumer.fetch(g, device)
    ...optimizer step...
    consumer.commit_step(step)
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from runtime.recipe.capture_layout import capture_shares, nodes_per_engine
from runtime.recipe.loader import ResolvedRecipe
from runtime.recipe.sizes import segment_shares
from runtime.shared.contracts import ENV_TASK_RANK
from runtime.transport.consumer import Consumer
from runtime.transport.endpoints import Endpoints
from runtime.transport.producer import Producer
from runtime.transport.store import ClientSettings, StoreClient

PRODUCER_STATE_FILE = "producer_state.json"
CONTROL_SEGMENT_BYTES = 16 * 2**20
"""Trainer rank 0 mounts this much (Mooncake's minimum) to hold the cursor it publishes: the cursor
lives with its authority, so it survives a producer crash and can be published before the
producer is up. With ``transport.segment_placement: capture`` samples never land there (the
producer pins them to its own segment); with ``trainer`` or ``split`` rank 0 mounts the trainer
node's share of the sample segment on top of it."""

_FRESH_RUN = object()


def producer_state_path(resolved: ResolvedRecipe, share: int = 0) -> Path:
    """Where the producer keeps the last cursor it saw (the job folder survives a producer restart)."""
    name = PRODUCER_STATE_FILE if share == 0 else PRODUCER_STATE_FILE.replace(".json", f".{share}.json")
    return resolved.job_dir / "transport" / name


def capture_share_of_this_task(resolved: ResolvedRecipe) -> tuple[int, int]:
    """(index, count) of the capture share this process belongs to: its capture task's rank
    (``DSPARK_TASK_RANK``, one task per node) over the nodes one engine spans. The SGLang server's
    sink inherits the variable from its capture task, so it lands in the same share."""
    count = capture_shares(resolved.recipe)
    rank = int(os.environ.get(ENV_TASK_RANK, "0") or 0)
    return (rank // nodes_per_engine(resolved.recipe)) % count, count


def open_producer(
    resolved: ResolvedRecipe,
    *,
    endpoints: Endpoints | None = None,
    start_cursor: int | None | object = _FRESH_RUN,
    segment_bytes: int | None = None,
    auto_heartbeat: bool = True,
    share: tuple[int, int] | None = None,
) -> Producer:
    """Connect the capture node's producer: it mounts the global segment and owns the window.

    ``start_cursor``: where to start when the store has no cursor and this job saw none before.
    By default 0 for a fresh run and None (wait for the trainer to publish) when the recipe
    resumes from a checkpoint or keeps the whole sample segment on the trainer node.
    ``share``: which g this producer captures (default: :func:`capture_share_of_this_task`).
    """
    share = share or capture_share_of_this_task(resolved)
    recipe = resolved.recipe
    endpoints = endpoints or Endpoints.from_env(recipe)
    if start_cursor is _FRESH_RUN:
        # With the whole sample segment on the trainer node nothing can be put before trainer rank 0
        # has mounted it: wait for its cursor, which it publishes after mounting.
        fresh = recipe.trainer.checkpoint.resume_from is None and recipe.transport.segment_placement != "trainer"
        start_cursor = 0 if fresh else None
    tr = recipe.transport
    capture_share, _ = segment_shares(tr.global_segment_bytes, tr.segment_placement)
    segment = capture_share if segment_bytes is None else segment_bytes
    settings = dataclasses.replace(
        ClientSettings.from_recipe(recipe, endpoints, segment),
        pin_writes_to_own_segment=tr.segment_placement == "capture",
    )
    client = StoreClient(settings, name="producer").connect()
    try:
        return Producer(
            client,
            recipe,
            state_path=producer_state_path(resolved, share[0]),
            start_cursor=start_cursor,  # type: ignore[arg-type]
            auto_heartbeat=auto_heartbeat,
            share=share,
        )
    except BaseException:
        client.close()
        raise


def open_consumer(
    resolved: ResolvedRecipe,
    rank: int,
    world_size: int,
    *,
    endpoints: Endpoints | None = None,
    start_cursor: int | None = None,
) -> Consumer:
    """Connect one trainer rank. Rank 0 mounts a 16 MiB control segment for the cursor plus the
    trainer node's share of the sample segment (``transport.segment_placement``), the other ranks
    none.

    With ``start_cursor`` rank 0 publishes it at once (the cursor of the checkpoint it resumes
    from, 0 for a fresh run); otherwise call :meth:`Consumer.publish_cursor` when it is known.
    """
    recipe = resolved.recipe
    endpoints = endpoints or Endpoints.from_env(recipe)
    _, trainer_share = segment_shares(recipe.transport.global_segment_bytes, recipe.transport.segment_placement)
    segment = CONTROL_SEGMENT_BYTES + trainer_share if rank == 0 else 0
    client = StoreClient(ClientSettings.from_recipe(recipe, endpoints, segment), name=f"trainer rank {rank}").connect()
    try:
        consumer = Consumer(client, recipe, rank, world_size)
        if start_cursor is not None and rank == 0:
            consumer.publish_cursor(start_cursor)
        return consumer
    except BaseException:
        client.close()
        raise
