"""How a trainer starts: fresh, full resume, or weights-only warm start; and the resume checks.

- ``resume_from: auto``: the newest complete checkpoint in ``checkpoint_dir``; when there is none,
  ``init_from`` (if set), else fresh. This is what a requeued run wants.
- ``resume_from: PATH``: that checkpoint, everything restored.
- ``resume_from`` unset: when ``checkpoint_dir`` already holds a checkpoint written by this same
  recipe (same digest), this is a restart of the same job (Slurm requeue reuses the resolved
  recipe) and it resumes from it; a checkpoint of another recipe is an error rather than
  something to overwrite. Otherwise ``init_from`` (if set), else fresh.
- ``init_from``: weights only; optimizer, schedule, counters and RNG start fresh.

A full resume must match the checkpoint on schedule type, world size, data digest, prompt seed
and global batch size (the sample sequence and the LR curve depend on them); the error names both
values of every mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from runtime.recipe.schema import CheckpointConfig
from runtime.trainer.checkpoints import CheckpointError, find_latest, read_state, resolve_checkpoint_path


@dataclass(frozen=True)
class StartPlan:
    """Where the run starts from."""

    kind: Literal["fresh", "resume", "init"]
    path: Path | None
    reason: str


def plan_start(ckpt: CheckpointConfig, checkpoint_dir: Path, recipe_digest: str) -> StartPlan:
    """Decide how to start from ``trainer.checkpoint`` (see the module docstring)."""
    init = ckpt.init_from
    if ckpt.resume_from and init and ckpt.resume_from != "auto":
        raise CheckpointError(
            f"trainer.checkpoint.resume_from is {ckpt.resume_from!r} and trainer.checkpoint.init_from is "
            f"{init!r}: a full resume and a weights-only warm start exclude each other; fix: keep one"
        )
    if ckpt.resume_from and ckpt.resume_from != "auto":
        path = resolve_checkpoint_path(ckpt.resume_from, checkpoint_dir, "trainer.checkpoint.resume_from")
        return StartPlan("resume", path, f"trainer.checkpoint.resume_from {ckpt.resume_from}")
    latest = find_latest(checkpoint_dir)
    if latest is not None:
        if ckpt.resume_from == "auto":
            return StartPlan("resume", latest, "resume_from auto: newest checkpoint in checkpoint_dir")
        written_by = read_state(latest).get("recipe_digest")
        if written_by == recipe_digest:
            return StartPlan("resume", latest, "restart of the same job: its own newest checkpoint")
        raise CheckpointError(
            f"{checkpoint_dir} already holds {latest.name}, written by another recipe (digest "
            f"{str(written_by)[:12]}..., this one {recipe_digest[:12]}...); starting here would prune it; fix: "
            "set trainer.checkpoint.resume_from: auto to continue from it, or choose another trainer.checkpoint.dir"
        )
    if init:
        path = (
            resolve_checkpoint_path(init, checkpoint_dir, "trainer.checkpoint.init_from")
            if _looks_like_checkpoint(init)
            else Path(init)
        )
        return StartPlan("init", path, f"trainer.checkpoint.init_from {init}")
    return StartPlan("fresh", None, "no checkpoint to start from")


def _looks_like_checkpoint(value: str) -> bool:
    """``init_from`` may also name an exported safetensors draft (a folder with config.json)."""
    path = Path(value)
    return not (path / "config.json").is_file()


def check_resume_compatible(state: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Raise :class:`CheckpointError` listing every field where checkpoint and recipe disagree.

    ``current`` holds ``schedule_type``, ``world_size``, ``data_digest``, ``prompt_seed`` and
    ``global_batch_size`` of this run.
    """
    recorded = {
        "schedule_type": (state.get("schedule") or {}).get("type"),
        "world_size": state.get("world_size"),
        "data_digest": state.get("data_digest"),
        "prompt_seed": state.get("prompt_seed"),
        "global_batch_size": state.get("global_batch_size"),
        "draft": state.get("draft", current.get("draft")),  # older checkpoints did not record it
    }
    fields = {
        "schedule_type": (
            "trainer.schedule.type",
            "resume with the same schedule, or warm-start with trainer.checkpoint.init_from",
        ),
        "world_size": (
            "trainer ranks (job.trainer.nodes x tasks_per_node)",
            "resume with the same number of ranks, or warm-start with init_from",
        ),
        "data_digest": ("data digest (data.expected_sha256)", "resume on the same data, or warm-start with init_from"),
        "prompt_seed": ("trainer.prompt_seed", "resume with the same prompt seed, or warm-start with init_from"),
        "global_batch_size": (
            "trainer.global_batch_size",
            "resume with the same global batch, or warm-start with init_from",
        ),
        "draft": (
            "draft architecture (trainer.draft)",
            "resume with the trainer.draft settings the checkpoint was written with",
        ),
    }
    problems = []
    for key, (label, fix) in fields.items():
        if key == "draft" and isinstance(recorded[key], dict) and isinstance(current.get(key), dict):
            differ = {k: (v, current[key].get(k)) for k, v in recorded[key].items() if current[key].get(k) != v}
            if differ:
                detail = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in sorted(differ.items()))
                problems.append(f"{label}: checkpoint vs this run: {detail}; fix: {fix}")
            continue
        if recorded[key] != current.get(key):
            problems.append(f"{label}: the checkpoint has {recorded[key]!r}, this run has {current[key]!r}; fix: {fix}")
    if problems:
        raise CheckpointError(f"cannot resume from {path}:\n  - " + "\n  - ".join(problems))
