"""The capture component's part of the smoke gate: ``capture_gate.json`` in the job folder.

In a smoke run (``--smoke``) the producer records each stage it passes, in order, so that the
launcher's gate can say which one failed and why (the record's type is
:class:`runtime.shared.contracts.CaptureGateRecord`)::

    {"format": "dspark-capture-gate/1",
     "stages": {"data":   {"ok": true,  "detail": "..."},
                "master": {"ok": true,  "detail": "mooncake_master answering at 127.0.0.1:50151"},
                "engine": {"ok": false, "detail": "<the error>"},
                "capture": {"ok": true, "detail": "4 samples committed"}}}

A stage that raised is recorded with ``ok: false`` and the error text before the error propagates.
It also holds the gate's NaN injection (``capture.inject_nan_at_g``), which proves that the gate
stops a non-finite update.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from runtime.shared.contracts import CAPTURE_GATE_FILE, CaptureGateRecord, CaptureStageName, StageRecord, write_record


class CaptureGate:
    """Records the capture stages of a smoke run (does nothing outside one)."""

    def __init__(self, job_dir: Path, enabled: bool) -> None:
        self.path = job_dir / CAPTURE_GATE_FILE
        self.enabled = enabled
        self.record_so_far = CaptureGateRecord()

    def record(self, name: CaptureStageName, ok: bool, detail: str) -> None:
        """Record one stage and rewrite the file atomically."""
        if not self.enabled:
            return
        self.record_so_far.stages[name] = StageRecord(ok=ok, detail=detail)
        write_record(self.path, self.record_so_far)

    @contextmanager
    def stage(self, name: CaptureStageName, success: str) -> Iterator[None]:
        """Run a stage: ``success`` is recorded when it completes, the error text when it raises."""
        try:
            yield
        except BaseException as exc:
            self.record(name, False, f"{type(exc).__name__}: {exc}")
            raise
        self.record(name, True, success)


class NanInjectingSink:
    """Wraps the producer: the ``hs`` of one sample is committed as NaN (smoke self-test)."""

    def __init__(self, sink: Any, g: int) -> None:
        self._sink = sink
        self._g = g

    def commit(self, g: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], **kwargs: Any) -> Any:
        """Commit through the producer, poisoning sample ``g`` (whose checksums are then recomputed
        from the poisoned bytes: the gate must see the NaN, not a checksum error)."""
        if g == self._g:
            tensors = {**tensors, "hs": torch.full_like(tensors["hs"], float("nan"))}
            kwargs.pop("checksums", None)
        return self._sink.commit(g, tensors, meta, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)
