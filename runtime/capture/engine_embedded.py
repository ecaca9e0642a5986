"""The embedded capture engine (``capture.engine: embedded``): the target runs in this process
through transformers, prefill only, one model replica per GPU (data parallel) or on the CPU.

A batch from the producer is dealt out to the replicas in contiguous chunks of up to
``capture.batch_size`` samples; each replica runs one right-padded forward per chunk (its own
thread: the forward releases the GIL). Every sample is committed through the sink, meta last:
with ``commit_staging_slots`` 0 before :meth:`EmbeddedEngine.capture` returns; otherwise through a
:class:`runtime.capture.commit_pipeline.CommitPipeline`, so the commits of one batch run while the
next batch's forward does (``capture`` returns the samples whose commits finished, :meth:`pending`
names those still running, :meth:`flush` waits for them).

Expert parallelism (``capture.expert_parallel > 1``) is not built here: the expert-sharding loader
of :mod:`runtime.capture.model_loading` (built on runtime/moe) plugs in through the ``model_loader``
argument (see :data:`ModelLoader`), and is picked by default when the recipe asks for it. A loader with an
``idle_step(replica_index, device, dtype)`` method gets that call for every replica left without
samples in a capture step, so the replicas of an expert-parallel group stay in step.

Expert streaming (``capture.expert_streaming``): each replica is loaded on the host, its routed
experts (sharded or not) move into a :mod:`runtime.moe.streaming` store for its device (resident
layers and streaming buffers there, the rest in pinned host memory), then the rest of the model
moves to the device. The forward is unchanged: the experts compute on the same bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from runtime.capture.commit_pipeline import CommitPipeline, CommitResult
from runtime.capture.embedded_settings import EmbeddedSettings, EngineError
from runtime.capture.engine import CaptureRequest, SampleRef
from runtime.capture.hidden_states import HiddenStateCapture, SampleFeatures
from runtime.capture.model_loading import ModelLoader, default_loader
from runtime.capture.sample_meta import CaptureIdentity, sample_meta, sample_tensors

log = logging.getLogger("dspark.capture.embedded")


class SampleSink(Protocol):
    """Where finished samples go: the data-plane producer (or a test's recorder)."""

    def commit(self, g: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> int | None:
        """Write every tensor field, then meta last; returns the bytes written (or None)."""


class EmbeddedEngine:
    """In-process transformers capture engine (implements :class:`runtime.capture.engine.CaptureEngine`)."""

    name = "embedded"

    def __init__(
        self, settings: EmbeddedSettings, sink: SampleSink | None = None, model_loader: ModelLoader | None = None
    ) -> None:
        self.settings = settings
        self.sink = sink
        self.model_loader = model_loader or default_loader(settings)
        self.replicas: list[HiddenStateCapture] = []
        self.expert_stores: list[Any] = []
        """One :class:`runtime.moe.streaming.StreamedExpertStore` per replica when experts are streamed."""
        self._pool: ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        self.identity = CaptureIdentity(
            engine=self.name,
            target_revision=settings.target_revision,
            aux_layer_ids=settings.aux_layer_ids,
            hidden_size=settings.hidden_size,
            compute_dtype=settings.compute_dtype,
        )
        self._host_forward_s = 0.0
        self._forward_events: list[tuple[Any, Any]] = []
        """(start, end) CUDA events around each GPU forward step, read by :attr:`forward_seconds`."""
        self._pipeline: CommitPipeline | None = None
        self._submitted: dict[int, SampleRef] = {}

    @property
    def max_batch(self) -> int:
        """Samples one :meth:`capture` call can take: ``batch_size`` per replica."""
        return self.settings.batch_size * max(1, len(self.settings.devices))

    def start(self) -> None:
        """Load one replica per device; fail with a clear message when the target does not fit the recipe."""
        started = time.monotonic()
        for device in self.settings.devices:
            if self.settings.expert_streaming is None:
                model = self.model_loader(self.settings, device)
            else:
                # Load on the host: the experts go to the streamed store (resident layers and
                # buffers on the device, the rest pinned), then the rest of the model moves over.
                model = self.model_loader(self.settings, "cpu")
                self.expert_stores.append(self._stream_experts(model, device))
                model.to(device)
            replica = HiddenStateCapture(model, self.settings.aux_layer_ids, self.settings.pad_id)
            if replica.hidden_size != self.settings.hidden_size:
                raise EngineError(
                    f"capture.hidden_size is {self.settings.hidden_size}, but the target at {self.settings.target_path} "
                    f"has hidden size {replica.hidden_size}; fix: set capture.hidden_size: {replica.hidden_size}"
                )
            self.replicas.append(replica)
        self._pool = ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="dspark-capture")
        if self.settings.commit_staging_slots > 0 and self.sink is not None:
            self._pipeline = CommitPipeline(
                self.sink, self.settings.commit_staging_slots, self.settings.staging_slot_bytes, name="embedded"
            )
        log.info(
            "embedded engine ready: %d replica(s) on %s, %s, batch %d per replica, loaded in %.1f s",
            len(self.replicas),
            ",".join(self.settings.devices),
            self.settings.compute_dtype,
            self.settings.batch_size,
            time.monotonic() - started,
        )

    def _stream_experts(self, model: torch.nn.Module, device: str) -> Any:
        """Move ``model``'s routed experts into a streamed store (its experts, sharded or not)."""
        from runtime.moe.streaming_modules import stream_experts
        from runtime.recipe.streaming_budget import StreamingBudgetError

        s = self.settings.expert_streaming
        assert s is not None
        try:
            store = stream_experts(
                model,
                device,
                prefetch_layers=s.prefetch_layers,
                gpu_budget_bytes=s.gpu_budget_bytes,
                resident_fraction=s.resident_fraction,
                pinned=s.pinned,
            )
        except (StreamingBudgetError, ValueError) as exc:
            raise EngineError(str(exc)) from exc
        log.info("%s", store.describe())
        return store

    def check_health(self) -> None:
        """A two-token forward on every replica."""
        if not self.replicas:
            raise EngineError("the embedded engine is not started (call start() first)")
        for replica, device in zip(self.replicas, self.settings.devices, strict=True):
            features = replica.forward([[self.settings.pad_id, self.settings.pad_id]])[0]
            if not bool(torch.isfinite(features.lhs).all()):
                raise EngineError(f"the target on {device} produced non-finite hidden states on a probe input")

    def request_stop(self) -> None:
        """Stop committing: a running :meth:`capture` returns after the sample it is writing (a
        pipeline finishes the commit in progress and skips the queued ones)."""
        self._stop.set()
        if self._pipeline is not None:
            self._pipeline.request_stop()

    def features(self, batch: Sequence[CaptureRequest]) -> list[SampleFeatures]:
        """Features of every request in the forward's dtype (fp32 on CPU gives the exact tests),
        on the replica's device, in request order."""
        if not self.replicas or self._pool is None:
            raise EngineError("the embedded engine is not started (call start() first)")
        if len(batch) > self.max_batch:
            raise ValueError(f"a batch of {len(batch)} exceeds {self.max_batch} (batch_size x replicas)")
        size = self.settings.batch_size
        chunks = [list(batch[i : i + size]) for i in range(0, len(batch), size)]
        started = time.monotonic()
        gpus = sorted({d for d in self.settings.devices if d.startswith("cuda")})
        # Timed with events, not by waiting: a wait here would leave the GPU idle while the host
        # prepares the commits and pads the next batch (the commit pipeline orders its copies
        # after the forward with an event of its own).
        start_events = [torch.cuda.current_stream(d).record_event(torch.cuda.Event(enable_timing=True)) for d in gpus]
        futures = [
            self._pool.submit(self.replicas[index].forward, [r.input_ids for r in chunk])
            for index, chunk in enumerate(chunks)
        ]
        idle_step = getattr(self.model_loader, "idle_step", None)
        idle = []
        if idle_step is not None:
            # Expert-parallel replicas exchange tokens inside every MoE layer: one without samples
            # must still take part in this step's exchanges, or its group waits forever.
            idle = [
                self._pool.submit(idle_step, index, self.settings.devices[index], self.settings.torch_dtype)
                for index in range(len(chunks), len(self.replicas))
            ]
        results = [feature for future in futures for feature in future.result()]
        for future in idle:
            future.result()
        if gpus:
            end_events = [torch.cuda.current_stream(d).record_event(torch.cuda.Event(enable_timing=True)) for d in gpus]
            self._forward_events.append((start_events, end_events))
            self._count_forward_events(wait=False)  # keeps the list short in a long capture
        else:
            self._host_forward_s += time.monotonic() - started
        return results

    @property
    def forward_seconds(self) -> float:
        """Time spent in forwards so far (the benchmark's share-outside-the-forward figure): wall time
        on the CPU; on GPUs, each capture step's span on the device's stream (the slowest device),
        which waits for the forwards queued so far."""
        self._count_forward_events(wait=True)
        return self._host_forward_s

    def _count_forward_events(self, wait: bool) -> None:
        """Add the finished forward steps' spans to the total (all of them, waiting, with ``wait``)."""
        while self._forward_events:
            starts, ends = self._forward_events[0]
            if not wait and not all(end.query() for end in ends):
                return
            for end in ends:
                end.synchronize()
            self._host_forward_s += max(start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends, strict=True))
            self._forward_events.pop(0)

    def capture(self, batch: list[CaptureRequest]) -> list[SampleRef]:
        """Capture and commit every request (never mixing samples); after :meth:`request_stop`,
        stop before the next sample. Without a pipeline: returns the samples of ``batch``, all
        committed. With one: hands them to it and returns the samples whose commits finished
        meanwhile (this batch's or earlier ones'); raises when a commit failed."""
        if self.sink is None:
            raise EngineError("the embedded engine has no sink to commit to")
        if self._pipeline is not None:
            self._pipeline.raise_if_failed()
        features = self.features(batch)
        device_type = self.settings.devices[0].split(":")[0]
        refs: list[SampleRef] = []
        for request, feature in zip(batch, features, strict=True):
            if self._stop.is_set():
                break
            tensors = sample_tensors(request, feature)
            meta = sample_meta(request, self.identity, device_type)
            if self._pipeline is not None:
                self._submitted[request.g] = SampleRef(
                    g=request.g, num_tokens=len(request.input_ids), bytes_written=0, meta=meta
                )
                self._pipeline.submit(request.g, tensors, meta)
                continue
            written = self.sink.commit(request.g, tensors, meta)
            refs.append(
                SampleRef(g=request.g, num_tokens=len(request.input_ids), bytes_written=int(written or 0), meta=meta)
            )
        if self._pipeline is not None:
            return self._finished(self._pipeline.completed())
        return refs

    def pending(self) -> set[int]:
        """The g handed to the commit pipeline whose commits have not finished."""
        return self._pipeline.pending() if self._pipeline is not None else set()

    def flush(self) -> list[SampleRef]:
        """Wait for every pipelined commit; returns the samples committed since the last report."""
        if self._pipeline is None:
            return []
        return self._finished(self._pipeline.drain())

    def _finished(self, results: list[CommitResult]) -> list[SampleRef]:
        refs = []
        for result in results:
            submitted = self._submitted.pop(result.g, None)
            if result.error is None and not result.skipped and submitted is not None:
                refs.append(
                    SampleRef(
                        g=result.g,
                        num_tokens=submitted.num_tokens,
                        bytes_written=result.bytes_written,
                        meta=submitted.meta,
                    )
                )
        if self._pipeline is not None:
            self._pipeline.raise_if_failed()
        return refs

    def close(self) -> None:
        """Finish the pipelined commits, drop the replicas and free their memory."""
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for replica in self.replicas:
            replica.close()
        self.replicas = []
        self.expert_stores = []
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
