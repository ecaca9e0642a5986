"""The all-to-all exchange between expert-parallel ranks that are threads of one process.

The embedded capture engine runs one model replica per device as threads of a single process,
and torch.distributed cannot hold several ranks in one process. So for those replicas the
exchange keeps :class:`~runtime.moe.exchange_nccl.AllToAllExchange`'s plan and fixed-order sums
and replaces its two collectives with a rendezvous: every rank posts its per-destination pieces,
waits for the others, and takes its pieces in source-rank order (device-to-device copies, over
NVLink between GPUs). Same rows, same order, so the same results as the NCCL/gloo exchange.

A rank that never arrives (a replica that skipped a step instead of calling the idle step)
breaks the rendezvous after ``timeout_s`` with a message saying so, instead of hanging; a rank
that fails inside the MoE layer breaks it at once. A replica that fails elsewhere in its forward
should call :meth:`ThreadRendezvous.abort` (the engine: ``ExpertParallelLoader.abort``).
"""

from __future__ import annotations

import threading

import torch

from runtime.moe.exchange import experts_per_rank_for
from runtime.moe.exchange_nccl import AllToAllExchange
from runtime.moe.experts import LocalExperts
from runtime.moe.plan import DEFAULT_SUM_CHUNK_ROWS
from runtime.moe.routing import TopKRouting

DEFAULT_RENDEZVOUS_TIMEOUT_S = 600.0
"""How long a rank waits for the others at one exchange (a 64K-token forward is well below)."""


class ExchangeTimeoutError(RuntimeError):
    """Not every expert-parallel rank reached the exchange in time."""


class ThreadRendezvous:
    """All-to-all of tensor lists among ``size`` threads."""

    def __init__(self, size: int, timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S) -> None:
        self.size = size
        self.timeout_s = timeout_s
        self._slots: list[list[torch.Tensor] | None] = [None] * size
        self._barrier = threading.Barrier(size)

    def _wait(self, rank: int, what: str) -> None:
        try:
            self._barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            raise ExchangeTimeoutError(
                f"expert-parallel rank {rank} gave up on the other {self.size - 1} rank(s) at the MoE exchange "
                f"({what}): one failed, or did not arrive within {self.timeout_s:.0f} s. Every replica must run "
                "the same number of forwards; a replica without a sample calls the idle step"
            ) from None

    def abort(self) -> None:
        """Release every rank waiting here with an error (a rank failed: nobody should wait for it)."""
        self._barrier.abort()

    def all_to_all(self, rank: int, pieces: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """Post ``pieces[d]`` for each destination d; return what every source posted for ``rank``,
        in source order, on ``device``."""
        self._slots[rank] = pieces
        self._wait(rank, "posting")
        received = [self._slots[source][rank].to(device) for source in range(self.size)]  # type: ignore[index]
        self._wait(rank, "collecting")  # nobody overwrites a slot before everyone has read it
        return received


class ThreadGroupExchange(AllToAllExchange):
    """:class:`AllToAllExchange` for ranks that are threads sharing a :class:`ThreadRendezvous`."""

    name = "nccl"

    def __init__(
        self, rendezvous: ThreadRendezvous, rank: int, num_experts: int, *, sum_chunk_rows: int = DEFAULT_SUM_CHUNK_ROWS
    ) -> None:
        # No super().__init__: it would read rank and size from torch.distributed.
        self.group = None
        self.rendezvous = rendezvous
        self.rank = rank
        self.world_size = rendezvous.size
        self.num_experts = num_experts
        self.experts_per_rank = experts_per_rank_for(num_experts, self.world_size)
        self.sum_chunk_rows = sum_chunk_rows

    def exchange_counts(self, send_counts: list[int], device: torch.device) -> list[int]:
        """Rows this rank receives from each rank."""
        pieces = [torch.tensor([c], dtype=torch.int64) for c in send_counts]
        return [int(t.item()) for t in self.rendezvous.all_to_all(self.rank, pieces, torch.device("cpu"))]

    def _all_to_all(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        pieces = list(torch.split(rows, send_counts))
        received = self.rendezvous.all_to_all(self.rank, pieces, rows.device)
        return torch.cat(received) if received else rows[:0]

    def run(self, hidden: torch.Tensor, routing: TopKRouting, experts: LocalExperts) -> torch.Tensor:
        """:meth:`AllToAllExchange.run`; a failure here releases the other ranks at once."""
        try:
            return super().run(hidden, routing, experts)
        except Exception:
            self.rendezvous.abort()
            raise
