"""Every trainer rank watches the others, so that no rank waits silently on a hung peer.

A rank that is stopped (SIGSTOP), hung with its process frozen, or cut off with its node leaves the
other ranks inside a collective until the process group's timeout (``transport.idle_timeout_s`` +
:data:`runtime.trainer.distributed.COLLECTIVE_MARGIN_S`), without a line. Here each rank runs a
small thread that beats in the rendezvous store (a counter that only a live process advances) and
reads the others' counters: a peer whose counter has not moved for :data:`SILENT_AFTER_S` is named in
a log line every :data:`REPORT_EVERY_S`, and after ``transport.idle_timeout_s`` of silence this
rank stops with one clear message instead of waiting out the collective timeout.

The counters are compared with this rank's own clock (no clock agreement between nodes needed).
A rank busy in a long step still beats: the thread runs beside the main thread.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

log = logging.getLogger("dspark.trainer.peers")

BEAT_INTERVAL_S = 2.0
"""How often each rank advances its counter and reads the others'."""
SILENT_AFTER_S = 10.0
"""A peer silent this long is reported (it is then either stopped, frozen, or unreachable)."""
REPORT_EVERY_S = 15.0
"""How often a silent peer is reported again."""
STORE_TIMEOUT_S = 5.0
"""Bound on one store call; a store that does not answer counts as silence of rank 0, its host."""
EXIT_PEER_LOST = 75
"""Exit status of a rank that gave up on a silent peer (EX_TEMPFAIL: a rerun or resume may succeed)."""
KEY_PREFIX = "dspark/peer_watch/"


class PeerLost(RuntimeError):
    """Another trainer rank fell silent for longer than ``transport.idle_timeout_s``."""


@dataclass
class PeerView:
    """What this rank last knew of one peer."""

    count: int = -1
    step: int = -1
    changed_at: float = 0.0
    reported_at: float = 0.0


class PeerWatch:
    """Beat for this rank and watch the other ranks of the process group (a daemon thread)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        give_up_after_s: float,
        on_give_up: Callable[[str], None] | None = None,
        beat_interval_s: float = BEAT_INTERVAL_S,
        silent_after_s: float = SILENT_AFTER_S,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.address = (master_addr, master_port)
        self.give_up_after_s = give_up_after_s
        self.on_give_up = on_give_up
        self.beat_interval_s = beat_interval_s
        self.silent_after_s = min(silent_after_s, give_up_after_s)
        self.step = -1
        """The main thread's current step (shown to the peers in their messages)."""
        self._count = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: dist.TCPStore | None = None
        self._store_silent_since: float | None = None
        self._store_reported_at = 0.0

    # ------------------------------------------------------------------ lifetime

    def start(self) -> PeerWatch:
        """Start beating and watching (after the process group's rendezvous: every peer is alive then)."""
        if self.world_size > 1 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dspark-peer-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (before the final barrier's peers may exit and stop beating)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.beat_interval_s + STORE_TIMEOUT_S + 1)
            self._thread = None

    # ------------------------------------------------------------------ the thread

    def _connect(self) -> dist.TCPStore:
        if self._store is None:
            # Its own client connection: the process group's store is not shared with this thread.
            self._store = dist.TCPStore(
                self.address[0],
                self.address[1],
                None,
                False,
                timeout=dt.timedelta(seconds=STORE_TIMEOUT_S),
            )
        return self._store

    def _loop(self) -> None:
        peers = {r: PeerView(changed_at=time.monotonic()) for r in range(self.world_size) if r != self.rank}
        while not self._stop.wait(self.beat_interval_s):
            now = time.monotonic()
            try:
                store = self._connect()
                self._count += 1
                store.set(f"{KEY_PREFIX}{self.rank}", json.dumps({"count": self._count, "step": self.step}))
                for rank, view in peers.items():
                    key = f"{KEY_PREFIX}{rank}"
                    if not store.check([key]):
                        continue
                    beat = json.loads(store.get(key))
                    if beat["count"] != view.count:
                        view.count, view.step, view.changed_at = beat["count"], beat["step"], now
                self._store_silent_since = None
            except Exception as exc:  # noqa: BLE001 - any store failure means rank 0's store did not answer
                self._store = None
                if self._store_silent_since is None:
                    self._store_silent_since = now
                self._judge_store(now, exc)
                continue
            for rank, view in peers.items():
                self._judge(rank, view, now)

    def _judge(self, rank: int, view: PeerView, now: float) -> None:
        silent_s = now - view.changed_at
        if silent_s < self.silent_after_s:
            return
        where = f"last seen at step {view.step}" if view.step >= 0 else "not seen since the start"
        if silent_s >= self.give_up_after_s:
            self._give_up(
                f"trainer rank {self.rank}: rank {rank} has been silent for {silent_s:.0f} s ({where}; "
                f"transport.idle_timeout_s is {self.give_up_after_s:.0f} s): it is stopped (SIGSTOP), frozen "
                f"or its node is unreachable; stopping this rank (exit {EXIT_PEER_LOST}). Look at rank {rank}'s "
                "log and process, then resume from the last checkpoint"
            )
        elif now - view.reported_at >= REPORT_EVERY_S:
            view.reported_at = now
            log.warning(
                "rank %d: rank %d silent for %.0f s (%s): stopped, frozen or unreachable? giving up at %.0f s "
                "(transport.idle_timeout_s)",
                self.rank,
                rank,
                silent_s,
                where,
                self.give_up_after_s,
            )

    def _judge_store(self, now: float, exc: Exception) -> None:
        assert self._store_silent_since is not None
        silent_s = now - self._store_silent_since
        store = f"{self.address[0]}:{self.address[1]}"
        if silent_s >= self.give_up_after_s:
            self._give_up(
                f"trainer rank {self.rank}: the rendezvous store on rank 0 ({store}) has not answered for "
                f"{silent_s:.0f} s (transport.idle_timeout_s is {self.give_up_after_s:.0f} s; last error: {exc}): "
                f"rank 0 is stopped, frozen or unreachable; stopping this rank (exit {EXIT_PEER_LOST})"
            )
        elif silent_s >= self.silent_after_s and now - self._store_reported_at >= REPORT_EVERY_S:
            self._store_reported_at = now
            log.warning(
                "rank %d: the rendezvous store on rank 0 (%s) has not answered for %.0f s (%s); giving up at %.0f s",
                self.rank,
                store,
                silent_s,
                exc,
                self.give_up_after_s,
            )

    def _give_up(self, message: str) -> None:
        # The main thread sits in a collective that no Python code can interrupt: leave the process.
        print(f"[trainer] {message}", file=sys.stderr, flush=True)
        log.error(message)
        if self.on_give_up is not None:
            try:
                self.on_give_up(message)
            except Exception:  # noqa: BLE001 - exiting anyway; the message above is what matters
                log.exception("recording the failure failed")
        logging.shutdown()
        os._exit(EXIT_PEER_LOST)
