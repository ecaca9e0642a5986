"""The capture sink inside the patched SGLang server: one prefill in, one committed sample out.

``patches/sglang`` adds a thin hook to SGLang's scheduler (``_dspark_capture_prefill``) that calls
:func:`capture_from_sglang` with the packed batch tensors of one prefill. Everything else lives
here, so it can be tested without SGLang:

1. the request's ``dspark_capture`` ticket is parsed and checked against the server's tensors;
2. the request's rows are sliced out of the packed batch (``[tokens of all requests, width]``) with
   int64 offsets (Python ints and ``narrow``: a K3 ``hs`` slice starts past 2**31 elements);
3. on the TP group's output rank only, ``ids``, ``mask``, ``hs``, ``lhs`` and then ``meta`` are
   committed through the data-plane producer API (:func:`runtime.transport.dataplane.open_producer`)
   by a :class:`runtime.capture.commit_pipeline.CommitPipeline`: the rows are copied device ->
   pinned host on a side CUDA stream into one of ``capture.commit_staging_slots`` staging slots,
   checksummed on the GPU, and committed on a worker thread while the server runs its next
   prefill (the receipt says ``queued``; a failed commit turns the next capture into an error
   receipt, and its g is captured again). With 0 slots (or the ``discard`` sink) the rows are staged
   synchronously and committed before the receipt is returned (``committed``);
4. a receipt (keys, shapes, dtypes, bytes, timings, or the error) goes back in the response.

Residual stream: SGLang 0.5.23's DSPARK capture hook already hands over the
full stream at each layer boundary -- on the standard path the residual output of the fused
add-RMSNorm, i.e. hidden + residual, and on K3's attention-residual path the aggregated stream the
next layer reads -- and the logits processor keeps the post-final-norm states as
``last_hidden_states``. The sink therefore receives complete tensors and adds nothing to them.
"""

from __future__ import annotations

import array
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runtime.capture.commit_pipeline import CommitPipeline, staging_layout
from runtime.capture.sglang_wire import CaptureTicket
from runtime.shared.contracts import SampleProducer
from runtime.transport.sample_format import sample_keys

log = logging.getLogger("dspark.capture.sglang_sink")

FEATURE_DTYPE = torch.bfloat16
"""The sample contract: ``hs`` and ``lhs`` are bf16."""
SERVED_DTYPES = (torch.bfloat16, torch.float32)
"""Dtypes the server may compute in: bf16 (production) or float32 (exact CPU tests of a tiny
target, like the embedded engine's ``compute_dtype: float32``), rounded to bf16 when staged --
the same rounding the embedded engine applies. float16 would lose range, so it is refused."""
ENGINE_NAME = "sglang"


class CaptureSinkError(ValueError):
    """A capture the sink refuses; the message says what to change."""


# ----------------------------------------------------------------------------------------------
# slicing the packed batch (int64 offsets)
# ----------------------------------------------------------------------------------------------


def row_span(start: int, num_rows: int, total_rows: int) -> tuple[int, int]:
    """``[start, start + num_rows)`` checked against a packed tensor of ``total_rows`` rows.

    Python ints, so nothing wraps: the element offset of a K3 slice (start x 35,840) is far above
    2**31 once a batch holds more than one 64K sample.
    """
    start, num_rows, total_rows = int(start), int(num_rows), int(total_rows)
    if start < 0 or num_rows < 0 or start + num_rows > total_rows:
        raise CaptureSinkError(
            f"rows [{start}, {start + num_rows}) are outside the packed batch of {total_rows} rows: "
            "the scheduler's per-request offsets and the batch disagree"
        )
    return start, start + num_rows


def slice_rows(packed: torch.Tensor, start: int, num_rows: int) -> torch.Tensor:
    """One request's rows of a packed ``[rows, width]`` tensor (a view; int64 offsets)."""
    begin, _ = row_span(start, num_rows, packed.shape[0])
    return packed.narrow(0, begin, int(num_rows))


def split_packed(packed: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Every request's rows of a packed batch whose requests have ``lengths`` rows, in order."""
    total = sum(int(n) for n in lengths)
    if total != packed.shape[0]:
        raise CaptureSinkError(f"request lengths sum to {total} rows, the packed batch has {packed.shape[0]}")
    views, start = [], 0
    for n in lengths:
        views.append(slice_rows(packed, start, n))
        start += int(n)
    return views


# ----------------------------------------------------------------------------------------------
# device -> pinned host staging
# ----------------------------------------------------------------------------------------------


class HostStager:
    """Copies device tensors into one reused page-locked host buffer on a side CUDA stream.

    The side stream waits for an event recorded on the producing stream, so the copies neither
    queue behind later work on that stream nor read rows before they are written. CPU tensors (CPU
    runs, or rows SGLang's overlap scheduler already copied to host) pass through without a copy.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._stream: Any = None

    @property
    def capacity_bytes(self) -> int:
        """Size of the staging buffer (grows to the largest sample seen)."""
        return 0 if self._buffer is None else int(self._buffer.numel())

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host copies of the device tensors of ``tensors`` (CPU ones as they are, contiguous),
        complete when this returns."""
        out = {name: t.contiguous() for name, t in tensors.items() if t.device.type == "cpu"}
        on_device = {name: t for name, t in tensors.items() if t.device.type != "cpu"}
        if not on_device:
            return out
        layout, total = staging_layout({n: (tuple(t.shape), t.dtype) for n, t in on_device.items()})
        if self._buffer is None or self._buffer.numel() < total:
            self._buffer = None  # release the old buffer before pinning a larger one
            self._buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        device = next(iter(on_device.values())).device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            for name, tensor in on_device.items():
                num_bytes = tensor.numel() * tensor.element_size()
                host = self._buffer.narrow(0, layout[name], num_bytes).view(tensor.dtype).view(tensor.shape)
                host.copy_(tensor, non_blocking=True)
                # the caching allocator must not hand this memory out before the copy is done
                tensor.record_stream(self._stream)
                out[name] = host
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()
        return {name: out[name] for name in tensors}


# ----------------------------------------------------------------------------------------------
# the sink
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SinkSettings:
    """What every capture of this server must match."""

    kind: str
    """``mooncake`` (commit to the store) or ``discard`` (check and describe only)."""
    store_id: str | None
    """The run's store id (None for ``discard``: taken from each ticket)."""
    aux_layer_ids: tuple[int, ...] | None
    hidden_size: int | None
    target_revision: str | None
    engine_version: str | None


def token_ids_tensor(input_ids: Any) -> torch.Tensor:
    """SGLang's ``origin_input_ids`` (a list or an ``array``) as an int64 tensor."""
    if isinstance(input_ids, array.array):
        return torch.tensor(input_ids.tolist(), dtype=torch.int64)
    if isinstance(input_ids, torch.Tensor):
        return input_ids.detach().to("cpu", torch.int64).reshape(-1)
    return torch.tensor(list(input_ids), dtype=torch.int64)


def loss_mask_tensor(mask: str) -> torch.Tensor:
    """The ticket's ``'0'``/``'1'`` string as a uint8 tensor."""
    return torch.frombuffer(bytearray(mask, "ascii"), dtype=torch.uint8) - ord("0")


def capture_meta(ticket: CaptureTicket, settings: SinkSettings, patch: str | None) -> dict[str, Any]:
    """The capture's part of the stored ``meta`` (the producer adds format, fields, bytes, CRCs)."""
    return {
        "g": ticket.g,
        "epoch": ticket.epoch,
        "row_id": ticket.row_id,
        "row_index": ticket.row_index,
        "num_tokens": ticket.num_tokens,
        "hidden_size": ticket.hidden_size,
        "aux_layer_ids": list(ticket.aux_layer_ids),
        "target_revision": settings.target_revision,
        "engine": ENGINE_NAME,
        "engine_version": settings.engine_version,
        "capture_patch": patch,
    }


class CaptureSink:
    """Checks, stages and commits the captures of one SGLang scheduler process."""

    def __init__(
        self,
        settings: SinkSettings,
        producer: SampleProducer | None = None,
        stager: HostStager | None = None,
        commit_slots: int = 0,
    ) -> None:
        if settings.kind == "mooncake" and producer is None:
            raise CaptureSinkError("the mooncake sink needs a producer")
        self.settings = settings
        self.producer = producer
        self.stager = stager or HostStager()
        # SGLang's output tensors may be preallocated and overwritten by the next forward.
        self.pipeline = (
            CommitPipeline(producer, commit_slots, name="sglang-sink", source_reused=True)
            if producer is not None and commit_slots > 0
            else None
        )
        self.captured = 0

    def check(
        self,
        ticket: CaptureTicket,
        input_ids: torch.Tensor,
        aux_rows: torch.Tensor,
        last_rows: torch.Tensor,
        num_cached_tokens: int,
    ) -> None:
        """Refuse anything that would store a sample other than the one the ticket describes."""
        s = self.settings
        g = ticket.g
        if s.store_id is not None and ticket.store_id != s.store_id:
            raise CaptureSinkError(
                f"sample g={g}: the ticket is for store {ticket.store_id!r}, this server commits to {s.store_id!r}; "
                "the capture engine and the server were started from different recipes"
            )
        if s.aux_layer_ids is not None and tuple(ticket.aux_layer_ids) != tuple(s.aux_layer_ids):
            raise CaptureSinkError(
                f"sample g={g}: the ticket asks for aux layers {list(ticket.aux_layer_ids)}, the recipe says "
                f"{list(s.aux_layer_ids)}"
            )
        if s.hidden_size is not None and ticket.hidden_size != s.hidden_size:
            raise CaptureSinkError(f"sample g={g}: ticket hidden size {ticket.hidden_size}, recipe {s.hidden_size}")
        if num_cached_tokens:
            raise CaptureSinkError(
                f"sample g={g}: {num_cached_tokens} of its tokens came from the prefix cache and have no hidden "
                "states; send a fresh cache_salt per request (the SGLang engine does) or launch with "
                "--disable-radix-cache"
            )
        num_tokens = ticket.num_tokens
        if input_ids.numel() != num_tokens:
            raise CaptureSinkError(
                f"sample g={g}: the server prefilled {input_ids.numel()} tokens but the loss mask has {num_tokens}; "
                "was the prompt truncated (context_length) or split (chunked prefill: launch with "
                "--chunked-prefill-size -1)?"
            )
        width_aux = len(ticket.aux_layer_ids) * ticket.hidden_size
        if tuple(aux_rows.shape) != (num_tokens, width_aux):
            raise CaptureSinkError(
                f"sample g={g}: aux hidden states are {tuple(aux_rows.shape)}, expected ({num_tokens}, {width_aux}) "
                f"= T x {len(ticket.aux_layer_ids)} layers x H {ticket.hidden_size}; check "
                "--return-aux-hidden-state-layer-ids against capture.aux_layer_ids"
            )
        if tuple(last_rows.shape) != (num_tokens, ticket.hidden_size):
            raise CaptureSinkError(
                f"sample g={g}: final hidden states are {tuple(last_rows.shape)}, expected "
                f"({num_tokens}, {ticket.hidden_size})"
            )
        for name, rows in (("aux", aux_rows), ("final", last_rows)):
            if rows.dtype not in SERVED_DTYPES:
                raise CaptureSinkError(
                    f"sample g={g}: {name} hidden states are {rows.dtype}, the capture contract stores "
                    f"{FEATURE_DTYPE}; serve the target in bfloat16 (--dtype bfloat16)"
                )

    def capture(
        self,
        *,
        ticket: CaptureTicket,
        input_ids: Any,
        aux_rows: torch.Tensor,
        last_rows: torch.Tensor,
        num_cached_tokens: int = 0,
        is_commit_rank: bool = True,
        patch: str | None = None,
    ) -> dict[str, Any]:
        """Check, stage and (on the commit rank) commit one sample; returns the receipt."""
        ids = token_ids_tensor(input_ids)
        self.check(ticket, ids, aux_rows, last_rows, num_cached_tokens)
        store_id = self.settings.store_id or ticket.store_id
        receipt: dict[str, Any] = {
            "g": ticket.g,
            "num_tokens": ticket.num_tokens,
            "store_id": store_id,
            "keys": sample_keys(store_id, ticket.g),
            "fields": _describe(ids, aux_rows, last_rows),
            "capture_patch": patch,
            "engine_version": self.settings.engine_version,
        }
        if not is_commit_rank:
            return {**receipt, "status": "skipped", "reason": "not the output rank of its TP group"}
        if self.pipeline is not None:
            return self._queue(ticket, ids, aux_rows, last_rows, patch, receipt)
        t0 = time.perf_counter()
        host = self.stager.stage({"hs": aux_rows.to(FEATURE_DTYPE), "lhs": last_rows.to(FEATURE_DTYPE)})
        t1 = time.perf_counter()
        tensors = {"ids": ids, "mask": loss_mask_tensor(ticket.loss_mask), "hs": host["hs"], "lhs": host["lhs"]}
        written = 0
        status = "discarded"
        if self.producer is not None:
            written = int(self.producer.commit(ticket.g, tensors, capture_meta(ticket, self.settings, patch)) or 0)
            status = "committed" if written else "below_cursor"
        t2 = time.perf_counter()
        self.captured += 1
        log.info(
            "sample g=%d (%d tokens): %s, %d bytes; d2h %.2f s, commit %.2f s",
            ticket.g, ticket.num_tokens, status, written, t1 - t0, t2 - t1,
        )  # fmt: skip
        return {
            **receipt,
            "status": status,
            "bytes_written": written,
            "timings_s": {"d2h": round(t1 - t0, 4), "commit": round(t2 - t1, 4)},
        }

    def _queue(
        self,
        ticket: CaptureTicket,
        ids: torch.Tensor,
        aux_rows: torch.Tensor,
        last_rows: torch.Tensor,
        patch: str | None,
        receipt: dict[str, Any],
    ) -> dict[str, Any]:
        """Hand the sample to the commit pipeline; the receipt says ``queued``."""
        assert self.pipeline is not None
        t0 = time.perf_counter()
        # A float32 server (exact CPU tests) is rounded to the contract's bf16 here, as on the synchronous path.
        hs, lhs = aux_rows.to(FEATURE_DTYPE), last_rows.to(FEATURE_DTYPE)
        tensors = {"ids": ids, "mask": loss_mask_tensor(ticket.loss_mask), "hs": hs, "lhs": lhs}
        try:
            self.pipeline.submit(ticket.g, tensors, capture_meta(ticket, self.settings, patch))
        except Exception as exc:
            raise CaptureSinkError(f"sample g={ticket.g} not queued: {exc}") from exc
        t1 = time.perf_counter()
        for result in self.pipeline.completed():
            if not result.error:
                log.info("sample g=%d committed, %d bytes", result.g, result.bytes_written)
        self.captured += 1
        queued_bytes = sum(int(f["bytes"]) for f in receipt["fields"].values())
        log.info("sample g=%d (%d tokens): queued for commit; stage %.3f s", ticket.g, ticket.num_tokens, t1 - t0)
        return {**receipt, "status": "queued", "bytes_written": queued_bytes, "timings_s": {"stage": round(t1 - t0, 4)}}


def _describe(ids: torch.Tensor, aux_rows: torch.Tensor, last_rows: torch.Tensor) -> dict[str, dict[str, Any]]:
    """dtype, shape and bytes of the four tensor fields as they will be stored."""
    t = int(ids.numel())

    def field(dtype: str, shape: tuple[int, ...], itemsize: int) -> dict[str, Any]:
        count = 1
        for dim in shape:
            count *= dim
        return {"dtype": dtype, "shape": list(shape), "bytes": count * itemsize}

    return {
        "ids": field("int64", (t,), 8),
        "mask": field("uint8", (t,), 1),
        "hs": field("bfloat16", (t, int(aux_rows.shape[1])), 2),
        "lhs": field("bfloat16", (t, int(last_rows.shape[1])), 2),
    }


# ----------------------------------------------------------------------------------------------
# the entry point the patch calls, and the per-process sink
# ----------------------------------------------------------------------------------------------

_SINKS: dict[tuple[str, str | None, bool], CaptureSink] = {}


def _sglang_version() -> str | None:
    try:
        import importlib.metadata

        return importlib.metadata.version("sglang")
    except Exception:  # not installed as a distribution (a source checkout on PYTHONPATH)
        return None


def open_sink(kind: str, recipe_path: str | None, is_commit_rank: bool) -> CaptureSink:
    """The sink of this process for ``--dspark-capture-sink KIND --dspark-capture-recipe PATH``.

    ``mooncake`` on the commit rank opens a commit-only producer: no global segment of its own (the
    capture component's producer mounts it and owns the window) and no heartbeat; its puts land in
    that segment. Other ranks never connect to Mooncake.
    """
    key = (kind, recipe_path, is_commit_rank)
    if key in _SINKS:
        return _SINKS[key]
    if kind not in ("mooncake", "discard"):
        raise CaptureSinkError(f"--dspark-capture-sink {kind!r}: expected 'mooncake' or 'discard'")
    producer = None
    store_id = layer_ids = hidden = revision = None
    commit_slots = 0
    if recipe_path:
        from runtime.capture.setup import sink_setup

        setup = sink_setup(recipe_path)
        store_id = setup.store_id
        layer_ids = setup.aux_layer_ids
        hidden = setup.hidden_size
        revision = setup.target_revision
        if kind == "mooncake" and is_commit_rank:
            from runtime.transport.dataplane import open_producer

            producer = open_producer(
                setup.transport, setup.job_dir, segment_bytes=0, auto_heartbeat=False, start_cursor=None
            )
            commit_slots = setup.commit_staging_slots
    elif kind == "mooncake":
        raise CaptureSinkError("--dspark-capture-sink mooncake needs --dspark-capture-recipe (the resolved recipe)")
    if kind == "mooncake" and not is_commit_rank:
        kind = "discard"  # this rank only checks
    settings = SinkSettings(kind, store_id, layer_ids, hidden, revision, _sglang_version())
    sink = CaptureSink(settings, producer, commit_slots=commit_slots)
    _SINKS[key] = sink
    return sink


def flush_sinks(timeout_s: float | None = None) -> None:
    """Wait until every queued commit of every sink has finished (raises when one failed)."""
    for sink in _SINKS.values():
        if sink.pipeline is not None:
            sink.pipeline.drain(timeout_s)
            sink.pipeline.raise_if_failed()


def close_sinks() -> None:
    """Close every sink's producer (its Mooncake client) and forget the sinks."""
    for sink in _SINKS.values():
        if sink.pipeline is not None:
            sink.pipeline.close()  # the queued commits finish first
        close = getattr(sink.producer, "close", None)
        if close is not None:
            close()
    _SINKS.clear()


def capture_from_sglang(
    *,
    sink_kind: str,
    recipe_path: str | None,
    request: Any,
    input_ids: Any,
    num_cached_tokens: int,
    aux_hidden_states: torch.Tensor | None,
    last_hidden_states: torch.Tensor | None,
    start: int,
    num_tokens: int,
    is_commit_rank: bool,
    patch: str | None = None,
) -> dict[str, Any]:
    """Called by the patched scheduler once per captured request (see the module docstring).

    ``aux_hidden_states`` / ``last_hidden_states`` are the packed batch tensors of the prefill
    (``[tokens of all requests, n_aux x H]`` and ``[..., H]``); this request's rows are
    ``[start, start + num_tokens)``.
    """
    ticket = CaptureTicket.from_payload(request)
    if aux_hidden_states is None or last_hidden_states is None:
        raise CaptureSinkError(
            f"sample g={ticket.g}: the prefill kept no {'aux' if aux_hidden_states is None else 'final'} hidden "
            "states; launch with --enable-return-aux-hidden-states --speculative-algorithm DSPARK "
            "--return-aux-hidden-state-layer-ids ... and send return_hidden_states=true"
        )
    sink = open_sink(sink_kind, recipe_path, is_commit_rank)
    return sink.capture(
        ticket=ticket,
        input_ids=input_ids,
        aux_rows=slice_rows(aux_hidden_states, start, num_tokens),
        last_rows=slice_rows(last_hidden_states, start, num_tokens),
        num_cached_tokens=num_cached_tokens,
        is_commit_rank=is_commit_rank,
        patch=patch,
    )
