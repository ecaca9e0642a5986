"""What a resume may change: the one list of recipe fields that do not change a run's results.

``python3 -m launcher --resume JOB`` continues a job as the same run: with the job's own resolved
recipe (its ``--set`` overrides included). A recipe file or ``--set`` given at the resume may change
only the fields of :data:`SAFE_TO_CHANGE` (where and how long the job runs, ports, log cadence, the
plan's assumptions, the evaluation); everything else (optimizer, schedule, data and its SHA-256, seeds
and prompt order, batch and accumulation, draft and target shapes, aux layers, loss weights, ...) is
refused before anything starts, listing each field ``old -> new``. The run's length
(:data:`LENGTH_FIELDS`) may change only where the steps already taken would have been the same: the
learning-rate schedule's past must not depend on the run's total (:func:`schedule_past_depends_on_length`).
``--fork JOB`` continues from that job's checkpoint as a new run, with any change allowed.

RUNBOOK section 8 carries the same list for the operator; ``tests/test_resume_continuity.py`` keeps the two equal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from runtime.recipe.schema import Recipe

SAFE_TO_CHANGE: tuple[str, ...] = (
    "description",
    "job.name",
    "job.partition",
    "job.account",
    "job.qos",
    "job.time_limit_min",
    "job.signal_delay_s",
    "job.max_requeues",
    "job.runs_dir",
    "job.stop_grace_s",
    "job.master_port",
    "job.layout",
    "job.capture.mem_gib",
    "job.capture.exclusive",
    "job.capture.constraint",
    "job.capture.extra_sbatch",
    "job.capture.srun_args",
    "job.capture.cpus_per_task",
    "job.trainer.mem_gib",
    "job.trainer.exclusive",
    "job.trainer.constraint",
    "job.trainer.extra_sbatch",
    "job.trainer.srun_args",
    "job.trainer.cpus_per_task",
    "transport",
    "capture.progress_interval_s",
    "capture.sglang.host",
    "capture.sglang.port",
    "capture.sglang.dist_init_port",
    "capture.sglang.health_timeout_s",
    "capture.sglang.health_poll_interval_s",
    "capture.sglang.request_timeout_s",
    "capture.sglang.request_retries",
    "capture.sglang.retry_backoff_s",
    "capture.sglang.shutdown_timeout_s",
    "capture.sglang.log_tail_lines",
    "trainer.log_every_steps",
    "trainer.checkpoint.every_steps",
    "trainer.checkpoint.keep_last",
    "trainer.checkpoint.export_safetensors",
    "trainer.metrics",
    "trainer.feature_cache.lookahead_steps",
    "data.prepare_commands",
    "plan",
    "eval",
    "smoke",
)
"""Fields (or whole sections, by their prefix) a resume may change: they decide where, how long and how
visibly a job runs, never what it computes. Everything not listed here is a result field."""

SET_BY_THE_LAUNCHER: tuple[str, ...] = ("trainer.checkpoint.resume_from", "trainer.checkpoint.init_from")
"""Fields the launcher itself sets for a resume (the checkpoint it continues from): never compared."""

LENGTH_FIELDS: tuple[str, ...] = ("trainer.max_steps", "trainer.epochs")
"""The run's length: changeable at a resume only where the schedule's past does not depend on it."""

SCHEDULES_WITHOUT_A_TOTAL = ("constant", "constant_with_warmup")
"""Schedules whose factor at step ``s`` never reads the run's total steps."""


@dataclass(frozen=True)
class FieldChange:
    """One recipe field that differs between a job and the recipe resuming it."""

    field: str
    old: object
    new: object

    def describe(self) -> str:
        """``trainer.optimizer.lr 0.001 -> 0.003``."""
        return f"{self.field} {_show(self.old)} -> {_show(self.new)}"


def _show(value: object) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, str | list | dict):
        return json.dumps(value)
    return str(value)


def flatten(recipe: Recipe) -> dict[str, object]:
    """Every leaf of the recipe by its dotted name (lists are leaves)."""
    out: dict[str, object] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            out[prefix] = node

    walk("", recipe.model_dump(mode="json"))
    return out


def _covered(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def changes(old: Recipe, new: Recipe) -> list[FieldChange]:
    """Every field (but those the launcher sets) whose value differs, in a stable order."""
    before, after = flatten(old), flatten(new)
    names = sorted(set(before) | set(after))
    return [
        FieldChange(name, before.get(name), after.get(name))
        for name in names
        if before.get(name) != after.get(name) and not _covered(name, SET_BY_THE_LAUNCHER)
    ]


def is_safe(name: str) -> bool:
    """Whether a resume may change this field (see :data:`SAFE_TO_CHANGE`)."""
    return _covered(name, SAFE_TO_CHANGE)


def schedule_past_depends_on_length(recipe: Recipe) -> str:
    """Why the learning rate of the steps already taken depends on the run's length (empty: it does not).

    ``linear``, ``cosine`` and ``wsd`` bind their curve to ``trainer.schedule.total_steps``, which
    defaults to the run's own optimizer steps: a longer run would have had other rates from its start.
    With ``total_steps`` set explicitly, or a constant rate (with or without warm-up), it does not."""
    schedule = recipe.trainer.schedule
    if schedule.type in SCHEDULES_WITHOUT_A_TOTAL or schedule.total_steps is not None:
        return ""
    return (
        f"trainer.schedule.type {schedule.type} spreads its curve over the run's total steps "
        "(trainer.schedule.total_steps is unset), so a run of another length would have had other learning "
        "rates from its first step"
    )


def refused_changes(old: Recipe, new: Recipe) -> tuple[list[FieldChange], str]:
    """The changes a resume of ``old`` with ``new`` may not make, and (when the length is among them) why."""
    refused: list[FieldChange] = []
    reason = ""
    for change in changes(old, new):
        if is_safe(change.field):
            continue
        if change.field in LENGTH_FIELDS:
            why = schedule_past_depends_on_length(old) or schedule_past_depends_on_length(new)
            if not why:
                continue
            reason = why
        refused.append(change)
    return refused, reason
