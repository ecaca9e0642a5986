"""The training loop: set up, start (fresh / resume / warm start), step, checkpoint, export, gate.

One optimizer step ``s`` consumes ``g`` in ``[s*G, (s+1)*G)`` through the fixed map of
:func:`runtime.transport.contract.global_sample_index`. Within a micro-step, the slot weights of
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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from runtime.recipe.loader import ResolvedRecipe
from runtime.trainer import checkpoints
from runtime.trainer.distributed import all_reduce_sum, barrier, init_process_group, shard_model
from runtime.trainer.export import export_draft
from runtime.trainer.frozen_vocab import load_frozen_vocab
from runtime.trainer.gate import write_gate
from runtime.trainer.guard import TERMS, FiniteGuard, NonFiniteUpdate, inspect_update
from runtime.trainer.layout import BlockLayout, anchor_generator, build_layout
from runtime.trainer.metrics import MetricsWriter, progress_line, step_metrics
from runtime.trainer.model import DSparkDraft, SampleInputs
from runtime.trainer.objective import SCALAR_SUMS, SLOT_SUMS, loss_coefficients
from runtime.trainer.prefetch import StepPrefetcher
from runtime.trainer.resume import StartPlan, check_resume_compatible, plan_start
from runtime.trainer.schedules import build_schedule
from runtime.trainer.settings import RunSettings
from runtime.trainer.sources import check_sample, open_sample_source
from runtime.transport.contract import SampleConsumer, contract_problems, global_sample_index

LOSS_SUMS: tuple[str, ...] = ("loss_ce", "loss_l1", "loss_confidence")
EXIT_STOPPED = 143
"""Exit code after a SIGTERM was honoured at a step boundary (checkpoint written)."""


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

    def __init__(self, resolved: ResolvedRecipe, settings: RunSettings) -> None:
        self.resolved = resolved
        self.recipe = resolved.recipe
        self.settings = settings
        self.trainer_cfg = self.recipe.trainer
        self.stop_requested = False
        self._gate: dict[str, Any] = {}
        """The smoke gate record being built (see :mod:`runtime.trainer.gate`)."""
        self._copy_stream: Any = None
        self._contract: dict[str, Any] = {"samples": [], "fields": None, "problems": []}
        """Smoke mode: the capture contract checked on every sample this rank received."""
        self._prepared_layouts: dict[int, BlockLayout] = {}
        """Layouts the prefetch thread built, by g (see :meth:`_fetcher`)."""
        self._copied: dict[int, Any] = {}
        """CUDA events marking the end of each prefetched sample's copy, by g."""

    # ------------------------------------------------------------------ setup

    def _build_model(self) -> DSparkDraft:
        cfg = self.trainer_cfg
        torch.manual_seed(cfg.seed)  # identical init on every rank, whatever the world size
        with torch.device(self.settings.device):
            model = DSparkDraft(
                cfg.draft,
                vocab_size=self.recipe.capture.vocab_size,
                num_aux_layers=self.recipe.num_aux_layers,
                attention_backend=self.settings.attention_backend,
                max_length=self.recipe.data.max_length,
                compile_regions=self.settings.compile_regions,
            )
        embed, lm_head = load_frozen_vocab(
            self.resolved.resolve_path(self.recipe.capture.target_path),
            embed_tensor_name=cfg.embed_tensor_name,
            lm_head_tensor_name=cfg.lm_head_tensor_name,
            vocab_size=self.recipe.capture.vocab_size,
            hidden_size=self.recipe.capture.hidden_size,
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
        cfg = self.trainer_cfg
        init_process_group(s, self.recipe.transport.idle_timeout_s)
        self._install_stop_handler()
        writer = MetricsWriter(s.job_dir, cfg.metrics, run_name=self.recipe.job.name, enabled=s.is_main)
        try:
            return self._run(writer)
        except Exception as exc:
            if s.smoke and s.is_main:
                write_gate(s.job_dir, {**self._gate, "passed": False, "error": f"{type(exc).__name__}: {exc}"})
            raise
        finally:
            writer.close()

    def _run(self, writer: MetricsWriter) -> int:
        s = self.settings
        cfg = self.trainer_cfg
        model = self._build_model()
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.optimizer.lr,
            betas=cfg.optimizer.betas,
            eps=cfg.optimizer.eps,
            weight_decay=cfg.optimizer.weight_decay,
        )
        schedule = build_schedule(cfg.schedule, base_lr=cfg.optimizer.lr, run_total_steps=s.total_steps)
        plan = plan_start(self.recipe, s.checkpoint_dir, self.resolved.digest)
        start_step, guard = self._start(plan, model, optimizer, writer)
        source = open_sample_source(self.resolved, s.rank, s.world_size)
        try:
            return self._train(model, optimizer, schedule, plan, start_step, guard, source, writer)
        finally:
            close = getattr(source, "close", None)
            if close is not None:
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
        cfg = self.trainer_cfg
        if s.is_main:  # the producer's window starts at the cursor: a resumed run republishes its own
            source.publish_cursor(start_step * cfg.global_batch_size)
        writer.say(
            f"[trainer] {plan.kind} ({plan.reason}{': ' + str(plan.path) if plan.path else ''}); steps "
            f"{start_step}..{s.total_steps - 1} of {s.total_steps}, world {s.world_size}, device {s.device}, "
            f"attention {s.attention_backend}, G={cfg.global_batch_size} ({cfg.micro_batch_size} x "
            f"{cfg.gradient_accumulation_steps} x {s.world_size}), {sum(p.numel() for p in model.parameters()):,} "
            "trainable parameters"
        )
        run_started = time.monotonic()
        last_saved: checkpoints.SavedCheckpoint | None = None
        step = start_step
        for step in range(start_step, s.total_steps):
            for group in optimizer.param_groups:
                group["lr"] = schedule.lr(step)
            outcome = self._train_step(step, model, optimizer, source, guard)
            source.commit_step(step)
            record = self._record(step, outcome, schedule.lr(step), guard)
            writer.write(record)
            done = step + 1
            if done % cfg.log_every_steps == 0 or done == s.total_steps or s.smoke:
                writer.say(progress_line(record, s.total_steps, time.monotonic() - run_started, done - start_step))
            stop = self._any_rank_stopping()
            if done % cfg.checkpoint.every_steps == 0 or done == s.total_steps or s.smoke or stop:
                last_saved = self._save(done, model, optimizer, schedule.state(), guard, writer)
            if s.smoke:
                self._smoke_gate(done, outcome, model, last_saved)
            if stop:
                writer.say(
                    f"[trainer] stopped after step {done} on request; checkpoint {last_saved.path if last_saved else None}"
                )
                return EXIT_STOPPED
        target = s.checkpoint_dir / f"export-{checkpoints.step_dir_name(s.total_steps)}"
        # also after a restart that found every step done but no export (a crash while exporting)
        if cfg.checkpoint.export_safetensors and (s.total_steps > start_step or not target.exists()):
            export_draft(model, target, self.recipe, dtype=s.param_dtype, is_main=s.is_main)
            writer.say(f"[trainer] exported the draft for SGLang to {target}")
            if s.smoke:
                self._gate["export"] = str(target)
                if s.is_main:
                    write_gate(s.job_dir, self._gate)
        writer.say(f"[trainer] finished {s.total_steps} steps in {time.monotonic() - run_started:.1f} s")
        barrier()
        return 0

    def _start(
        self, plan: StartPlan, model: DSparkDraft, optimizer: torch.optim.Optimizer, writer: MetricsWriter
    ) -> tuple[int, FiniteGuard]:
        s = self.settings
        cfg = self.trainer_cfg
        guard = FiniteGuard(smoke=s.smoke, max_consecutive_skips=cfg.max_consecutive_skips)
        if plan.kind == "resume" and plan.path is not None:
            state = checkpoints.read_state(plan.path)
            check_resume_compatible(state, self._identity(), plan.path)
            checkpoints.load_full(plan.path, model, optimizer)
            rng = state.get("rng") or []
            if s.rank < len(rng):
                checkpoints.restore_rng(rng[s.rank])
            guard.skipped_total = int(state.get("skipped_updates", 0))
            guard.consecutive = int(state.get("consecutive_skips", 0))
            return int(state["step"]), guard
        if plan.kind == "init" and plan.path is not None:
            checkpoints.load_weights(plan.path, model)
            writer.say(f"[trainer] warm start: weights from {plan.path}; optimizer, schedule, counters and RNG fresh")
        return 0, guard

    def _identity(self) -> dict[str, Any]:
        cfg = self.trainer_cfg
        return {
            "schedule_type": cfg.schedule.type,
            "world_size": self.settings.world_size,
            "data_digest": self.settings.data_digest,
            "prompt_seed": cfg.effective_prompt_seed,
            "global_batch_size": cfg.global_batch_size,
        }

    # ------------------------------------------------------------------ one step

    def _fetcher(self, source: SampleConsumer) -> Any:
        """The prefetch thread's fetch. On CUDA the sample is copied to the GPU on a side stream
        inside the fetch (the Mooncake consumer stages it through pinned buffers), overlapping
        with the compute of the previous sample on the default stream."""
        device = self.settings.device
        if device.type != "cuda":
            return source.fetch
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)

        def fetch(g: int) -> Any:
            torch.cuda.set_device(device)  # the current device is per thread
            with torch.cuda.stream(self._copy_stream):
                sample = source.fetch(g, device)  # type: ignore[call-arg]
                copied = self._copy_stream.record_event()
                self._copied[g] = copied
                # The layout (anchor sampling on the host) is built here, beside the previous
                # sample's compute, once the copy is done: started earlier, its small device-to-host
                # read of ids would sit in the driver behind the multi-GiB copy, and the compute
                # thread's own small reads (loss scalars) behind it (seen in a trace: ~0.1 s of idle
                # GPU in some 64K K3 micro-steps).
                copied.synchronize()
                self._prepared_layouts[g] = self._layout(sample)
                return sample

        return fetch

    def _received(self, sample: Any) -> Any:
        """Hand a prefetched sample's GPU tensors over to the compute stream."""
        if self.settings.device.type == "cuda":
            current = torch.cuda.current_stream(self.settings.device)
            # Wait for this sample's copy only: waiting on the copy stream as a whole would also
            # wait for the next sample's copy, which the prefetch thread may have queued already
            # (measured: ~0.1 s of idle GPU per 64K K3 micro-step).
            copied = self._copied.pop(sample.g, None)
            if copied is not None:
                current.wait_event(copied)
            else:
                current.wait_stream(self._copy_stream)
            for tensor in sample.tensors().values():
                if tensor.is_cuda:
                    tensor.record_stream(current)  # freed memory must not be reused by the copy stream early
        return sample

    def _check_contract(self, sample: Any) -> None:
        """Smoke gate: record the sample's fields and any break of the capture contract."""
        capture = self.recipe.capture
        self._contract["samples"].append(sample.g)
        if self._contract["fields"] is None:
            self._contract["fields"] = {
                name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                for name, t in sample.tensors().items()
            }
        self._contract["problems"] += contract_problems(
            sample, capture.aux_layer_ids, capture.hidden_size, self.recipe.data.max_length
        )

    def _layout(self, sample: Any) -> BlockLayout:
        cfg = self.trainer_cfg
        return build_layout(
            sample.ids,
            sample.mask,
            num_anchors=cfg.loss.num_anchors,
            block_size=cfg.draft.block_size,
            mask_token_id=cfg.draft.mask_token_id,
            loss_decay_gamma=cfg.loss.loss_decay_gamma,
            generator=anchor_generator(cfg.seed, sample.g),
        )

    def _train_step(
        self,
        step: int,
        model: DSparkDraft,
        optimizer: torch.optim.Optimizer,
        source: SampleConsumer,
        guard: FiniteGuard,
    ) -> StepOutcome:
        s = self.settings
        cfg = self.trainer_cfg
        started = time.monotonic()
        accumulation, micro = cfg.gradient_accumulation_steps, cfg.micro_batch_size
        gs = [
            global_sample_index(step, m, s.rank, b, s.world_size, micro, accumulation)
            for m in range(accumulation)
            for b in range(micro)
        ]
        device = s.device
        local = {name: torch.zeros((), dtype=torch.float64, device=device) for name in SCALAR_SUMS + LOSS_SUMS}
        local.update(
            {name: torch.zeros(cfg.draft.block_size, dtype=torch.float64, device=device) for name in SLOT_SUMS}
        )
        prefetch = StepPrefetcher(self._fetcher(source), gs)
        consumed: list[tuple[int, int | None]] = []
        try:
            for _m in range(accumulation):
                samples = [self._received(prefetch.next()) for _ in range(micro)]
                consumed += [(sample.g, sample.meta.get("row_index")) for sample in samples]
                for sample in samples:
                    if s.smoke and self.recipe.trainer.sample_source == "mooncake":
                        self._check_contract(sample)  # the capture contract is about captured samples
                    check_sample(
                        sample,
                        num_aux_layers=self.recipe.num_aux_layers,
                        hidden_size=self.recipe.capture.hidden_size,
                        vocab_size=self.recipe.capture.vocab_size,
                    )
                layouts = [self._prepared_layouts.pop(sample.g, None) or self._layout(sample) for sample in samples]
                weight = torch.tensor(sum(float(x.weights.sum()) for x in layouts), dtype=torch.float64, device=device)
                global_weight = float(all_reduce_sum(weight))
                coefficients = loss_coefficients(
                    ce_weight=cfg.loss.ce_weight,
                    l1_weight=cfg.loss.l1_weight,
                    confidence_weight=cfg.loss.confidence_weight,
                    global_weight_sum=global_weight,
                    gradient_scale=s.world_size / accumulation,
                    chunk_rows=s.chunk_rows,
                )
                normaliser = max(global_weight, 1.0) * accumulation
                for sample, layout in zip(samples, layouts, strict=True):
                    inputs = SampleInputs(hs=sample.hs.to(device), lhs=sample.lhs.to(device), layout=layout.to(device))
                    terms = model(inputs, coefficients)
                    terms.loss.backward()
                    for name, value in terms.sums.items():
                        local[name] += value
                    local["loss_ce"] += terms.sums["ce"] / normaliser
                    local["loss_l1"] += terms.sums["l1"] / normaliser
                    local["loss_confidence"] += terms.sums["confidence"] / normaliser
                    del inputs, terms
        finally:
            prefetch.close()
        wait_s = prefetch.wait_s

        grad_norm_tensor = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.max_grad_norm)
        if hasattr(grad_norm_tensor, "full_tensor"):
            grad_norm_tensor = grad_norm_tensor.full_tensor()
        grad_norm = float(grad_norm_tensor)

        flags = torch.tensor(
            [[1.0 if math.isfinite(float(local[t])) else 0.0 for t in TERMS]], dtype=torch.float64, device=device
        )
        gathered = [torch.zeros_like(flags) for _ in range(s.world_size)]
        if s.world_size > 1:
            dist.all_gather(gathered, flags)
        else:
            gathered = [flags]
        rank_terms = [{t: bool(row[0, i] > 0.5) for i, t in enumerate(TERMS)} for row in gathered]
        check = inspect_update(step, rank_terms, grad_norm)
        self._gate = {
            "step": step + 1,
            "world_size": s.world_size,
            "update_finite": check.finite,
            "grad_norm": grad_norm,
            "problems": check.problems,
        }
        if s.smoke:
            # Gathered before the guard may abort, so a failed gate still shows every rank's samples.
            contracts: list[Any] = [None] * s.world_size
            if s.world_size > 1:
                dist.all_gather_object(contracts, self._contract)
            else:
                contracts = [self._contract]
            self._gate["ranks"] = [
                {"rank": r, "terms_finite": rank_terms[r], "sample_contract": contracts[r]} for r in range(s.world_size)
            ]
        applied = guard.decide(check)
        if applied:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        names = list(SCALAR_SUMS + LOSS_SUMS)
        packed = torch.cat([torch.stack([local[n] for n in names])] + [local[n] for n in SLOT_SUMS])
        packed = torch.cat([packed, torch.tensor([wait_s], dtype=torch.float64, device=device)])
        all_reduce_sum(packed)
        sums: dict[str, Any] = {n: float(packed[i]) for i, n in enumerate(names)}
        offset = len(names)
        for name in SLOT_SUMS:
            sums[name] = packed[offset : offset + cfg.draft.block_size].tolist()
            offset += cfg.draft.block_size
        wait_sum = float(packed[offset])
        loss = cfg.loss
        sums["loss_total"] = (
            loss.ce_weight * sums["loss_ce"]
            + loss.l1_weight * sums["loss_l1"]
            + loss.confidence_weight * sums["loss_confidence"]
        )
        everyone: list[Any] = [None] * s.world_size
        if s.world_size > 1:
            dist.all_gather_object(everyone, consumed)
        else:
            everyone = [consumed]
        row_indices = [row for _, row in sorted(pair for part in everyone for pair in part)]
        return StepOutcome(
            row_indices=row_indices,
            sums=sums,
            rank_terms=rank_terms,
            grad_norm=grad_norm,
            applied=applied,
            wait_s=wait_sum / s.world_size,
            step_time_s=time.monotonic() - started,
            samples=gs,
        )

    def _record(self, step: int, outcome: StepOutcome, lr: float, guard: FiniteGuard) -> dict[str, Any]:
        s = self.settings
        cfg = self.trainer_cfg
        done = step + 1
        cursor = done * cfg.global_batch_size
        record: dict[str, Any] = {"step": done, "epoch": cursor // s.num_rows, "cursor": cursor, "lr": lr}
        record.update(step_metrics(sums=outcome.sums, block_size=cfg.draft.block_size))
        step_time = max(outcome.step_time_s, 1e-9)
        record.update(
            grad_norm=outcome.grad_norm,
            tokens_per_s=record["tokens"] / step_time,
            samples_per_s=cfg.global_batch_size / step_time,
            step_time_s=outcome.step_time_s,
            data_wait_s=outcome.wait_s,
            data_wait_fraction=min(1.0, outcome.wait_s / step_time),
            skipped=0 if outcome.applied else 1,
            skipped_total=guard.skipped_total,
            row_indices=outcome.row_indices,
        )
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
        cfg = self.trainer_cfg
        cursor = done * cfg.global_batch_size
        rng = [None] * s.world_size
        if s.world_size > 1:
            dist.all_gather_object(rng, checkpoints.rng_state())
        else:
            rng = [checkpoints.rng_state()]
        state = {
            "step": done,
            "cursor": cursor,
            "epoch": cursor // s.num_rows,
            "global_batch_size": cfg.global_batch_size,
            "world_size": s.world_size,
            "schedule": {"type": cfg.schedule.type, "state": {**schedule_state, "next_step": done}},
            "recipe_digest": self.resolved.digest,
            "data_digest": s.data_digest,
            "prompt_seed": cfg.effective_prompt_seed,
            "seed": cfg.seed,
            "skipped_updates": guard.skipped_total,
            "consecutive_skips": guard.consecutive,
            "smoke": s.smoke,
        }
        started = time.monotonic()
        saved = checkpoints.save_checkpoint(
            s.checkpoint_dir,
            step=done,
            model=model,
            optimizer=optimizer,
            state=state,
            rng_states=rng,
            keep_last=cfg.checkpoint.keep_last,
            is_main=s.is_main,
        )
        writer.say(
            f"[trainer] checkpoint {saved.path} ({time.monotonic() - started:.1f} s, weights sha256 {saved.weights_sha256[:16]}...)"
        )
        return saved

    def _smoke_gate(
        self, done: int, outcome: StepOutcome, model: DSparkDraft, saved: checkpoints.SavedCheckpoint | None
    ) -> None:
        s = self.settings
        finite_after = all(
            bool(torch.isfinite(p.detach().to_local() if hasattr(p, "to_local") else p).all())
            for p in model.parameters()
        )
        per_rank: list[Any] = [None] * s.world_size
        mine = {
            "rank": s.rank,
            "terms_finite": outcome.rank_terms[s.rank],
            "params_finite_after_update": finite_after,
            "samples": outcome.samples,
            "sample_contract": self._contract,
        }
        if s.world_size > 1:
            dist.all_gather_object(per_rank, mine)
        else:
            per_rank = [mine]
        reloaded = checkpoints.loaded_weights_sha256(saved.path, model) if saved else None
        matches = saved is not None and reloaded == saved.weights_sha256
        problems = list(self._gate.get("problems", []))
        if not outcome.applied:
            problems.append("the update was not applied")
        if not all(r["params_finite_after_update"] for r in per_rank):
            problems.append(
                "parameters are not finite after the update on rank(s) "
                + str([r["rank"] for r in per_rank if not r["params_finite_after_update"]])
            )
        if not matches:
            problems.append("the checkpoint read back does not hash to the saved weights")
        problems += [p for r in per_rank for p in r["sample_contract"]["problems"]]
        sums = outcome.sums
        self._gate = {
            "passed": not problems,
            "step": done,
            "world_size": s.world_size,
            "update_finite": self._gate.get("update_finite", False),
            "grad_norm": outcome.grad_norm,
            "loss": {
                "total": sums["loss_total"],
                "ce": sums["loss_ce"],
                "l1": sums["loss_l1"],
                "confidence": sums["loss_confidence"],
            },
            "ranks": per_rank,
            "problems": problems,
            "checkpoint": {
                "path": str(saved.path) if saved else None,
                "weights_sha256": saved.weights_sha256 if saved else None,
                "reloaded_sha256": reloaded,
                "reload_matches": matches,
            },
            "export": None,
            "error": None,
        }
        if s.is_main:
            write_gate(s.job_dir, self._gate)
        if problems:
            raise NonFiniteUpdate("smoke gate failed: " + "; ".join(problems))
