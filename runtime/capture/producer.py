"""The capture component's main loop: keep the data-plane window full of captured samples.

``python3 -m runtime.capture --recipe RESOLVED`` builds the component's settings once
(:func:`runtime.capture.setup.capture_setup`) and runs :func:`run_capture` with them:

1. start the Mooncake master when ``capture.owns_master`` says this node owns it;
2. check the data file against the recipe (SHA-256, rows) and open it for random access;
3. connect the producer (heartbeats start at once, saying the engine is loading);
4. start the engine(s);
5. loop: take the next missing g of the window from the producer (in order, up to one batch),
   map each to its data row through the prompt order, capture and commit them, report progress;
6. on SIGTERM / SIGINT: stop taking work, let the sample being written finish (its ``meta`` is
   written last, so no reader ever sees half of it), give back the claimed g not captured, close.

The loop ends by itself once the trainer's cursor has passed the last sample of the run.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from runtime.capture.engine import CaptureEngine, CaptureRequest
from runtime.capture.gate import CaptureGate, NanInjectingSink
from runtime.capture.master_watch import MasterWatch, trainer_step_text
from runtime.capture.progress import CaptureProgress
from runtime.capture.setup import CaptureSetup, DataSetup, EngineSetup
from runtime.shared.data_files import RowIndex, check_data_sha256
from runtime.shared.prompt_order import PromptOrder

log = logging.getLogger("dspark.capture")

POLL_S = 0.5
"""Longest a waiting loop goes without looking at the stop flag."""


class WindowProducer(Protocol):
    """What the loop needs of :class:`runtime.transport.producer.Producer`."""

    def wait_next(self, max_count: int = 1, timeout_s: float | None = None) -> list[int]:
        """Up to ``max_count`` missing g, claimed, in order (empty after ``timeout_s``)."""

    def release(self, g: int) -> None:
        """Give back a claimed g that was not committed."""

    def heartbeat(self, stats: dict[str, Any] | None = None) -> None:
        """Upsert the heartbeat, keeping ``stats`` for later beats."""

    def stats(self) -> dict[str, Any]:
        """Cursor, window end, resident samples/bytes, in flight, paused."""

    def describe_wait(self) -> str:
        """Why nothing can be captured right now."""


class DataError(ValueError):
    """A data row the capture cannot use (the message names the file, the row and the fix)."""


@dataclass
class CaptureSource:
    """The prompt order and the rows it points at: ``g -> CaptureRequest``."""

    order: PromptOrder
    rows: RowIndex
    max_length: int
    vocab_size: int

    @classmethod
    def open(cls, data: DataSetup, verify_sha256: bool = True) -> CaptureSource:
        """Open the data file (checking its SHA-256 and row count) and build the prompt order."""
        path = data.train_path
        if verify_sha256:
            check_data_sha256(path, data.expected_sha256, recipe_file=str(data.recipe_file))
        rows = RowIndex(path)
        if data.num_rows is not None and len(rows) != data.num_rows:
            raise DataError(
                f"{data.recipe_file}: data.num_rows is {data.num_rows}, but {path} has {len(rows)} rows; fix: use "
                f"the intended file or set data.num_rows: {len(rows)}"
            )
        order = PromptOrder(len(rows), data.prompt_seed, data.epochs, data.max_samples)
        return cls(order, rows, data.max_length_tokens, data.vocab_size)

    def request(self, g: int) -> CaptureRequest:
        """The capture request of sample ``g``."""
        slot = self.order.locate(g)
        row = self.rows.read(slot.row_index)
        where = f"{self.rows.path}: row {row.index + 1} (id {row.id!r}, sample g={g})"
        if row.num_tokens > self.max_length:
            raise DataError(
                f"{where}: {row.num_tokens} tokens, above data.max_length {self.max_length}; fix: re-run "
                "tools/prepare_data with that --max-length"
            )
        if len(row.loss_mask) != row.num_tokens:
            raise DataError(f"{where}: loss_mask and input_ids differ in length; fix: tools/verify_data the file")
        if row.num_tokens == 0 or max(row.input_ids) >= self.vocab_size or min(row.input_ids) < 0:
            raise DataError(f"{where}: empty row or token id outside 0..{self.vocab_size - 1}; fix: tools/verify_data")
        return CaptureRequest(
            g=g,
            epoch=slot.epoch,
            row_index=slot.row_index,
            row_id=row.id,
            input_ids=tuple(row.input_ids),
            loss_mask=tuple(row.loss_mask),
        )


class CaptureLoop:
    """Claims missing g from the producer, captures them with the engine, reports progress."""

    def __init__(
        self,
        producer: WindowProducer,
        engine: CaptureEngine,
        source: CaptureSource,
        batch_size: int,
        progress_interval_s: float,
        stop: threading.Event | None = None,
        rows_captured_once: bool = False,
        share: tuple[int, int] = (0, 1),
    ) -> None:
        """``rows_captured_once``: the trainer caches features, so the capture's work (and its ETA)
        ends with epoch 0; later samples come only when a trainer rank asks for them."""
        self.producer = producer
        self.engine = engine
        self.source = source
        self.batch_size = batch_size
        self.progress_interval_s = progress_interval_s
        self.stop = stop or threading.Event()
        order = source.order
        end = min(order.total_samples, order.num_rows) if rows_captured_once else order.total_samples
        note = (
            "; later epochs: the trainer's feature cache (captured only when a rank asks)" if rows_captured_once else ""
        )
        if share[1] > 1:
            note += f"; this node's share: g % {share[1]} == {share[0]}"
        self.progress = CaptureProgress(total_samples=end, note=note, share_count=share[1])
        self._beyond_end: set[int] = set()
        self._awaiting: set[int] = set()
        """Claimed g handed to the engine whose commit has not been reported yet."""
        self._last_report = 0.0

    def finished(self) -> bool:
        """The trainer's cursor has passed the run's last sample: nothing is left to capture."""
        cursor = self.producer.stats().get("cursor")
        return cursor is not None and cursor >= self.source.order.total_samples

    def run(self) -> str:
        """Loop until stopped or finished; returns why it ended (``stopped`` or ``finished``)."""
        log.info(
            "capturing samples g < %d (%d rows x %d epochs, prompt seed %d)",
            self.source.order.total_samples,
            self.source.order.num_rows,
            self.source.order.epochs,
            self.source.order.prompt_seed,
        )
        while not self.stop.is_set():
            # With commits still running in the engine's pipeline, look for work without waiting:
            # when there is none, those commits are flushed at once (the trainer may wait on them).
            in_pipeline = bool(self._engine_pending())
            claimed = self.producer.wait_next(max_count=self.batch_size, timeout_s=0.0 if in_pipeline else POLL_S)
            # A g past the run's end is left claimed for good, so the window never offers it again.
            work = [g for g in claimed if g < self.source.order.total_samples]
            self._beyond_end.update(g for g in claimed if g >= self.source.order.total_samples)
            if work:
                self._capture(work)
            elif in_pipeline:
                self._flush()
            elif self.finished():
                self.report("finished: the trainer consumed every sample of the run", force=True)
                return "finished"
            self.report("capturing" if work else self.producer.describe_wait())
        self._flush()
        self.report("stopped on request", force=True)
        return "stopped"

    def _engine_pending(self) -> set[int]:
        pending = getattr(self.engine, "pending", None)
        return set(pending()) if pending is not None else set()

    def _capture(self, work: list[int]) -> None:
        refs: list[Any] = []
        self._awaiting.update(work)
        try:
            requests = [self.source.request(g) for g in work]
            refs = self.engine.capture(requests)
        finally:
            self._settle(refs)

    def _flush(self) -> None:
        """Wait for the engine's pipelined commits (engines without a pipeline have none)."""
        flush = getattr(self.engine, "flush", None)
        refs: list[Any] = []
        try:
            if flush is not None:
                refs = flush()
        finally:
            self._settle(refs)

    def _settle(self, refs: list[Any]) -> None:
        """Record the committed samples; release every awaited g that is neither committed nor
        still in the engine's pipeline (a failed or skipped capture: the window offers it again)."""
        committed = {ref.g for ref in refs}
        if refs:
            self.progress.record(
                [r.g for r in refs], sum(r.num_tokens for r in refs), sum(r.bytes_written for r in refs)
            )
        # A commit that finished after the engine reported is neither here nor pending: releasing
        # it is harmless (the producer marked it committed; release only drops a claim).
        pending = self._engine_pending()
        for g in sorted(self._awaiting):
            if g in committed:
                self._awaiting.discard(g)
            elif g not in pending:
                self._awaiting.discard(g)
                self.producer.release(g)

    def report(self, state: str, force: bool = False) -> None:
        """Log a progress line and refresh the heartbeat's stats, every ``progress_interval_s``."""
        now = time.monotonic()
        if not force and now - self._last_report < self.progress_interval_s:
            return
        self._last_report = now
        stats = self.progress.stats()
        stats["state"] = state
        try:
            self.producer.heartbeat({"capture": stats})
        except Exception as exc:  # the heartbeat thread retries; progress must not kill the capture
            log.warning("heartbeat with progress failed: %s", exc)
        log.info("%s", self.progress.line(self.producer.stats(), state))


@contextmanager
def stop_on_signals(
    stop: threading.Event, on_stop: Callable[[], None], finished: threading.Event | None = None
) -> Iterator[None]:
    """SIGTERM / SIGINT set ``stop`` and call ``on_stop`` (the engine's request_stop) instead of killing.

    Once ``finished`` is set (every sample consumed, the master kept up for the trainer), the signal is
    the run's ordinary end -- the supervisor stops the capture after the trainer left -- and is said so
    in one line, not as an interruption."""

    def handler(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if finished is not None and finished.is_set():
            log.info("the trainer has ended (%s from the supervisor): stopping the Mooncake master", name)
        else:
            log.info("received %s: finishing the sample being written, then stopping", name)
        stop.set()
        on_stop()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


STOP_POLL_S = 0.5
"""How often the main thread wakes while it waits for a stop signal."""


def wait_for_stop(stop: threading.Event) -> None:
    """Wait until ``stop`` is set, waking every :data:`STOP_POLL_S`. A bare ``Event.wait()`` can sleep through
    SIGTERM: the kernel may deliver the signal to another thread (CUDA's and Mooncake's threads leave it
    unblocked), which sets Python's pending flag but does not wake the main thread, the only one that runs
    the handler. On a GPU the capture slept that way until the supervisor's SIGKILL, 30 s later."""
    while not stop.wait(STOP_POLL_S):
        pass


def make_engine(engine: EngineSetup, sink: Any, moe_exchange: str | None = None) -> CaptureEngine:
    """The engine the recipe names, committing through ``sink``. ``moe_exchange`` (the capture
    command line's ``--k3-moe-exchange``) overrides ``capture.moe_exchange``."""
    inject_g = engine.inject_nan_at_g
    if engine.embedded is not None:
        from runtime.capture.engine_embedded import EmbeddedEngine

        settings = engine.embedded.settings(moe_exchange)
        if inject_g is not None:
            log.warning("smoke self-test: sample g=%d will be committed with NaN hidden states", inject_g)
            sink = NanInjectingSink(sink, inject_g)
        return EmbeddedEngine(settings, sink)
    if inject_g is not None:
        raise ValueError("capture.inject_nan_at_g is a self-test of the embedded engine; unset it for engine: sglang")
    assert engine.sglang is not None, engine.kind
    from runtime.capture.engine_sglang import SGLangEngine

    # The SGLang server's own sink commits each sample; the window sees them on its next scan.
    return SGLangEngine(engine.sglang)


def engine_batch(engine: CaptureEngine, batch_size: int) -> int:
    """Samples per capture call: what the engine can take at once (else ``capture.batch_size``)."""
    return int(getattr(engine, "max_batch", batch_size))


def run_capture(setup: CaptureSetup, endpoints: Any = None, moe_exchange: str | None = None) -> int:
    """The capture component (see the module docstring); returns the process exit code.
    ``moe_exchange`` overrides the recipe's ``capture.moe_exchange`` (``--k3-moe-exchange``)."""
    from runtime.transport.dataplane import open_producer
    from runtime.transport.endpoints import mark_endpoints_ended, record_endpoints
    from runtime.transport.master import MasterProcess

    stop = threading.Event()
    finished = threading.Event()
    engine_holder: list[CaptureEngine] = []
    share, transport, job_dir = setup.share, setup.transport, setup.job_dir
    gate = CaptureGate(job_dir, enabled=setup.gate_enabled)
    with ExitStack() as stack:
        stack.enter_context(
            stop_on_signals(
                stop, lambda: [e.request_stop() for e in engine_holder if hasattr(e, "request_stop")], finished
            )
        )
        endpoints = endpoints or transport.endpoints_from_env()
        if share[0] == 0:  # for a look from outside the job: python3 -m runtime.transport status --job DIR
            record_endpoints(job_dir, endpoints)
            stack.callback(mark_endpoints_ended, job_dir)  # last: after the master has stopped
        with gate.stage("master", f"mooncake_master answering at {endpoints.master_host}:{transport.ports.rpc_port}"):
            if share[1] > 1:
                log.info(
                    "capture share %d of %d: this node captures the g with g %% %d == %d", *share, share[1], share[0]
                )
            watch: MasterWatch | None = None
            if setup.owns_master:
                master = MasterProcess(
                    transport.master(endpoints.master_host), job_dir / "logs" / "mooncake_master.log"
                )
                master.start()
                stack.callback(master.stop)
                watch = MasterWatch(
                    {"mooncake_master": master.process, "the Mooncake metadata server": master.metadata_process},
                    job_dir,
                    stop_requested=stop,
                ).start()
                stack.callback(watch.stop)  # before master.stop: a stop on purpose is no death
            producer = open_producer(transport, job_dir, endpoints=endpoints, share=share)
            stack.callback(producer.close)
            if watch is not None:
                g_per_step = setup.global_batch_size
                watch.where = lambda: trainer_step_text(producer.stats().get("cursor"), g_per_step)
        with gate.stage("data", f"{setup.data.train_path_text}: SHA-256 and row count as the recipe says"):
            source = CaptureSource.open(setup.data)
        if setup.rows_captured_once:
            producer.capture_later_epochs_only_when_asked(source.order.num_rows)
        producer.heartbeat({"capture": {"state": f"loading the {setup.engine.kind} engine"}})
        with gate.stage("engine", f"{setup.engine.kind} engine started and healthy"):
            engine = make_engine(setup.engine, producer, moe_exchange)
            engine_holder.append(engine)
            stack.callback(engine.close)
            engine.start()
            engine.check_health()
        if stop.is_set():
            log.info("stop requested while the engine loaded; nothing was captured")
            return 0
        loop = CaptureLoop(
            producer,
            engine,
            source,
            engine_batch(engine, setup.engine.batch_size),
            setup.progress_interval_s,
            stop,
            rows_captured_once=setup.rows_captured_once,
            share=share,
        )
        with gate.stage("capture", "capture loop ran"):
            outcome = loop.run()
        gate.record("capture", loop.progress.samples > 0, f"{loop.progress.samples} sample(s) committed ({outcome})")
        log.info("capture %s after %d samples", outcome, loop.progress.samples)
        if outcome == "finished":
            # The trainer still holds store clients (and may write its last checkpoint for a while):
            # keep the master up until the supervisor stops this component after the trainer ends.
            log.info("every sample was consumed; keeping the Mooncake master up until the trainer ends")
            finished.set()
            producer.trainer_is_leaving()
            producer.heartbeat({"capture": {"state": "finished; waiting for the trainer to end"}})
            wait_for_stop(stop)
    return 0
