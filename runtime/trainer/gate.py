"""The trainer's part of the smoke gate: one object the loop calls at a few named points, which
builds ``trainer_gate.json`` (:class:`runtime.shared.contracts.TrainerGateRecord`) in the job folder.

The runbook's gate is "one finite optimizer update on all ranks + checkpoint". In smoke mode the
trainer runs its single step, saves a checkpoint, reads it back into fresh tensors and compares
weight hashes. The loop calls:

- :meth:`SmokeGate.on_sample` for every captured sample a rank receives (the capture contract);
- :meth:`SmokeGate.on_update_inspected` once the update's finiteness is known on every rank, before
  the guard may abort (so a failed gate still shows every rank's samples);
- :meth:`SmokeGate.on_step_done` after the checkpoint: finite parameters, reload hash, verdict;
- :meth:`SmokeGate.on_export` and :meth:`SmokeGate.on_failure`.

Rank 0 writes the record, on failure too (``passed: false`` with ``problems``/``error``) before the
trainer exits non-zero, so the gate always has a file to read once the trainer got that far. Outside
smoke mode every call does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from runtime.shared.contracts import (
    TRAINER_GATE_FILE,
    CheckpointGateRecord,
    FieldRecord,
    LossRecord,
    RankGateRecord,
    SampleContractRecord,
    TrainerGateRecord,
    dtype_name,
    sample_problems,
    write_record,
)
from runtime.trainer.distributed import gather_objects
from runtime.trainer.guard import NonFiniteUpdate, UpdateCheck

if TYPE_CHECKING:
    from runtime.shared.contracts import CapturedSample
    from runtime.trainer.checkpoints import SavedCheckpoint


@dataclass(frozen=True)
class GateSettings:
    """What the trainer's smoke gate records and checks (built by the trainer's setup)."""

    enabled: bool
    """A smoke run: the gate records; otherwise every call does nothing."""
    job_dir: Path
    """Where ``trainer_gate.json`` goes."""
    checks_captured_samples: bool
    """``trainer.sample_source`` is mooncake: the samples come from the capture engine and are held to
    its contract (synthetic sample files are not)."""
    aux_layer_ids: tuple[int, ...]
    """``capture.aux_layer_ids``."""
    hidden_size: int
    """``capture.hidden_size``."""
    max_length_tokens: int
    """``data.max_length``."""


class SmokeGate:
    """Builds and writes this trainer's smoke-gate record (inactive outside smoke mode)."""

    def __init__(self, settings: GateSettings, *, rank: int, world_size: int) -> None:
        self.settings = settings
        self.path = settings.job_dir / TRAINER_GATE_FILE
        self.rank = rank
        self.world_size = world_size
        self.enabled = settings.enabled
        self.record = TrainerGateRecord()
        self.contract = SampleContractRecord()
        """The capture contract as checked on every captured sample this rank received."""

    def on_sample(self, sample: CapturedSample) -> None:
        """Check the capture contract on a received sample (captured samples only: the contract
        is about what the capture engine produced, not about synthetic sample files)."""
        settings = self.settings
        if not self.enabled or not settings.checks_captured_samples:
            return
        self.contract.samples.append(sample.g)
        if self.contract.fields is None:
            self.contract.fields = {
                name: FieldRecord(dtype=dtype_name(t.dtype), shape=list(t.shape))
                for name, t in sample.tensors().items()
            }
        self.contract.problems += sample_problems(
            sample, settings.aux_layer_ids, settings.hidden_size, settings.max_length_tokens
        )

    def on_update_inspected(
        self, step: int, rank_terms: list[dict[str, bool]], check: UpdateCheck, grad_norm: float
    ) -> None:
        """Record the update's finiteness and every rank's samples (collective: all ranks call)."""
        if not self.enabled:
            return
        contracts = gather_objects(self.contract, self.world_size)
        self.record = TrainerGateRecord(
            step=step + 1,
            world_size=self.world_size,
            update_finite=check.finite,
            grad_norm=grad_norm,
            problems=list(check.problems),
            ranks=[
                RankGateRecord(rank=r, terms_finite=rank_terms[r], sample_contract=contracts[r])
                for r in range(self.world_size)
            ],
        )

    def on_step_done(
        self,
        done: int,
        *,
        applied: bool,
        rank_terms: list[dict[str, bool]],
        samples: list[int],
        loss: LossRecord,
        grad_norm: float,
        model: torch.nn.Module,
        saved: SavedCheckpoint | None,
    ) -> None:
        """After the smoke step's checkpoint: check finite parameters on every rank and the
        checkpoint's reload hash, write the record, and raise when anything failed (collective)."""
        if not self.enabled:
            return
        from runtime.trainer.checkpoints import loaded_weights_sha256

        finite_after = all(
            bool(torch.isfinite(p.detach().to_local() if hasattr(p, "to_local") else p).all())
            for p in model.parameters()
        )
        mine = RankGateRecord(
            rank=self.rank,
            terms_finite=rank_terms[self.rank],
            params_finite_after_update=finite_after,
            samples=samples,
            sample_contract=self.contract,
        )
        per_rank = gather_objects(mine, self.world_size)
        reloaded = loaded_weights_sha256(saved.path, model) if saved else None
        matches = saved is not None and reloaded == saved.weights_sha256
        problems = list(self.record.problems)
        if not applied:
            problems.append("the update was not applied")
        not_finite = [r.rank for r in per_rank if not r.params_finite_after_update]
        if not_finite:
            problems.append(f"parameters are not finite after the update on rank(s) {not_finite}")
        if not matches:
            problems.append("the checkpoint read back does not hash to the saved weights")
        problems += [p for r in per_rank for p in r.sample_contract.problems]
        self.record = TrainerGateRecord(
            passed=not problems,
            step=done,
            world_size=self.world_size,
            update_finite=self.record.update_finite,
            update_applied=applied,
            grad_norm=grad_norm,
            loss=loss,
            ranks=per_rank,
            problems=problems,
            checkpoint=CheckpointGateRecord(
                path=str(saved.path) if saved else None,
                weights_sha256=saved.weights_sha256 if saved else None,
                reloaded_sha256=reloaded,
                reload_matches=matches,
            ),
        )
        self._write()
        if problems:
            raise NonFiniteUpdate("smoke gate failed: " + "; ".join(problems))

    def on_export(self, target: Path) -> None:
        """Record where the smoke run exported the draft."""
        if not self.enabled:
            return
        self.record.export = str(target)
        self._write()

    def on_failure(self, exc: BaseException) -> None:
        """Record the error that ended the trainer (the record so far, ``passed: false``)."""
        if not self.enabled:
            return
        self.record.passed = False
        self.record.error = f"{type(exc).__name__}: {exc}"
        self._write()

    def _write(self) -> None:
        if self.rank == 0:
            write_record(self.path, self.record)
