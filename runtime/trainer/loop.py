"""The training loop: set up, start (fresh / resume / warm start), step, checkpoint, export, gate.

One optimizer step reads as fetch -> forward/backward -> apply update -> report, each a method
below; the smoke gate (:class:`runtime.trainer.gate.SmokeGate`) is called at a few named points.

One optimizer step ``s`` consumes ``g`` in ``[s*G, (s+1)*G)`` through the fixed map of
:func:`runtime.shared.contracts.step_sample_indices`. Within a micro-step, the slot weights of
every sample on every rank are summed first (an all-reduce of one number), so each term is divided
by the global sum of weights of that micro-step, as DeepSpec does; micro-steps are averaged. Each
sample then runs forward and backward on its own (a micro-batch of several samples costs no more
memory than one), and FSDP2 reduces gradients in fp32 after every backward, so accumulation
happens in fp32 sharded gradients.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.shared.contracts import (
    TRAINER_EXIT_STOPPED,
    CapturedSample,
    LossRecord,
    SampleConsumer,
    step_sample_indices,
)
from runtime.shared.draft_provenance import run_origin
from runtime.trainer import checkpoints
from runtime.trainer.distributed import (
    all_reduce_host_sums,
    all_reduce_sum,
    barrier,
    broadcast_object,
    gather_objects,
    init_process_group,
    shard_model,
)
from runtime.trainer.export import draft_config, export_draft
from runtime.trainer.frozen_vocab import load_frozen_vocab
from runtime.trainer.gate import SmokeGate
from runtime.trainer.guard import TERMS, FiniteGuard, inspect_update
from runtime.trainer.layout import BlockLayout, anchor_generator, build_layout
from runtime.trainer.metrics import MFU_KEY, MetricsWriter, progress_line, step_metrics
from runtime.trainer.model import DSparkDraft, SampleInputs
from runtime.trainer.objective import SCALAR_SUMS, SLOT_SUMS, loss_coefficients
from runtime.trainer.peer_watch import PeerLost, PeerWatch
from runtime.trainer.prefetch import PreparedSample, StepPrefetcher
from runtime.trainer.resume import StartPlan, check_resume_compatible, plan_start
from runtime.trainer.schedules import build_schedule
from runtime.trainer.setup import TrainerSetup
from runtime.trainer.sources import check_sample, open_sample_source

LOSS_SUMS: tuple[str, ...] = ("loss_ce", "loss_l1", "loss_confidence")
EXIT_STOPPED = TRAINER_EXIT_STOPPED
"""Exit code after a SIGTERM was honoured at a step boundary (checkpoint written)."""
FETCH_JOIN_S = 0.6
"""How long a dropped step waits for its prefetch thread (between fetches it looks at its stop flag every
0.5 s; inside a fetch from a store that is gone it does not come back) before going on without it."""


@dataclass
class StepOutcome:
    """What one optimizer step produced (identical on every rank)."""

    sums: dict[str, Any]
    rank_terms: list[dict[str, bool]]
    grad_norm: float
    applied: bool
    wait_s: float
    step_time_s: float
    samples: list[int] = field(default_factory=list)
    row_indices: list[int | None] = field(default_factory=list)
    """Data row of every sample of the step, in g order (from the samples' meta): what the
    optimizer saw, recorded so a run can be checked against the prompt order."""


class Trainer:
    """One trainer rank."""

    def __init__(self, setup: TrainerSetup) -> None:
        self.setup = setup
        settings = setup.run
        self.settings = settings
        self.stop_requested = False
        self.gate = SmokeGate(setup.gate, rank=settings.rank, world_size=settings.world_size)
        self._copy_stream: Any = None
        self._fetch_left_running = False
        """A dropped step left its prefetch thread inside a fetch (the store may be gone): the source is
        not closed under it."""
        self._peers = PeerWatch(
            settings.rank,
            settings.world_size,
            settings.master_addr,
            settings.master_port,
            give_up_after_s=setup.idle_timeout_s,
            on_give_up=lambda message: self.gate.on_failure(PeerLost(message)),
        )
        """Beats for this rank and stops it when another rank falls silent (started after the rendezvous)."""

    # ------------------------------------------------------------------ setup

    def _build_model(self) -> DSparkDraft:
        spec, vocab = self.setup.draft_spec, self.setup.frozen_vocab
        torch.manual_seed(self.setup.seed)  # identical init on every rank, whatever the world size
        with torch.device(self.settings.device):
            model = spec.build(
                attention_backend=self.settings.attention_backend, compile_regions=self.settings.compile_regions
            )
        embed, lm_head = load_frozen_vocab(
            vocab.target_dir,
            embed_tensor_name=vocab.embed_tensor_name,
            lm_head_tensor_name=vocab.lm_head_tensor_name,
            vocab_size=spec.vocab_size,
            hidden_size=spec.target_hidden_size,
            dtype=self.settings.param_dtype,
            device=self.settings.device,
        )
        model.attach_frozen_vocab(embed, lm_head)
        return shard_model(model, self.settings)

    def _install_stop_handler(self) -> None:
        def request_stop(signum: int, _frame: Any) -> None:
            self.stop_requested = True
            print(
                f"[trainer rank {self.settings.rank}] {signal.Signals(signum).name}: checkpointing at the next step boundary",
                flush=True,
            )

        with contextlib.suppress(ValueError):  # not the main thread (tests)
            signal.signal(signal.SIGTERM, request_stop)

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        """Train to the end (or to a stop request); returns the process exit code."""
        s = self.settings
        init_process_group(s, self.setup.idle_timeout_s)
        self._install_stop_handler()
        writer = MetricsWriter(s.job_dir, self.setup.metrics, run_name=self.setup.job_name, enabled=s.is_main)
        self._peers.start()
        try:
            return self._run(writer)
        except Exception as exc:
            self.gate.on_failure(exc)
            raise
        finally:
            self._peers.stop()
            writer.close()

    def _run(self, writer: MetricsWriter) -> int:
        s = self.settings
        setup = self.setup
        model = self._build_model()
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=setup.optimizer.lr,
            betas=setup.optimizer.betas,
            eps=setup.optimizer.eps,
            weight_decay=setup.optimizer.weight_decay,
        )
        schedule = build_schedule(setup.schedule, base_lr=setup.optimizer.lr, run_total_steps=s.total_steps)
        plan = plan_start(setup.checkpoint, s.checkpoint_dir, setup.recipe_digest)
        start_step, guard = self._start(plan, model, optimizer, writer)
        writer.resume_at(start_step)
        source = open_sample_source(setup.source, s.rank, s.world_size)
        source.stopping = lambda: self.stop_requested
        try:
            return self._train(model, optimizer, schedule, plan, start_step, guard, source, writer)
        finally:
            close = getattr(source, "close", None)
            if self._fetch_left_running:
                print(
                    f"[trainer rank {s.rank}] a sample fetch is still waiting on the data plane; "
                    "leaving its connection open (the process ends now)",
                    flush=True,
                )
            elif close is not None:
                close()

    def _train(
        self,
        model: DSparkDraft,
        optimizer: torch.optim.Optimizer,
        schedule: Any,
        plan: StartPlan,
        start_step: int,
        guard: FiniteGuard,
        source: SampleConsumer,
        writer: MetricsWriter,
    ) -> int:
        s = self.settings
        setup = self.setup
        if s.is_main:  # the producer's window starts at the cursor: a resumed run republishes its own
            source.publish_cursor(start_step * setup.batch.global_batch_size)
        writer.say(
            f"[trainer] {plan.kind} ({plan.reason}{': ' + str(plan.path) if plan.path else ''}); steps "
            f"{start_step}..{s.total_steps - 1} of {s.total_steps}, world {s.world_size}, device {s.device}, "
            f"{str(s.param_dtype).removeprefix('torch.')}, attention {s.attention_backend}"
            f"{', compiled regions' if s.compile_regions else ''}, G={setup.batch.global_batch_size} ({setup.batch.micro_batch_size} x "
            f"{setup.batch.gradient_accumulation_steps} x {s.world_size}), {sum(p.numel() for p in model.parameters()):,} "
            "trainable parameters"
        )
        run_started = time.monotonic()
        last_saved: checkpoints.SavedCheckpoint | None = None
        step = start_step
        for step in range(start_step, s.total_steps):
            for group in optimizer.param_groups:
                group["lr"] = schedule.lr(step)
            self._peers.step = step
            rng_at_step_start = checkpoints.rng_state()
            outcome = self._train_step(step, model, optimizer, source, guard)
            if outcome is None:
                checkpoints.restore_rng(rng_at_step_start)  # the dropped step is re-run exactly after a resume
                return self._stop_mid_step(step, start_step, model, optimizer, schedule, guard, writer)
            record = self._record(step, outcome, schedule.lr(step), guard)
            writer.write(record)
            done = step + 1
            if done % setup.log_every_steps == 0 or done == s.total_steps or s.smoke:
                writer.say(progress_line(record, s.total_steps, time.monotonic() - run_started, done - start_step))
            stop = self._any_rank_stopping()
            if not stop:
                # On a stop the store may be gone already (Slurm signals the master with the trainer):
                # the checkpoint comes first, and the resumed run republishes its cursor.
                source.commit_step(step)
            if done % setup.checkpoint.every_steps == 0 or done == s.total_steps or s.smoke or stop:
                last_saved = self._save(done, model, optimizer, schedule.state(), guard, writer)
            if s.smoke:
                self._smoke_step_done(done, outcome, model, last_saved)
            if stop:
                writer.say(
                    f"[trainer] stopped after step {done} on request; checkpoint {last_saved.path if last_saved else None}"
                )
                return EXIT_STOPPED
        target = s.checkpoint_dir / f"export-{checkpoints.step_dir_name(s.total_steps)}"
        # also after a restart that found every step done but no export (a crash while exporting)
        if setup.checkpoint.export_safetensors and (s.total_steps > start_step or not target.exists()):
            origin = run_origin(s.job_dir, setup.recipe_digest, s.total_steps)
            export_draft(model, target, setup.draft_spec, dtype=s.param_dtype, is_main=s.is_main, origin=origin)
            served_as = draft_config(setup.draft_spec, s.param_dtype)["architectures"][0]
            writer.say(f"[trainer] exported the draft ({served_as}) to {target}")
            self.gate.on_export(target)
        memory = ""
        if s.device.type == "cuda":
            memory = (
                f"; peak GPU memory {torch.cuda.max_memory_allocated(s.device) / 2**30:.2f} GiB allocated on rank 0"
            )
        writer.say(f"[trainer] finished {s.total_steps} steps in {time.monotonic() - run_started:.1f} s{memory}")
        barrier()
        return 0

    def _start(
        self, plan: StartPlan, model: DSparkDraft, optimizer: torch.optim.Optimizer, writer: MetricsWriter
    ) -> tuple[int, FiniteGuard]:
        s = self.settings
        setup = self.setup
        guard = FiniteGuard(smoke=s.smoke, max_consecutive_skips=setup.max_consecutive_skips)
        if plan.kind == "resume" and plan.path is not None:
            state = self._verified_state(plan.path)
            check_resume_compatible(state, self._identity(), plan.path)
            checkpoints.load_full(plan.path, model, optimizer, state)
            rng = state.get("rng") or []
            if s.rank < len(rng):
                checkpoints.restore_rng(rng[s.rank])
            guard.skipped_total = int(state.get("skipped_updates", 0))
            guard.consecutive = int(state.get("consecutive_skips", 0))
            return int(state["step"]), guard
        if plan.kind == "init" and plan.path is not None:
            if checkpoints.is_complete(plan.path):
                self._verified_state(plan.path)
            checkpoints.load_weights(plan.path, model)
            writer.say(f"[trainer] warm start: weights from {plan.path}; optimizer, schedule, counters and RNG fresh")
        return 0, guard

    def _stop_mid_step(
        self,
        step: int,
        start_step: int,
        model: DSparkDraft,
        optimizer: torch.optim.Optimizer,
        schedule: Any,
        guard: FiniteGuard,
        writer: MetricsWriter,
    ) -> int:
        """A stop request during step ``step`` whose samples stopped coming: every rank dropped the step
        together (nothing of it was applied), so the model, optimizer and RNG are those after ``step``
        steps; checkpoint them, unless this run has not finished a step (the checkpoint it started from
        is that state)."""
        if step == start_step:
            writer.say(
                f"[trainer] stopped on request during step {step + 1}, before this run finished a step; "
                f"the samples of that step stopped coming; no new checkpoint (this run started at step {step})"
            )
            return EXIT_STOPPED
        writer.say(
            f"[trainer] the samples of step {step + 1} stopped coming after the stop request; every rank "
            "dropped that step (a resume runs it again)"
        )
        saved = self._save(step, model, optimizer, schedule.state(), guard, writer)
        writer.say(f"[trainer] stopped after step {step} on request; checkpoint {saved.path}")
        return EXIT_STOPPED

    def _verified_state(self, path: Any) -> dict[str, Any]:
        """Rank 0 reads ``trainer_state.json`` and checks the checkpoint's files; every rank gets the
        verdict, so all fail together with the same message (or none does)."""
        verdict: Any = None
        if self.settings.is_main:
            try:
                verdict = checkpoints.verify_checkpoint(path)
            except checkpoints.CheckpointError as exc:
                verdict = str(exc)
        verdict = broadcast_object(verdict)
        if isinstance(verdict, str):
            raise checkpoints.CheckpointError(verdict)
        return dict(verdict)

    def _identity(self) -> dict[str, Any]:
        setup = self.setup
        return {
            "schedule_type": setup.schedule.type,
            "world_size": self.settings.world_size,
            "data_digest": self.settings.data_digest,
            "prompt_seed": setup.prompt_seed,
            "global_batch_size": setup.batch.global_batch_size,
            "draft": setup.draft_spec.draft.model_dump(mode="json"),
        }

    # ------------------------------------------------------------------ one step

    def _train_step(
        self,
        step: int,
        model: DSparkDraft,
        optimizer: torch.optim.Optimizer,
        source: SampleConsumer,
        guard: FiniteGuard,
    ) -> StepOutcome | None:
        """One optimizer step: fetch -> forward/backward (every micro-step) -> apply update -> report.

        None when a stop was requested and some rank's samples did not come: every rank learns it from
        the micro-step's all-reduce and drops the step together, before any update is applied."""
        s = self.settings
        setup = self.setup
        started = time.monotonic()
        gs = step_sample_indices(
            step, s.rank, s.world_size, setup.batch.micro_batch_size, setup.batch.gradient_accumulation_steps
        )
        local = self._zero_sums()
        prefetch = StepPrefetcher(self._fetcher(source), gs)
        consumed: list[tuple[int, int | None]] = []
        dropped = False
        try:
            for _m in range(setup.batch.gradient_accumulation_steps):
                batch = self._fetch_micro_batch(prefetch)
                layouts = [p.layout if p.layout is not None else self._layout(p.sample) for p in batch or []]
                # One host all-reduce per micro-step: the global weight sum, and how many ranks are
                # stopping without their samples (a rank that waits for data would block every other
                # rank's next collective; all must leave the step at the same point).
                global_weight, missing = all_reduce_host_sums(
                    [sum(x.weight_sum for x in layouts), 0.0 if batch is not None else 1.0]
                )
                if missing or batch is None:
                    dropped = True
                    break
                consumed += [(p.sample.g, p.sample.meta.get("row_index")) for p in batch]
                self._forward_backward(model, batch, layouts, global_weight, local)
        finally:
            self._fetch_left_running = not prefetch.close(FETCH_JOIN_S if dropped else None)
        if dropped:
            optimizer.zero_grad(set_to_none=True)  # the gradients of the micro-steps already run
            return None
        grad_norm, rank_terms, applied = self._apply_update(step, model, optimizer, guard, local)
        sums, wait_s = self._reduce_sums(local, prefetch.wait_s)
        return StepOutcome(
            row_indices=self._row_indices(consumed),
            sums=sums,
            rank_terms=rank_terms,
            grad_norm=grad_norm,
            applied=applied,
            wait_s=wait_s,
            step_time_s=time.monotonic() - started,
            samples=gs,
        )

    # fetch

    def _fetcher(self, source: SampleConsumer) -> Callable[[int], PreparedSample]:
        """The prefetch thread's fetch. On CUDA the sample is copied to the GPU on a side stream
        inside the fetch (the Mooncake consumer stages it through pinned buffers), overlapping
        with the compute of the previous sample on the default stream."""
        device = self.settings.device
        if device.type != "cuda":
            return lambda g: PreparedSample(source.fetch(g))
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)

        def fetch(g: int) -> PreparedSample:
            torch.cuda.set_device(device)  # the current device is per thread
            with torch.cuda.stream(self._copy_stream):
                sample = source.fetch(g, device)
                # Everything the micro-step needs from the host is prepared here, beside the
                # previous sample's compute, once the copy is done: the token id range for the
                # sample check and the layout (anchor sampling on the host), whose tensors follow
                # the sample to the GPU on this stream. Read on the compute thread, each small
                # device-to-host read or pageable host-to-device copy waits for all the compute
                # queued before it, and the CPU then cannot queue the next sample's copy early
                # (seen in a trace: ~85 ms of idle compute stream per 64K K3 micro-step). Started
                # before the copy finished, a small read would sit in the driver behind it.
                self._copy_stream.record_event().synchronize()
                ids = sample.ids.to("cpu")
                return PreparedSample(
                    sample,
                    layout=self._layout(sample, ids).to(device, non_blocking=True),
                    copied=self._copy_stream.record_event(),
                    ids_range=(int(ids.min()), int(ids.max())) if ids.numel() else None,
                )

        return fetch

    def _received(self, prepared: PreparedSample) -> PreparedSample:
        """Hand a prefetched sample's GPU tensors over to the compute stream."""
        if self.settings.device.type == "cuda":
            current = torch.cuda.current_stream(self.settings.device)
            # Wait for this sample's copy only: waiting on the copy stream as a whole would also
            # wait for the next sample's copy, which the prefetch thread may have queued already
            # (measured: ~0.1 s of idle GPU per 64K K3 micro-step).
            if prepared.copied is not None:
                current.wait_event(prepared.copied)
            else:
                current.wait_stream(self._copy_stream)
            layout = prepared.layout
            layout_tensors = [v for v in vars(layout).values() if isinstance(v, torch.Tensor)] if layout else []
            for tensor in [*prepared.sample.tensors().values(), *layout_tensors]:
                if tensor.is_cuda:
                    tensor.record_stream(current)  # freed memory must not be reused by the copy stream early
        return prepared

    def _fetch_micro_batch(self, prefetch: StepPrefetcher) -> list[PreparedSample] | None:
        """The next micro-batch's samples, received on the compute stream and checked; None when a stop
        is requested and they are not there (:meth:`StepPrefetcher.next`)."""
        batch = []
        for _ in range(self.setup.batch.micro_batch_size):
            prepared = prefetch.next(stopping=lambda: self.stop_requested)
            if prepared is None:
                return None
            batch.append(self._received(prepared))
        spec = self.setup.draft_spec
        for prepared in batch:
            self.gate.on_sample(prepared.sample)
            check_sample(
                prepared.sample,
                num_aux_layers=spec.num_aux_layers,
                hidden_size=spec.target_hidden_size,
                vocab_size=spec.vocab_size,
                ids_range=prepared.ids_range,
            )
        return batch

    # forward / backward

    def _zero_sums(self) -> dict[str, torch.Tensor]:
        """This rank's float64 accumulators of one step (scalar sums, losses, per-slot sums)."""
        device = self.settings.device
        local = {name: torch.zeros((), dtype=torch.float64, device=device) for name in SCALAR_SUMS + LOSS_SUMS}
        block_size = self.setup.draft_spec.draft.block_size
        local.update({name: torch.zeros(block_size, dtype=torch.float64, device=device) for name in SLOT_SUMS})
        return local

    def _layout(self, sample: CapturedSample, host_ids: torch.Tensor | None = None) -> BlockLayout:
        setup = self.setup
        return build_layout(
            sample.ids if host_ids is None else host_ids,
            sample.mask,
            num_anchors=setup.loss.num_anchors,
            block_size=setup.draft_spec.draft.block_size,
            mask_token_id=setup.draft_spec.draft.mask_token_id,
            loss_decay_gamma=setup.loss.loss_decay_gamma,
            generator=anchor_generator(setup.seed, sample.g),
        )

    def _forward_backward(
        self,
        model: DSparkDraft,
        batch: list[PreparedSample],
        layouts: list[BlockLayout],
        global_weight: float,
        local: dict[str, torch.Tensor],
    ) -> None:
        """One micro-step: every term divided by ``global_weight``, the global sum of slot weights of
        this micro-step (a host number all-reduced on the host: no GPU work waits for it, nor it for
        the GPU), then forward and backward sample by sample, sums into ``local``."""
        s = self.settings
        setup = self.setup
        device = s.device
        accumulation = setup.batch.gradient_accumulation_steps
        coefficients = loss_coefficients(
            ce_weight=setup.loss.ce_weight,
            l1_weight=setup.loss.l1_weight,
            confidence_weight=setup.loss.confidence_weight,
            global_weight_sum=global_weight,
            gradient_scale=s.world_size / accumulation,
            chunk_rows=s.chunk_rows,
        )
        normaliser = max(global_weight, 1.0) * accumulation
        for sample, layout in zip((p.sample for p in batch), layouts, strict=True):
            inputs = SampleInputs(hs=sample.hs.to(device), lhs=sample.lhs.to(device), layout=layout.to(device))
            terms = model(inputs, coefficients)
            terms.loss.backward()
            for name, value in terms.sums.items():
                local[name] += value
            local["loss_ce"] += terms.sums["ce"] / normaliser
            local["loss_l1"] += terms.sums["l1"] / normaliser
            local["loss_confidence"] += terms.sums["confidence"] / normaliser
            del inputs, terms

    # apply update

    def _apply_update(
        self,
        step: int,
        model: DSparkDraft,
        optimizer: torch.optim.Optimizer,
        guard: FiniteGuard,
        local: dict[str, torch.Tensor],
    ) -> tuple[float, list[dict[str, bool]], bool]:
        """Clip, check finiteness on every rank, let the guard decide, step the optimizer.
        Returns the grad norm, every rank's term flags and whether the update was applied."""
        s = self.settings
        grad_norm_tensor = torch.nn.utils.clip_grad_norm_(model.parameters(), self.setup.optimizer.max_grad_norm)
        if hasattr(grad_norm_tensor, "full_tensor"):
            grad_norm_tensor = grad_norm_tensor.full_tensor()
        grad_norm = float(grad_norm_tensor)
        flags = [{t: math.isfinite(float(local[t])) for t in TERMS}]
        rank_terms = [terms for part in gather_objects(flags, s.world_size) for terms in part]
        check = inspect_update(step, rank_terms, grad_norm)
        self.gate.on_update_inspected(step, rank_terms, check, grad_norm)  # before the guard may abort
        applied = guard.decide(check)
        if applied:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, rank_terms, applied

    # report

    def _reduce_sums(self, local: dict[str, torch.Tensor], wait_s: float) -> tuple[dict[str, Any], float]:
        """Sum the step's accumulators over all ranks (one all-reduce); returns the sums with the
        weighted total loss, and the mean data-wait time per rank."""
        s = self.settings
        setup = self.setup
        names = list(SCALAR_SUMS + LOSS_SUMS)
        packed = torch.cat([torch.stack([local[n] for n in names])] + [local[n] for n in SLOT_SUMS])
        packed = torch.cat([packed, torch.tensor([wait_s], dtype=torch.float64, device=s.device)])
        all_reduce_sum(packed)
        sums: dict[str, Any] = {n: float(packed[i]) for i, n in enumerate(names)}
        offset = len(names)
        for name in SLOT_SUMS:
            sums[name] = packed[offset : offset + setup.draft_spec.draft.block_size].tolist()
            offset += setup.draft_spec.draft.block_size
        wait_sum = float(packed[offset])
        loss = setup.loss
        sums["loss_total"] = (
            loss.ce_weight * sums["loss_ce"]
            + loss.l1_weight * sums["loss_l1"]
            + loss.confidence_weight * sums["loss_confidence"]
        )
        return sums, wait_sum / s.world_size

    def _row_indices(self, consumed: list[tuple[int, int | None]]) -> list[int | None]:
        """The data row of every sample of the step on all ranks, in g order."""
        everyone = gather_objects(consumed, self.settings.world_size)
        return [row for _, row in sorted(pair for part in everyone for pair in part)]

    def _record(self, step: int, outcome: StepOutcome, lr: float, guard: FiniteGuard) -> dict[str, Any]:
        s = self.settings
        setup = self.setup
        done = step + 1
        cursor = done * setup.batch.global_batch_size
        record: dict[str, Any] = {"step": done, "epoch": cursor // s.num_rows, "cursor": cursor, "lr": lr}
        record.update(step_metrics(sums=outcome.sums, block_size=setup.draft_spec.draft.block_size))
        step_time = max(outcome.step_time_s, 1e-9)
        record.update(
            grad_norm=outcome.grad_norm,
            tokens_per_s=record["tokens"] / step_time,
            samples_per_s=setup.batch.global_batch_size / step_time,
            step_time_s=outcome.step_time_s,
            data_wait_s=outcome.wait_s,
            data_wait_fraction=min(1.0, outcome.wait_s / step_time),
            skipped=0 if outcome.applied else 1,
            skipped_total=guard.skipped_total,
            row_indices=outcome.row_indices,
        )
        if s.device.type == "cuda" and setup.peak_flops_per_rank:
            # An estimate: the plan's FLOP model scaled to the tokens trained, against the recipe's peak
            # (plan.accelerator_peak_tflops); a CPU's peak in a recipe is a planning guess, so none there.
            achieved = setup.train_flops_per_token * record["tokens"] / step_time
            record[MFU_KEY] = achieved / (setup.peak_flops_per_rank * s.world_size)
        return record

    def _any_rank_stopping(self) -> bool:
        flag = torch.tensor([1.0 if self.stop_requested else 0.0], dtype=torch.float64, device=self.settings.device)
        return bool(all_reduce_sum(flag)[0] > 0)

    # ------------------------------------------------------------------ checkpoints, gate

    def _save(
        self,
        done: int,
        model: DSparkDraft,
        optimizer: torch.optim.Optimizer,
        schedule_state: dict[str, Any],
        guard: FiniteGuard,
        writer: MetricsWriter,
    ) -> checkpoints.SavedCheckpoint:
        s = self.settings
        setup = self.setup
        cursor = done * setup.batch.global_batch_size
        rng = gather_objects(checkpoints.rng_state(), s.world_size)
        state = {
            "step": done,
            "cursor": cursor,
            "epoch": cursor // s.num_rows,
            "global_batch_size": setup.batch.global_batch_size,
            "world_size": s.world_size,
            "schedule": {"type": setup.schedule.type, "state": {**schedule_state, "next_step": done}},
            "recipe_digest": self.setup.recipe_digest,
            "data_digest": s.data_digest,
            "prompt_seed": setup.prompt_seed,
            "draft": setup.draft_spec.draft.model_dump(mode="json"),
            "seed": setup.seed,
            "skipped_updates": guard.skipped_total,
            "consecutive_skips": guard.consecutive,
            "smoke": s.smoke,
            # whose run the checkpoint is: an eval of another job refuses it
            **run_origin(s.job_dir, setup.recipe_digest, done).job_fields(),
        }
        started = time.monotonic()
        saved = checkpoints.save_checkpoint(
            s.checkpoint_dir,
            step=done,
            model=model,
            optimizer=optimizer,
            state=state,
            rng_states=rng,
            keep_last=setup.checkpoint.keep_last,
            is_main=s.is_main,
        )
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in saved.phase_s.items())
        writer.say(
            f"[trainer] checkpoint {saved.path} ({time.monotonic() - started:.1f} s: {parts}; "
            f"weights sha256 {saved.weights_sha256[:16]}...)"
        )
        return saved

    def _smoke_step_done(
        self, done: int, outcome: StepOutcome, model: DSparkDraft, saved: checkpoints.SavedCheckpoint | None
    ) -> None:
        sums = outcome.sums
        self.gate.on_step_done(
            done,
            applied=outcome.applied,
            rank_terms=outcome.rank_terms,
            samples=outcome.samples,
            loss=LossRecord(
                total=sums["loss_total"], ce=sums["loss_ce"], l1=sums["loss_l1"], confidence=sums["loss_confidence"]
            ),
            grad_norm=outcome.grad_norm,
            model=model,
            saved=saved,
        )
