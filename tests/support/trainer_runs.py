"""Helpers for the trainer's multi-process tests (no tests here): a tiny synthetic target and sample
folder, resolved recipes derived from recipes/tiny.yaml, and real trainer ranks started as
``python3 -m runtime.trainer`` processes with the launcher's environment contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from runtime.recipe import load_recipe, write_resolved
from runtime.trainer import checkpoints
from runtime.trainer.synthetic import write_synthetic_samples, write_target_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
VOCAB, HIDDEN, N_AUX = 512, 64, 3
DATA_SHA256 = "ab" * 32

BASE_OVERRIDES = [
    f"capture.hidden_size={HIDDEN}",
    f"capture.vocab_size={VOCAB}",
    f"trainer.draft.hidden_size={HIDDEN}",
    "trainer.draft.num_attention_heads=4",
    "trainer.draft.num_key_value_heads=2",
    "trainer.draft.head_dim=16",
    "trainer.draft.intermediate_size=128",
    "trainer.draft.markov_rank=8",
    "trainer.loss.num_anchors=8",
    "trainer.loss.objective_chunk_blocks=3",
    "trainer.param_dtype=float32",
    "trainer.metrics.tensorboard=false",
    "trainer.sample_source=files",
    "data.max_length=96",
    f"data.expected_sha256={DATA_SHA256}",
    "data.num_rows=16",
    "trainer.epochs=4",
]


def save_one_rank(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, keep_last: int = 3
) -> checkpoints.SavedCheckpoint:
    """A single-process checkpoint of ``model`` and ``optimizer`` at ``step`` (the trainer's own saver)."""
    return checkpoints.save_checkpoint(
        folder,
        step=step,
        model=model,
        optimizer=optimizer,
        state={"step": step},
        rng_states=[checkpoints.rng_state()],
        keep_last=keep_last,
        is_main=True,
    )


def make_inputs(root: Path, count: int = 48) -> tuple[Path, Path]:
    """A sharded target checkpoint and ``count`` samples (T between 40 and 96)."""
    target = write_target_checkpoint(root / "target", vocab_size=VOCAB, hidden_size=HIDDEN)
    samples = write_synthetic_samples(
        root / "samples",
        count,
        min_tokens=40,
        max_tokens=96,
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_aux_layers=N_AUX,
    )
    return target, samples


@dataclass
class Run:
    """One trainer run folder."""

    job_dir: Path
    recipe_path: Path
    checkpoint_dir: Path
    world_size: int

    def metrics(self) -> list[dict[str, Any]]:
        """Rows of metrics.jsonl."""
        path = self.job_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def exported(self, step: int) -> dict[str, torch.Tensor]:
        """Weights exported after ``step`` steps."""
        return load_file(str(self.checkpoint_dir / f"export-step_{step:08d}" / "model.safetensors"))

    def state(self, step: int) -> dict[str, Any]:
        """trainer_state.json of checkpoint ``step``."""
        return json.loads((self.checkpoint_dir / f"step_{step:08d}" / "trainer_state.json").read_text())

    def full_checkpoint(self, step: int, tmp: Path) -> dict[str, Any]:
        """Checkpoint ``step`` (model + optimizer) gathered into full tensors."""
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        out = tmp / f"full-{self.job_dir.name}-{step}.pt"
        dcp_to_torch_save(str(self.checkpoint_dir / f"step_{step:08d}" / "dcp"), str(out))
        return torch.load(out, weights_only=False)


def make_run(
    root: Path,
    name: str,
    *,
    world_size: int,
    target: Path,
    samples: Path,
    overrides: list[str],
    checkpoint_dir: Path | None = None,
    smoke: bool = False,
) -> Run:
    """Resolve recipes/tiny.yaml with the test shapes plus ``overrides`` into ``root/name``."""
    checkpoint_dir = checkpoint_dir or root / name / "checkpoints"
    all_overrides = [
        *BASE_OVERRIDES,
        f"capture.target_path={target}",
        f"trainer.sample_dir={samples}",
        f"job.trainer.tasks_per_node={world_size}",
        f"trainer.checkpoint.dir={checkpoint_dir}",
        *overrides,
    ]
    loaded = load_recipe(REPO_ROOT / "recipes" / "tiny.yaml", overrides=all_overrides, smoke=smoke)
    job_dir = root / name
    recipe_path = write_resolved(loaded, job_dir, REPO_ROOT)
    return Run(job_dir=job_dir, recipe_path=recipe_path, checkpoint_dir=checkpoint_dir, world_size=world_size)


@dataclass
class Launch:
    """Exit codes and logs of every rank."""

    codes: list[int]
    logs: list[str]

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.codes)

    def text(self) -> str:
        return "\n".join(
            f"--- rank {r} (exit {c})\n{log}" for r, (c, log) in enumerate(zip(self.codes, self.logs, strict=True))
        )


def start(run: Run, port: int, env_extra: dict[str, str] | None = None) -> list[subprocess.Popen[str]]:
    """Start every rank of ``run`` as ``python3 -m runtime.trainer`` (the launcher's env contract)."""
    processes = []
    for rank in range(run.world_size):
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        }
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(run.world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            DSPARK_JOB_DIR=str(run.job_dir),
            OMP_NUM_THREADS="1",
        )
        env.update(env_extra or {})
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "runtime.trainer", "--recipe", str(run.recipe_path)],
                cwd=REPO_ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return processes


def wait_all(processes: list[subprocess.Popen[str]], timeout_s: float = 300.0) -> Launch:
    """Wait for every rank; kill the ones still running after ``timeout_s``."""
    logs, codes = [], []
    try:
        for process in processes:
            out, _ = process.communicate(timeout=timeout_s)
            logs.append(out)
            codes.append(process.returncode)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return Launch(codes=codes, logs=logs)


def launch(run: Run, port: int, timeout_s: float = 300.0, env_extra: dict[str, str] | None = None) -> Launch:
    """Start every rank of ``run`` and wait for all of them."""
    return wait_all(start(run, port, env_extra), timeout_s)
