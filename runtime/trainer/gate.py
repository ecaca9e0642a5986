"""The smoke gate's record: ``trainer_gate.json`` in the job folder, written by rank 0.

The runbook's gate is "one finite optimizer update on all ranks + checkpoint". In smoke mode the
trainer runs its single step, saves a checkpoint, reads it back into fresh tensors and compares
weight hashes, then writes::

    {
      "format": "dspark-trainer-gate/1",
      "passed": true,                  # every rank finite, update applied, checkpoint reloads equal
      "step": 1,                       # optimizer steps completed
      "world_size": 4,
      "update_finite": true,           # all ranks' terms and the global grad norm finite
      "grad_norm": 0.83,
      "loss": {"total": ..., "ce": ..., "l1": ..., "confidence": ...},
      "ranks": [{"rank": 0, "terms_finite": {"ce": true, "l1": true, "confidence": true},
                 "params_finite_after_update": true, "samples": [0]}, ...],
      "problems": [],                  # what failed, in words (non-finite terms name step, term, ranks)
      "checkpoint": {"path": ".../step_00000001", "weights_sha256": "...",
                     "reloaded_sha256": "...", "reload_matches": true},
      "export": ".../export-step_00000001" or null,
      "error": null                    # the exception text when the trainer failed before finishing
    }

It is written on failure too (``passed: false`` with ``problems``/``error``) before the trainer exits
non-zero, so the gate always has a file to read once the trainer got that far.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime.recipe.loader import atomic_write_text

GATE_FORMAT = "dspark-trainer-gate/1"
GATE_FILE = "trainer_gate.json"


def write_gate(job_dir: Path, record: dict[str, Any]) -> Path:
    """Write the gate record atomically; returns its path."""
    job_dir.mkdir(parents=True, exist_ok=True)
    target = job_dir / GATE_FILE
    atomic_write_text(target, json.dumps({"format": GATE_FORMAT, **record}, indent=2) + "\n")
    return target


def read_gate(job_dir: Path) -> dict[str, Any]:
    """Read ``trainer_gate.json`` back."""
    return json.loads((job_dir / GATE_FILE).read_text())
