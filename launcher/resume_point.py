"""The checkpoint a ``--resume``/``--fork`` continues from, checked whole on the login node first.

The trainer refuses a checkpoint that is not whole (runtime/shared/checkpoint_integrity.py), but only
after the job started, capture and the target load first. Here the same check runs before anything
is submitted, and the choice never loops back to a refused checkpoint:
- ``--set trainer.checkpoint.resume_from=PATH`` given with ``--resume``/``--fork``: that checkpoint,
  as the operator chose it (refused if it is not whole, naming the older one to take instead);
- else the job's own newest checkpoint; a job with none (it failed before its first save, say because
  the checkpoint it started from was refused) continues from where it started. Of those, the newest
  whole one is taken: a damaged newest one is skipped with its reason, and the one before it is used.
  Each is a checkpoint of the same run, so a resume from an older one is still the same run, with the
  steps after it done again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from runtime.recipe.schema import CheckpointConfig
from runtime.shared.checkpoint_folders import complete_checkpoints, find_latest, is_complete, step_of
from runtime.shared.checkpoint_integrity import CheckpointIntegrityError, verify_whole
from runtime.user_errors import UserError

RESUME_FROM = "trainer.checkpoint.resume_from"


class ResumePointError(UserError):
    """No whole checkpoint to continue from; the message names each refusal and the fix."""


@dataclass(frozen=True)
class ResumePoint:
    """Where a continued run starts."""

    checkpoint: Path | None
    """The whole checkpoint to continue from; None: the run again from its own start (none was kept)."""
    skipped: list[str] = field(default_factory=list)
    """One line per newer checkpoint that was not whole, with why."""
    notes: list[str] = field(default_factory=list)
    """Lines the check wants said (a legacy checkpoint accepted)."""
    chosen_by_operator: bool = False
    """``--set trainer.checkpoint.resume_from`` named it."""


def _refusal(exc: CheckpointIntegrityError) -> str:
    """A refusal's reason without its fix (the caller says what it does instead)."""
    return str(exc).split(" Fix: ")[0]


def _candidates(own_dir: Path, started: CheckpointConfig) -> list[Path]:
    """Checkpoints of the run, newest first: the job's own (``latest`` first), then where it started and
    the older ones beside that one."""
    found: list[Path] = []
    latest = find_latest(own_dir)
    if latest is not None:
        found.append(latest)
    found += [p for p in reversed(complete_checkpoints(own_dir)) if p not in found]
    start = started.resume_from if started.resume_from not in (None, "auto") else None
    if start is not None:
        path = Path(start)
        # A start that is not complete is still named: the check below says what is wrong with it.
        step = step_of(path.name) or 0
        older = [p for p in complete_checkpoints(path.parent) if (step_of(p.name) or 0) < step]
        found += [p for p in [path, *reversed(older)] if p not in found]
    return found


def choose_resume_point(own_dir: Path, started: CheckpointConfig, chosen: str | None, what: str) -> ResumePoint:
    """The checkpoint a continuation of the job whose checkpoint folder is ``own_dir`` (and whose run
    started as ``started`` says) starts from; ``chosen`` is the operator's ``resume_from`` path, if given.
    ``what`` names the job in messages. Raises :class:`ResumePointError` when none is whole."""
    notes: list[str] = []
    if chosen is not None:
        path = Path(chosen) if Path(chosen).is_absolute() else own_dir / chosen
        if not is_complete(path):
            raise ResumePointError(
                f"--set {RESUME_FROM}={chosen}: {path} is not a complete checkpoint (a step_N folder with its "
                f"trainer_state.json); nothing was started. Fix: name one of {what}'s checkpoints, or leave the "
                "--set out to continue from the newest whole one"
            )
        try:
            verify_whole(path, "resume", notes.append)
        except CheckpointIntegrityError as exc:
            raise ResumePointError(f"--set {RESUME_FROM}={chosen}: {exc}; nothing was started") from None
        return ResumePoint(path, notes=notes, chosen_by_operator=True)
    candidates = _candidates(own_dir, started)
    skipped: list[str] = []
    for path in candidates:
        try:
            verify_whole(path, "resume", notes.append)
        except CheckpointIntegrityError as exc:
            skipped.append(f"{path.name} is not whole ({_refusal(exc)})")
            continue
        return ResumePoint(path, skipped, notes)
    if candidates:
        raise ResumePointError(
            f"{what} has no whole checkpoint to continue from: "
            + "; ".join(skipped)
            + ". Nothing was started. Fix: start the run afresh with its recipe, or name a checkpoint of another "
            f"run of it with --set {RESUME_FROM}=PATH (and move the damaged ones away)"
        )
    return ResumePoint(None, skipped, notes)
