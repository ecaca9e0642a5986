"""The one small interface every capture engine implements.

An engine turns a batch of capture requests into committed samples in the store and returns
references to them. The embedded engine commits through the producer API itself; the SGLang
engine's server-side sink does. The trainer never knows which engine produced a sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class CaptureRequest:
    """One sample to capture: which g, from which data row, with which tokens."""

    g: int
    """Global sample index."""
    epoch: int
    """Prompt epoch of this g."""
    row_index: int
    """Index of the row in the pre-tokenized data file."""
    row_id: str
    """The row's ``id`` field."""
    input_ids: tuple[int, ...]
    """Token ids, already truncated to ``data.max_length``."""
    loss_mask: tuple[int, ...]
    """1 on assistant tokens."""


@dataclass(frozen=True)
class SampleRef:
    """What an engine returns for one committed sample."""

    g: int
    num_tokens: int
    bytes_written: int
    meta: dict[str, Any] = field(default_factory=dict)


class CaptureEngine(Protocol):
    """A capture engine: ``capture(batch) -> sample refs``."""

    name: str
    """``embedded`` or ``sglang`` (recorded in every sample's meta)."""

    def start(self) -> None:
        """Load the model or launch the server; return when it can serve."""

    def check_health(self) -> None:
        """Raise with a useful message when the engine cannot serve."""

    def capture(self, batch: list[CaptureRequest]) -> list[SampleRef]:
        """Capture every request of ``batch`` (never mixing samples) and commit each to the store."""

    def close(self) -> None:
        """Release the model or stop the server."""
