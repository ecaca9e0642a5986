"""A file-backed sample source with the data plane's consumer interface (tests and tools only).

Layout: one ``{g:012d}.safetensors`` file per sample in a folder, holding the tensor fields of
the sample contract in runtime/shared/contracts.py (``ids``, ``mask``, ``hs``, ``lhs``) and the JSON ``meta`` in the file's metadata.
The cursor is a ``cursor`` text file in the same folder. It implements
:class:`runtime.shared.contracts.SampleConsumer`, so the trainer cannot tell it from Mooncake;
files are never deleted, so the same folder serves several runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runtime.files import atomic_path, atomic_write_text
from runtime.shared.contracts import TENSOR_FIELDS, CapturedSample

CURSOR_FILE = "cursor"


def sample_file(folder: Path, g: int) -> Path:
    """Path of sample ``g`` in ``folder``."""
    return folder / f"{g:012d}.safetensors"


def write_sample_file(folder: str | Path, sample: CapturedSample) -> Path:
    """Write one sample as ``{g:012d}.safetensors`` in ``folder`` (atomically)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return write_sample_to(sample_file(folder, sample.g), sample)


def write_sample_to(target: Path, sample: CapturedSample, extra_metadata: dict[str, str] | None = None) -> Path:
    """Write one sample to ``target`` (temp name, then rename: a reader never sees half a file;
    a failed write leaves no temp file behind)."""
    tensors = {name: tensor.contiguous() for name, tensor in sample.tensors().items()}
    metadata = {"meta": json.dumps({**sample.meta, "g": sample.g}), **(extra_metadata or {})}
    with atomic_path(target) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return target


def read_sample_file(path: Path, g: int) -> CapturedSample:
    """Read one sample file back."""
    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in TENSOR_FIELDS}
        meta = json.loads((handle.metadata() or {}).get("meta", "{}"))
    return CapturedSample(g=g, meta=meta, **tensors)


class FileSampleSource:
    """``SampleConsumer`` over a folder of sample files."""

    def __init__(
        self, folder: str | Path, *, global_batch_size: int, idle_timeout_s: float, poll_interval_s: float = 0.2
    ) -> None:
        self.folder = Path(folder)
        self.global_batch_size = global_batch_size
        self.idle_timeout_s = idle_timeout_s
        self.poll_interval_s = poll_interval_s
        self.stopping: Callable[[], bool] = lambda: False
        """The trainer's stop check (a file source has no store to stop waiting on)."""

    def fetch(self, g: int, device: torch.device | str | None = None) -> CapturedSample:
        """Sample ``g`` (on ``device`` when given); waits up to ``idle_timeout_s`` for its file."""
        path = sample_file(self.folder, g)
        deadline = time.monotonic() + self.idle_timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"sample g={g} did not appear as {path} within {self.idle_timeout_s:.0f} s "
                    "(transport.idle_timeout_s); the file source is written by tests/tools, not by a producer"
                )
            time.sleep(self.poll_interval_s)
        sample = read_sample_file(path, g)
        if device is not None:
            for name, tensor in sample.tensors().items():
                setattr(sample, name, tensor.to(device))
        return sample

    def commit_step(self, step: int) -> None:
        """Publish the cursor after optimizer step ``step`` (files are kept)."""
        self.publish_cursor((step + 1) * self.global_batch_size)

    def publish_cursor(self, cursor: int) -> None:
        """Write the ``cursor`` file atomically."""
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.folder / CURSOR_FILE, f"{cursor}\n")

    def read_cursor(self) -> int | None:
        """The last published cursor, or None."""
        target = self.folder / CURSOR_FILE
        return int(target.read_text()) if target.exists() else None


def describe(sample: CapturedSample) -> dict[str, Any]:
    """Shapes and dtypes of a sample's fields (for error messages)."""
    return {name: (tuple(t.shape), str(t.dtype)) for name, t in sample.tensors().items()}
