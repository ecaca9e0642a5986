"""The evaluation that goes with a training run (``eval.after_training``, ``eval.checkpoint_prompts``).

- During a ``--local`` run: a low-priority process decodes a few held-out prompts greedily with every
  checkpoint the trainer writes (``runtime.evaluate.during_training``), for the acceptance-over-steps
  plot. The trainer never waits for it.
- When a ``--local`` run has completed: the final draft is evaluated on this machine (the same
  ``runtime.evaluate`` that ``launcher eval --local`` runs), and the run ends with :func:`headline`:
  trained against untrained acceptance at each temperature, tokens/s with and without the draft.
- On Slurm: the eval job is submitted with the training job, ``--dependency=afterok`` on it
  (:mod:`launcher.eval_job`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from launcher.component import spawn_component, stop_process
from launcher.eval_job import local_eval_command
from runtime.recipe import ResolvedRecipe
from runtime.recipe.loader import RESOLVED_FILENAME
from runtime.shared.acceptance_length import pooled_acceptance_length_of
from runtime.shared.speedup_trust import marked, trust_note

DURING_TRAINING_MODULE = "runtime.evaluate.during_training"
WATCH_LOG = "eval_during_training.log"
AFTER_TRAINING_LOG = "eval_after_training.log"
WATCH_FINISH_S = 60.0
"""How long the checkpoint watch may take, once the run has ended, to decode the checkpoints already written."""


def start_checkpoint_watch(resolved: ResolvedRecipe, job_dir: Path, repo_root: Path) -> subprocess.Popen[bytes] | None:
    """Start the per-checkpoint acceptance process of a ``--local`` run (None when the recipe asks for none)."""
    settings = resolved.recipe.eval
    if settings is None or settings.checkpoint_prompts == 0:
        return None
    log_dir = job_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-u", "-m", DURING_TRAINING_MODULE, "--recipe", str(job_dir / RESOLVED_FILENAME)]
    with (log_dir / WATCH_LOG).open("ab") as log:
        return spawn_component(command, dict(os.environ), repo_root, stdout=log)


def finish_checkpoint_watch(process: subprocess.Popen[bytes] | None, log_path: Path) -> None:
    """Tell the watch the run has ended; it decodes the checkpoints already written, then exits
    (stopped after :data:`WATCH_FINISH_S`). A failed watch costs only its plot points: one line says so."""
    if process is None:
        return
    if process.poll() is None:
        print(f"[local] decoding the last checkpoints for the acceptance-over-steps plot (log {log_path})", flush=True)
    code = stop_process(process, grace_s=WATCH_FINISH_S)
    if code not in (0, None):
        print(f"[local] the per-checkpoint acceptance decode ended with code {code}; see {log_path}", flush=True)


def evaluate_after_training(job_dir: Path, recipe_file: str, repo_root: Path) -> int:
    """Evaluate the run's newest checkpoint against the untrained floor (``runtime.evaluate``), its
    progress on the console as ``[eval]`` lines and all of it in ``logs/eval_after_training.log``;
    returns its exit code."""
    command = local_eval_command(job_dir, recipe_file, "latest", [])
    log_path = job_dir / "logs" / AFTER_TRAINING_LOG
    print(
        f"[local] evaluating the final draft on the held-out prompts (eval.after_training; log {log_path})", flush=True
    )
    with log_path.open("ab") as log:
        process = spawn_component(command, dict(os.environ), repo_root, stdout=subprocess.PIPE)
        try:
            assert process.stdout is not None
            for raw in process.stdout:
                log.write(raw)
                log.flush()
                line = raw.decode(errors="replace").rstrip()
                if _worth_echoing(line):
                    print(f"[eval] {line}", flush=True)
            return process.wait()
        finally:
            stop_process(process, grace_s=5.0)


def _worth_echoing(line: str) -> bool:
    # Progress and refusals; the full table is the headline's to give, the rest is in the log.
    return " eval: " in line or line.startswith("error:") or "Traceback" in line


def newest_results(job_dir: Path) -> Path | None:
    """The results.json of the run's most recently written evaluation, or None."""
    found = sorted((job_dir / "eval").glob("*/results.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def headline(results: dict[str, Any], results_path: Path, display: Any = str) -> list[str]:
    """The run's closing table: the trained draft against the untrained floor at each temperature
    (pooled acceptance length), tokens/s with the draft and with the target alone, the speed-up, and
    where the results and plots are."""
    draft = results["draft"]
    prompts = sum(results["sets"].values())
    sets = ", ".join(results["sets"])
    lines = [
        f"draft {draft['label']} against an untrained draft of the same shape, {prompts} held-out prompts ({sets}), "
        f"{results['device']}:",
        f"  {'T':>4} {'accept len':>10} {'untrained':>9} {'gain':>6} {'tok/s draft':>11} {'target alone':>12} "
        f"{'speed-up (spread)':>19}",
    ]
    notes = []
    for entry in results["passes"]:
        trained = entry["drafts"].get(draft["label"], {})
        floor = entry["drafts"].get("untrained", {})
        accept = pooled_acceptance_length_of(trained.get("overall", {}))
        floor_accept = pooled_acceptance_length_of(floor.get("overall", {}))
        gain = None if accept is None or floor_accept is None else accept - floor_accept
        plain = (entry.get("plain") or {}).get("overall", {}).get("tokens_per_s")
        rate = trained.get("overall", {}).get("tokens_per_s")
        speedup = trained.get("speedup_vs_plain")
        lines.append(
            f"  {entry['temperature']:>4g} {_fmt(accept, 2):>10} {_fmt(floor_accept, 2):>9} {_fmt(gain, 2, '+'):>6} "
            f"{_fmt(rate, 1):>11} {_fmt(plain, 1):>12} {marked(speedup, trained):>19}"
        )
        if note := trust_note(trained):
            notes.append(f"  ? T={entry['temperature']:g}: speed-up {note}")
    lines.extend(notes)
    lines.append(
        "  accept len: tokens emitted per verify step, pooled over all decodes (all tokens / all verify steps: "
        "SGLang's spec_accept_length; the prompt's first token counts, nothing after a stop does); speed-up: "
        "draft tokens/s over the target alone's, decoded interleaved, with the range over four groups of prompts"
    )
    lines.append(f"  results  {display(results_path)} (summary.txt beside it)")
    plots = sorted(results_path.parent.glob("*.png")) + sorted(results_path.parent.parent.glob("*.png"))
    if plots:
        lines.append(f"  plots    {', '.join(display(p) for p in plots)}")
    return lines


def _fmt(value: float | None, digits: int, sign: str = "") -> str:
    return "-" if value is None else f"{value:{sign}.{digits}f}"


def read_results(path: Path) -> dict[str, Any] | None:
    """A results document, or None when it is missing or damaged."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
