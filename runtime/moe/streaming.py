"""Routed experts streamed from host memory: one store per GPU, layer by layer, a copy stream ahead.

Each MoE layer's routed-expert weights (a dict of tensors in the format the expert kernel reads:
bf16 ``gate_up``/``down``, or packed MXFP4 blocks + E8M0 scales for the dequant-once grouped GEMM)
are either resident on the device or kept in (pinned) host memory, as
:class:`~runtime.recipe.streaming_budget.StreamingSplit` says. The model calls
:meth:`StreamedExpertStore.acquire` right before a layer's experts compute and
:meth:`StreamedExpertStore.release` right after:

- ``acquire(layer)`` returns the layer's tensors on the device. For a streamed layer that is one of
  ``num_buffers`` reused device buffers (allocated once, never per layer), filled by a copy that
  was issued ahead of time on a separate copy stream; the compute stream waits on that copy's
  event, not the host. Then it issues the copies of the next ``prefetch_layers`` streamed layers
  (in forward order, wrapping around to the next forward's first layers), each into a buffer
  whose previous layer the compute stream has finished with.
- ``release(layer)`` records an event on the compute stream: the copy stream waits on it before
  it overwrites that buffer.

Prefill runs the layers in order, so every acquire finds its layer already in flight; an acquire
out of order (or the first one) copies its layer on demand and counts a miss.

On a CPU there is no copy stream and no pinned memory: the same code copies synchronously, which
is what the correctness tests run (buffer reuse and ordering included). A store is used by one
thread (one capture replica) at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from runtime.recipe.streaming_budget import StreamingSplit

log = logging.getLogger("dspark.moe.streaming")

LayerWeights = dict[str, torch.Tensor]


@dataclass
class StreamingStats:
    """Counters of one store (cumulative)."""

    copies: int = 0
    """Layers copied host -> device."""
    copied_bytes: int = 0
    misses: int = 0
    """Acquires whose layer had not been prefetched (copied on demand)."""
    acquires: int = 0


class _Buffer:
    """One reused device buffer set: where a streamed layer is copied to."""

    def __init__(self, template: Mapping[str, torch.Tensor], device: torch.device) -> None:
        self.tensors: LayerWeights = {
            name: torch.empty(t.shape, dtype=t.dtype, device=device) for name, t in template.items()
        }
        self.layer: int | None = None
        """Layer whose copy was issued into this buffer (possibly still in flight)."""
        self.copied: torch.cuda.Event | None = None
        """Recorded on the copy stream after the copy (CUDA only)."""
        self.freed: torch.cuda.Event | None = None
        """Recorded on the compute stream after the layer's compute (CUDA only)."""
        self.in_use = False


class StreamedExpertStore:
    """Routed-expert weights of every MoE layer on one device, resident or streamed."""

    def __init__(
        self,
        layers: Sequence[Mapping[str, torch.Tensor]],
        split: StreamingSplit,
        device: torch.device | str,
        *,
        pinned: bool = True,
        time_copies: bool = False,
        release_sources: bool = False,
    ) -> None:
        """``layers``: per MoE layer in forward order, its weights by name (any device; resident
        layers already on ``device`` are used in place, streamed layers already in pinned host
        memory are not copied). ``pinned`` pins the host copies when the device is a GPU (pageable
        memory copies at a fraction of the speed and cannot overlap). ``time_copies`` records CUDA
        events around each copy for :meth:`copy_seconds` (the benchmark's achieved bandwidth).
        ``release_sources``: empty each mutable mapping of ``layers`` once its layer is placed, so a
        model's pageable copy of a streamed layer is freed before the next one is pinned (host
        memory peaks at one layer above the pinned total, not at twice the experts)."""
        if len(layers) != split.num_layers:
            raise ValueError(f"the split is for {split.num_layers} MoE layers but {len(layers)} were given")
        self.device = torch.device(device)
        self.split = split
        self.cuda = self.device.type == "cuda"
        self.pinned = pinned and self.cuda
        self.stats = StreamingStats()
        self._order = [i for i, resident in enumerate(split.resident) if not resident]
        self._weights: list[LayerWeights] = []
        template: Mapping[str, torch.Tensor] | None = None
        progress = _Progress(len(layers), f"expert streaming on {self.device}: placing MoE layers")
        for index, weights in enumerate(layers):
            if split.resident[index]:
                self._weights.append({name: t.detach().to(self.device) for name, t in weights.items()})
                self._release(weights, release_sources)
                continue
            if template is not None and _signature(weights) != _signature(template):
                raise ValueError(
                    f"streamed MoE layer {index} has weights {_signature(weights)}, but layer {self._order[0]} has "
                    f"{_signature(template)}: every streamed layer must have the same names, shapes and dtypes"
                )
            placed = {name: self._host_copy(t) for name, t in weights.items()}
            self._weights.append(placed)
            template = template or placed  # the host copy: the source mapping may be emptied now
            self._release(weights, release_sources)
            progress.done(index + 1)
        progress.done(len(layers), final=True)
        self._buffers = [_Buffer(template, self.device) for _ in range(split.num_buffers)] if template else []
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda and self._order else None
        self._time_copies = time_copies and self._copy_stream is not None
        self._copy_timers: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._acquired: int | None = None

    @staticmethod
    def _release(weights: Mapping[str, torch.Tensor], release: bool) -> None:
        if release and isinstance(weights, dict):
            weights.clear()

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if not self.pinned:
            return tensor.to("cpu").contiguous()
        if tensor.device.type == "cpu" and tensor.is_pinned() and tensor.is_contiguous():
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor)
        return host

    # ------------------------------------------------------------------------------------------
    # what a layer's forward calls

    def acquire(self, layer: int) -> LayerWeights:
        """The weights of MoE layer ``layer`` on the device, ready for the current stream's next
        kernels; issues the copies of the next streamed layers. Pair with :meth:`release`."""
        if self._acquired is not None:
            raise RuntimeError(f"MoE layer {self._acquired} is still acquired; release it before acquiring {layer}")
        self.stats.acquires += 1
        self._acquired = layer
        if self.split.resident[layer]:
            self._prefetch_after(layer)
            return self._weights[layer]
        buffer = self._buffer_holding(layer)
        if buffer is None:
            self.stats.misses += 1
            buffer = self._free_buffer(keep=())
            if buffer is None:  # cannot happen with one layer acquired at a time and >= 2 buffers
                raise RuntimeError("no free streaming buffer")
            self._copy_into(buffer, layer)
        if buffer.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(buffer.copied)
        buffer.in_use = True
        self._prefetch_after(layer)
        return buffer.tensors

    def release(self, layer: int) -> None:
        """The compute that read layer ``layer``'s weights has been issued; its buffer may be
        refilled once that compute has run."""
        if self._acquired != layer:
            raise RuntimeError(f"release of MoE layer {layer}, but the acquired layer is {self._acquired}")
        self._acquired = None
        if self.split.resident[layer]:
            return
        buffer = self._buffer_holding(layer)
        assert buffer is not None
        buffer.in_use = False
        if self.cuda:
            buffer.freed = torch.cuda.Event()
            buffer.freed.record(torch.cuda.current_stream(self.device))

    @contextmanager
    def layer(self, layer: int) -> Iterator[LayerWeights]:
        """``with store.layer(i) as weights: ...``: acquire, compute, release."""
        weights = self.acquire(layer)
        try:
            yield weights
        finally:
            self.release(layer)

    # ------------------------------------------------------------------------------------------
    # prefetching

    def _buffer_holding(self, layer: int) -> _Buffer | None:
        return next((b for b in self._buffers if b.layer == layer), None)

    def _upcoming(self, layer: int, count: int) -> list[int]:
        """The next ``count`` streamed layers after MoE layer ``layer`` in forward order, wrapping
        around (the next forward starts at layer 0)."""
        if not self._order:
            return []
        after = next((i for i, s in enumerate(self._order) if s > layer), 0)
        count = min(count, len(self._order))
        return [self._order[(after + k) % len(self._order)] for k in range(count)]

    def _free_buffer(self, keep: Sequence[int]) -> _Buffer | None:
        """A buffer not in use whose layer is not in ``keep`` (the layers about to run); empty ones
        first. Any such buffer holds a layer that is not needed before the ones in ``keep``."""
        candidates = [b for b in self._buffers if not b.in_use and b.layer not in keep]
        if not candidates:
            return None
        empty = [b for b in candidates if b.layer is None]
        return empty[0] if empty else candidates[0]

    def _prefetch_after(self, layer: int) -> None:
        upcoming = self._upcoming(layer, len(self._buffers) - (0 if self.split.resident[layer] else 1))
        for index, target in enumerate(upcoming):
            if self._buffer_holding(target) is not None:
                continue
            buffer = self._free_buffer(keep=upcoming[: index + 1] + ([layer] if self._acquired is not None else []))
            if buffer is None:
                return
            self._copy_into(buffer, target)

    def _copy_into(self, buffer: _Buffer, layer: int) -> None:
        source = self._weights[layer]
        buffer.layer = layer
        self.stats.copies += 1
        self.stats.copied_bytes += sum(t.numel() * t.element_size() for t in source.values())
        if self._copy_stream is None:
            for name, tensor in source.items():
                buffer.tensors[name].copy_(tensor)
            return
        with torch.cuda.stream(self._copy_stream):
            if buffer.freed is not None:
                self._copy_stream.wait_event(buffer.freed)  # the previous layer's compute is done with it
            timer = (
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                if self._time_copies
                else None
            )
            if timer is not None:
                timer[0].record(self._copy_stream)
            for name, tensor in source.items():
                buffer.tensors[name].copy_(tensor, non_blocking=True)
            if timer is not None:
                timer[1].record(self._copy_stream)
                self._copy_timers.append(timer)
            buffer.copied = torch.cuda.Event()
            buffer.copied.record(self._copy_stream)

    # ------------------------------------------------------------------------------------------
    # reporting

    @property
    def device_bytes(self) -> int:
        """Bytes this store holds on the device: resident layers + buffers."""
        resident = sum(t.numel() * t.element_size() for i, w in enumerate(self._weights) for t in w.values()
                       if self.split.resident[i])  # fmt: skip
        return resident + sum(t.numel() * t.element_size() for b in self._buffers for t in b.tensors.values())

    @property
    def host_bytes(self) -> int:
        """Bytes of streamed layers kept in host memory."""
        return sum(t.numel() * t.element_size() for i in self._order for t in self._weights[i].values())

    def copy_seconds(self) -> float:
        """GPU time the copy stream spent copying since the last call (needs ``time_copies``;
        synchronizes the copy stream)."""
        if not self._copy_timers:
            return 0.0
        self._copy_stream.synchronize()  # type: ignore[union-attr]
        seconds = sum(start.elapsed_time(end) for start, end in self._copy_timers) / 1e3
        self._copy_timers = []
        return seconds

    def describe(self) -> str:
        """One line for a log."""
        s = self.split
        return (
            f"expert streaming on {self.device}: {s.resident_layers} of {s.num_layers} MoE layers resident, "
            f"{s.streamed_layers} streamed through {s.num_buffers} buffers of {s.layer_bytes / 1e9:.3f} GB; "
            f"device {self.device_bytes / 1e9:.3f} GB, host {self.host_bytes / 1e9:.3f} GB"
            f"{' pinned' if self.pinned else ''}"
        )


class _Progress:
    """Log lines while the store places layers (pinning hundreds of GB takes minutes)."""

    def __init__(self, total: int, what: str, interval_s: float = 10.0) -> None:
        self.total, self.what, self.interval_s = total, what, interval_s
        self.started = self.last = time.monotonic()

    def done(self, count: int, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < self.interval_s:
            return
        if final and now - self.started < self.interval_s:
            return  # quick: nothing worth a line
        self.last = now
        rate = count / max(now - self.started, 1e-9)
        log.info(
            "%s: %d/%d (%.2f layers/s, ETA %.0f s)", self.what, count, self.total, rate, (self.total - count) / rate
        )


def _signature(weights: Mapping[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(name, tuple(t.shape), t.dtype) for name, t in sorted(weights.items())]
