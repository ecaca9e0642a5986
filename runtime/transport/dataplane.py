"""The two doors into the data plane: :func:`open_producer` (capture) and :func:`open_consumer` (trainer).

Nobody else touches Mooncake. Endpoints come from the launcher's environment contract
(``DSPARK_MOONCAKE_MASTER``, ``DSPARK_MOONCAKE_METADATA``, ``DSPARK_BIND_ADDRESS``) unless given
explicitly (tests, tools). Both take the transport's typed settings
(:class:`~runtime.transport.settings.TransportSettings`, built once by the process entry's setup), never
the recipe. The master itself is started by the capture component through
:mod:`runtime.transport.master` when ``capture.owns_master`` is set.

Typical use::

    with open_producer(transport, job_dir) as producer:  # capture node
        while True:
            for g in producer.wait_next(max_count=batch):
                producer.commit(g, tensors_of(g), meta_of(g))

    consumer = open_consumer(transport, rank, world)       # each trainer rank
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

from runtime.shared.contracts import ENV_TASK_RANK
from runtime.transport.consumer import Consumer
from runtime.transport.endpoints import Endpoints
from runtime.transport.producer import Producer
from runtime.transport.settings import TransportSettings
from runtime.transport.store import StoreClient

PRODUCER_STATE_FILE = "producer_state.json"
CONTROL_SEGMENT_BYTES = 16 * 2**20
"""Trainer rank 0 mounts this much (Mooncake's minimum) to hold the cursor it publishes: the cursor
lives with its authority, so it survives a producer crash and can be published before the
producer is up. With ``transport.segment_placement: capture`` samples never land there (the
producer pins them to its own segment); with ``trainer`` or ``split`` rank 0 mounts the trainer
node's share of the sample segment on top of it."""

_FRESH_RUN = object()


def producer_state_path(job_dir: Path, share: int = 0) -> Path:
    """Where the producer keeps the last cursor it saw (the job folder survives a producer restart)."""
    name = PRODUCER_STATE_FILE if share == 0 else PRODUCER_STATE_FILE.replace(".json", f".{share}.json")
    return job_dir / "transport" / name


def capture_share_of_this_task(settings: TransportSettings) -> tuple[int, int]:
    """(index, count) of the capture share this process belongs to: its capture task's rank
    (``DSPARK_TASK_RANK``, one task per node) over the nodes one engine spans. The SGLang server's
    sink inherits the variable from its capture task, so it lands in the same share."""
    count = settings.capture_shares
    rank = int(os.environ.get(ENV_TASK_RANK, "0") or 0)
    return (rank // settings.nodes_per_engine) % count, count


def open_producer(
    settings: TransportSettings,
    job_dir: Path,
    *,
    endpoints: Endpoints | None = None,
    start_cursor: int | None | object = _FRESH_RUN,
    segment_bytes: int | None = None,
    auto_heartbeat: bool = True,
    share: tuple[int, int] | None = None,
) -> Producer:
    """Connect the capture node's producer: it mounts the global segment and owns the window; its
    cursor state lives in ``job_dir``.

    ``start_cursor``: where to start when the store has no cursor and this job saw none before.
    By default 0 for a fresh run and None (wait for the trainer to publish) when the recipe
    resumes from a checkpoint or keeps the whole sample segment on the trainer node.
    ``share``: which g this producer captures (default: :func:`capture_share_of_this_task`).
    """
    share = share or capture_share_of_this_task(settings)
    endpoints = endpoints or settings.endpoints_from_env()
    if start_cursor is _FRESH_RUN:
        start_cursor = 0 if settings.producer_may_start_at_zero else None
    segment = settings.capture_segment_bytes if segment_bytes is None else segment_bytes
    client_settings = dataclasses.replace(
        settings.client(endpoints, segment),
        pin_writes_to_own_segment=settings.segment_placement == "capture",
    )
    client = StoreClient(client_settings, name="producer").connect()
    try:
        return Producer(
            client,
            settings.producer,
            state_path=producer_state_path(job_dir, share[0]),
            start_cursor=start_cursor,  # type: ignore[arg-type]
            auto_heartbeat=auto_heartbeat,
            share=share,
        )
    except BaseException:
        client.close()
        raise


def open_consumer(
    settings: TransportSettings,
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
    endpoints = endpoints or settings.endpoints_from_env()
    segment = CONTROL_SEGMENT_BYTES + settings.trainer_segment_bytes if rank == 0 else 0
    client = StoreClient(settings.client(endpoints, segment), name=f"trainer rank {rank}").connect()
    try:
        consumer = Consumer(client, settings.consumer, rank, world_size)
        if start_cursor is not None and rank == 0:
            consumer.publish_cursor(start_cursor)
        return consumer
    except BaseException:
        client.close()
        raise
