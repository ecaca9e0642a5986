"""The node-local feature cache: every sample a trainer rank reads in epoch 0, kept on local disk.

Capture is the expensive side (a K3 64K prefill takes seconds; training on it a fraction of one),
and the hidden states of a row do not change between epochs. With ``trainer.feature_cache`` each
rank writes the samples it reads in epoch 0 into a folder on the trainer node's local disk, one
safetensors file per data row, and later epochs read them from there; the producer captures epoch 0
only, plus what a rank asks for (see :mod:`runtime.trainer.cached_source`).

An entry is trusted only when it proves itself: its digest (everything that determines the
features: target, revision, aux layers, hidden size, engine, dtype, data SHA-256, max length) and
row match, and every field's checksum (the ones the capture computed, kept in the entry's ``meta``)
verifies. Anything else (a truncated file, flipped bytes, another target's entry) is removed and
reported as a miss, so the sample is captured again, never trained on. Entries are written under a
temporary name and renamed, so a crash leaves no half entry; a full disk stops caching with one
warning (later epochs then ask the producer), it does not stop training.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.recipe.units import format_bytes
from runtime.shared.contracts import TENSOR_FIELDS, CapturedSample
from runtime.trainer.entry_reader import EntryReader
from runtime.trainer.file_source import write_sample_to
from runtime.transport.errors import CorruptSampleError, TransportError
from runtime.transport.sample_format import field_layouts, verify_field

log = logging.getLogger("dspark.trainer.feature_cache")

CACHE_FORMAT_VERSION = 1
"""Bumped when the entry layout changes (part of the digest: old entries are then never read)."""


class FeatureCacheError(RuntimeError):
    """The cache folder cannot be used (the message names the folder, the numbers and the fix)."""


@dataclass(frozen=True)
class FeatureSource:
    """Everything that determines a row's captured features (and nothing else: seeds, epochs and
    batch sizes do not change them); the recipe's values, as it writes them."""

    engine: str
    target_path: str
    target_revision: str | None
    num_target_layers: int
    hidden_size: int
    vocab_size: int
    aux_layer_ids: tuple[int, ...]
    compute_dtype: str
    max_length_tokens: int
    """``data.max_length``."""


def features_digest(features: FeatureSource, data_digest: str) -> str:
    """SHA-256 over ``features`` and the data file's SHA-256: the key of a cache's entries."""
    identity = {
        "format": CACHE_FORMAT_VERSION,
        "engine": features.engine,
        "target_path": features.target_path,
        "target_revision": features.target_revision,
        "num_target_layers": features.num_target_layers,
        "hidden_size": features.hidden_size,
        "vocab_size": features.vocab_size,
        "aux_layer_ids": list(features.aux_layer_ids),
        "compute_dtype": features.compute_dtype,
        "data_digest": data_digest,
        "max_length": features.max_length_tokens,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class CacheFolder:
    """``trainer.feature_cache.dir``: as the recipe writes it, and resolved with ``${VAR}`` taken from
    this process's environment (checked by :func:`cache_root` when the cache opens)."""

    configured: str | None
    """As the recipe writes it; None: not set."""
    expanded: str | None
    """With this process's environment variables expanded."""
    path: Path | None
    """The folder, absolute; None when not set or a variable is missing."""
    recipe_file: Path
    """The resolved recipe (named in refusals)."""


def cache_root(folder: CacheFolder) -> Path:
    """The cache's folder, or :class:`FeatureCacheError` naming the field and the fix."""
    if not folder.configured:
        raise FeatureCacheError(
            f"{folder.recipe_file}: trainer.feature_cache.enabled is true but trainer.feature_cache.dir is not set; "
            "fix: set it to a folder on the trainer node's local disk"
        )
    if folder.path is None:
        raise FeatureCacheError(
            f"{folder.recipe_file}: trainer.feature_cache.dir {folder.configured!r} names an environment variable this "
            f"process does not have ({folder.expanded!r}); fix: export it in job.env, or give a plain path"
        )
    return folder.path


class FeatureCache:
    """The entries of one feature digest in one folder (shared by the ranks of one node)."""

    def __init__(self, root: Path, digest: str) -> None:
        self.root = root
        self.digest = digest
        self.folder = root / digest[:24]
        self.writable = True
        """False after a write failed for lack of space: the cache then only serves what it has."""
        self.hits = 0
        self.misses = 0
        self.corrupt = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self._reader = EntryReader()

    def entry_path(self, row_index: int) -> Path:
        """The file of data row ``row_index``."""
        return self.folder / f"row{row_index:09d}.safetensors"

    def open(self, rows: int, bytes_per_row: int) -> FeatureCache:
        """Create the folder and refuse to start when the disk cannot hold the rows still missing."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FeatureCacheError(
                f"trainer.feature_cache.dir: cannot create {self.folder} ({exc.strerror or exc}); fix: point it at a "
                "writable folder on the trainer node's local disk"
            ) from exc
        present = sum(1 for row in range(rows) if self.entry_path(row).exists())
        need = (rows - present) * bytes_per_row
        free = shutil.disk_usage(self.folder).free
        if need > free:
            raise FeatureCacheError(
                f"trainer.feature_cache.dir {self.folder}: {rows - present} of {rows} rows still to cache need "
                f"{format_bytes(need)} (at most {format_bytes(bytes_per_row)} each), the disk has "
                f"{format_bytes(free)} free; fix: free space there, point the cache at a larger disk, or set "
                "trainer.feature_cache.enabled: false"
            )
        log.info(
            "feature cache %s: %d of %d rows present, %s free (%s needed for the rest)",
            self.folder,
            present,
            rows,
            format_bytes(free),
            format_bytes(need),
        )
        return self

    def has(self, row_index: int) -> bool:
        """An entry exists for the row (not yet verified: :meth:`load` does that)."""
        return self.entry_path(row_index).exists()

    def load(
        self, row_index: int, g: int, epoch: int, device: torch.device | str | None = None
    ) -> CapturedSample | None:
        """The row's sample as sample ``g`` of ``epoch``, on ``device`` (CPU when None), verified;
        None (and the entry removed) when it is missing, unreadable, from another digest, or fails a
        checksum. The file is read straight onto ``device`` (:mod:`runtime.trainer.entry_reader`:
        disk reads overlap pinned copies on CUDA), and ``sum16`` fields are verified there."""
        path = self.entry_path(row_index)
        if not path.exists():
            self.misses += 1
            return None
        try:
            metadata, tensors = self._reader.read(path, TENSOR_FIELDS, device)
            if metadata.get("digest") != self.digest or metadata.get("row_index") != str(row_index):
                raise CorruptSampleError(
                    f"the entry belongs to row {metadata.get('row_index')} of digest "
                    f"{str(metadata.get('digest'))[:12]}, not row {row_index} of {self.digest[:12]}"
                )
            meta = json.loads(metadata["meta"])
            for layout in field_layouts(meta):
                verify_field(g, layout, tensors[layout.name])
        except (OSError, KeyError, ValueError, TransportError) as exc:
            self.corrupt += 1
            log.warning(
                "feature cache entry %s is unusable (%s); removed, the producer captures row %d again",
                path,
                exc,
                row_index,
            )
            path.unlink(missing_ok=True)
            return None
        self.hits += 1
        self.bytes_read += sum(t.numel() * t.element_size() for t in tensors.values())
        meta = {**meta, "g": g, "epoch": epoch, "from_feature_cache": True}
        return CapturedSample(g=g, meta=meta, **tensors)

    def store(self, row_index: int, sample: CapturedSample) -> None:
        """Keep a verified sample read from the store (on any device: a host copy is written) as
        the row's entry; no-op when it is there already or the disk filled up earlier."""
        path = self.entry_path(row_index)
        if not self.writable or path.exists():
            return
        host = CapturedSample(g=sample.g, meta=sample.meta, **{k: t.cpu() for k, t in sample.tensors().items()})
        try:
            write_sample_to(path, host, {"digest": self.digest, "row_index": str(row_index)})
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.writable = False
            need = sum(t.numel() * t.element_size() for t in sample.tensors().values())
            log.warning(
                "feature cache: disk full at %s (need %s for row %d); caching stops here, later epochs ask the "
                "producer for the rows not cached",
                self.folder,
                format_bytes(need),
                row_index,
            )
            return
        self.bytes_written += path.stat().st_size

    def close(self) -> None:
        """Stop the entry reader's threads (the files stay: they serve later runs)."""
        self._reader.close()

    def stats(self) -> dict[str, int]:
        """Counters for the trainer's metrics."""
        return {
            "cache_hits": self.hits,
            "cache_misses": self.misses,
            "cache_corrupt": self.corrupt,
            "cache_bytes_written": self.bytes_written,
            "cache_bytes_read": self.bytes_read,
        }
