"""Per-step metrics: ``metrics.jsonl`` (always), TensorBoard (recipe), W&B (recipe + key from the
environment), and a progress line every ``log_every_steps``. Only rank 0 writes.

Each ``metrics.jsonl`` line is one optimizer step::

    step, epoch, cursor, lr, loss, loss_ce, loss_l1, loss_confidence, grad_norm, tau,
    acc@k / accept@k (per slot k), confidence_abs_error, tokens, tokens_per_s, samples_per_s,
    step_time_s, data_wait_s, data_wait_fraction, valid_blocks, supervised_slots, skipped,
    skipped_total, row_indices (the data row of every sample of the step, in g order), time
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.files import append_text, atomic_write_text
from runtime.recipe.schema import MetricsConfig
from runtime.shared.contracts import JOB_FOLDER_SETTING


class MetricsSetupError(RuntimeError):
    """A metrics sink the recipe asks for cannot start."""


def step_metrics(
    *,
    sums: Mapping[str, Any],
    block_size: int,
) -> dict[str, float]:
    """Turn all-reduced sums (see :mod:`runtime.trainer.objective`) into the per-step metrics."""
    out: dict[str, float] = {
        "loss": float(sums["loss_total"]),
        "loss_ce": float(sums["loss_ce"]),
        "loss_l1": float(sums["loss_l1"]),
        "loss_confidence": float(sums["loss_confidence"]),
    }
    weight = float(sums["weight"])
    out["confidence_abs_error"] = float(sums["confidence_abs_error"]) / weight if weight else 0.0
    blocks = float(sums["valid_blocks"])
    out["tau"] = float(sums["tau"]) / blocks if blocks else 0.0
    for k in range(block_size):
        count = float(sums["slot_count"][k])
        out[f"acc@{k}"] = float(sums["slot_correct"][k]) / count if count else 0.0
        out[f"accept@{k}"] = float(sums["slot_accept"][k]) / count if count else 0.0
    out["tokens"] = float(sums["tokens"])
    out["valid_blocks"] = blocks
    out["supervised_slots"] = float(sums["supervised_slots"])
    return out


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


MFU_KEY = "mfu"
"""A CUDA trainer's model FLOP utilisation estimate in its metrics (see the trainer loop's record)."""


def progress_line(record: Mapping[str, Any], total_steps: int, elapsed_s: float, steps_done_this_run: int) -> str:
    """One human line: where the run is, how fast, what it waits for, when it ends."""
    step = int(record["step"])
    rate = steps_done_this_run / elapsed_s if elapsed_s > 0 else 0.0
    eta = (total_steps - step) / rate if rate > 0 else float("nan")
    eta_text = _duration(eta) if eta == eta else "?"
    return (
        f"[trainer] step {step}/{total_steps} ({100.0 * step / total_steps:.0f}%) "
        f"loss {record['loss']:.4f} (ce {record['loss_ce']:.4f} l1 {record['loss_l1']:.4f} "
        f"conf {record['loss_confidence']:.4f}) tau {record['tau']:.3f} acc@0 {record['acc@0']:.3f} "
        f"lr {record['lr']:.3e} gnorm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s "
        f"{rate * 60:.2f} step/min, data wait {100.0 * record['data_wait_fraction']:.0f}%"
        f"{f', MFU {100.0 * record[MFU_KEY]:.2g}%' if MFU_KEY in record else ''} | "
        f"skipped {int(record['skipped_total'])} | ETA {eta_text}"
    )


class MetricsWriter:
    """Rank 0's metrics sinks."""

    def __init__(
        self,
        job_dir: Path,
        config: MetricsConfig,
        *,
        run_name: str,
        enabled: bool,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.enabled = enabled
        self.path = job_dir / "metrics.jsonl"
        self._tensorboard: Any = None
        self._wandb: Any = None
        if not enabled:
            return
        job_dir.mkdir(parents=True, exist_ok=True)
        if config.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise MetricsSetupError(
                    f"trainer.metrics.tensorboard is true but TensorBoard cannot be imported ({exc}); "
                    "fix: pip install tensorboard, or set trainer.metrics.tensorboard: false"
                ) from exc
            self._tensorboard = SummaryWriter(log_dir=str(job_dir / "tensorboard"))
        if config.wandb_project:
            env = os.environ if env is None else env
            if not env.get("WANDB_API_KEY"):
                raise MetricsSetupError(
                    f"trainer.metrics.wandb_project is {config.wandb_project!r} but WANDB_API_KEY is not in the "
                    "environment; fix: export WANDB_API_KEY in the submitting shell (never in the recipe), or "
                    "unset trainer.metrics.wandb_project"
                )
            try:
                import wandb
            except ImportError as exc:
                raise MetricsSetupError(
                    "trainer.metrics.wandb_project is set but the wandb package is missing; fix: pip install wandb"
                ) from exc
            self._wandb = wandb.init(
                project=config.wandb_project, entity=config.wandb_entity, name=run_name, resume="allow"
            )

    def resume_at(self, step: int) -> int:
        """Drop the rows after ``step`` (the run restarts from the checkpoint of that step: after a
        requeue or a crash the steps beyond it are trained again and must not appear twice), and a
        half-written last line. Returns how many rows were dropped; atomic (temp file + rename)."""
        if not self.enabled or not self.path.exists():
            return 0
        kept, dropped = [], 0
        for line in self.path.read_text(errors="replace").splitlines(keepends=True):
            try:
                row_step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                dropped += 1
                continue
            if row_step <= step and line.endswith("\n"):
                kept.append(line)
            else:
                dropped += 1
        if dropped:
            atomic_write_text(self.path, "".join(kept), JOB_FOLDER_SETTING)
            self.say(f"[trainer] metrics.jsonl: dropped {dropped} row(s) after step {step} (trained again from there)")
        return dropped

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one step's record to every sink."""
        if not self.enabled:
            return
        line = {**record, "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        append_text(self.path, json.dumps(line) + "\n", JOB_FOLDER_SETTING)
        step = int(record["step"])
        numbers = {k: v for k, v in record.items() if isinstance(v, int | float) and k != "step"}
        if self._tensorboard is not None:
            for key, value in numbers.items():
                self._tensorboard.add_scalar(f"train/{key}", value, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log({f"train/{k}": v for k, v in numbers.items()}, step=step)

    def say(self, text: str) -> None:
        """A log line from rank 0 (stdout, flushed: the job log is not a TTY)."""
        if self.enabled:
            print(text, file=sys.stdout, flush=True)

    def close(self) -> None:
        """Flush and close the sinks."""
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
