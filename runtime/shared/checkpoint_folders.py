"""Names and completeness of the trainer's checkpoint folders, without torch.

A checkpoint is ``<checkpoint_dir>/step_NNNNNNNN/``; it is complete once its ``trainer_state.json``
exists (the last thing written before the folder gets its final name). ``latest`` links to the
newest. The trainer writes them (runtime/trainer/checkpoints.py); the launcher (``--resume``,
``eval``) and the evaluation read them through these functions.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from runtime.user_errors import UserError

STATE_FILE = "trainer_state.json"
LATEST = "latest"
STEP_PREFIX = "step_"
UNTRAINED = "untrained"
SEQUENTIAL_HASH_SCHEME = "sha256-sequential"
"""The ``hash_scheme`` of a checkpoint whose ``trainer_state.json`` records none (written before
checkpoints hashed their tensors in parallel): one SHA-256 over every tensor's name, dtype, shape and
bytes, in name order."""
EXPORT_CONFIG_FILE = "config.json"
"""The config file of an exported draft folder (with its ``*.safetensors``)."""


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint after ``step`` optimizer steps."""
    return f"{STEP_PREFIX}{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint folder name (``step_00000040`` -> 40); None for any other name (an
    operator's ``step_00000040.bak`` copy, a ``.tmp`` folder): those are never checkpoints."""
    match = re.fullmatch(rf"{STEP_PREFIX}(\d+)", name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    """A final-named folder with its trainer state (the last thing written before the rename)."""
    return path.is_dir() and step_of(path.name) is not None and (path / STATE_FILE).is_file()


def complete_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Complete checkpoints in ``checkpoint_dir``, oldest first."""
    if not checkpoint_dir.is_dir():
        return []
    found = [p for p in checkpoint_dir.iterdir() if is_complete(p)]
    return sorted(found, key=lambda p: step_of(p.name) or 0)


def find_latest(checkpoint_dir: Path) -> Path | None:
    """The newest complete checkpoint (following ``latest`` when it is valid)."""
    link = checkpoint_dir / LATEST
    if link.is_symlink() or link.exists():
        target = (checkpoint_dir / os.readlink(link)) if link.is_symlink() else link
        if is_complete(target):
            newest = complete_checkpoints(checkpoint_dir)
            if newest and (step_of(newest[-1].name) or 0) > (step_of(target.name) or 0):
                return newest[-1]  # a crash between the rename and the link update
            return target
    found = complete_checkpoints(checkpoint_dir)
    return found[-1] if found else None


class DraftSourceError(UserError, ValueError):
    """A draft that cannot be evaluated against this target; the message names the file, the field
    and the fix."""


@dataclass(frozen=True)
class DraftSource:
    """Where the evaluated draft comes from."""

    kind: str
    """``checkpoint``, ``export`` or ``untrained``."""
    path: Path | None
    label: str
    """Name in results and folder names: ``step_00000032``, the export folder's name, ``untrained``."""
    step: int | None
    """Training step of a checkpoint (or of an ``export-step_N`` folder), else None."""


def resolve_draft_source(value: str, checkpoint_dir: Path) -> DraftSource:
    """``latest``, ``step_N``, ``N``, ``untrained``, ``export-step_N`` (an export in the run's checkpoint
    folder), a checkpoint folder or an export folder."""
    if value == UNTRAINED:
        return DraftSource(UNTRAINED, None, UNTRAINED, 0)
    if value == LATEST:
        found = find_latest(checkpoint_dir)
        if found is None:
            raise DraftSourceError(
                f"--checkpoint latest: {checkpoint_dir} holds no complete checkpoint; fix: train first (the trainer "
                "writes one every trainer.checkpoint.every_steps), evaluate --checkpoint untrained, or name an export "
                "folder"
            )
        return _checkpoint(found)
    match = re.fullmatch(r"(?:step_)?(\d+)", value)
    if match:
        path = checkpoint_dir / step_dir_name(int(match.group(1)))
        if not is_complete(path):
            have = [p.name for p in complete_checkpoints(checkpoint_dir)]
            raise DraftSourceError(
                f"--checkpoint {value}: {path} is not a complete checkpoint; this run has "
                f"{', '.join(have) or 'none'} (keep_last removes older ones); fix: pick one of them"
            )
        return _checkpoint(path)
    if re.fullmatch(r"export-step_\d+", value):  # by name, as refusals print it
        path = checkpoint_dir / value
        if not (path / EXPORT_CONFIG_FILE).is_file():
            have = sorted(p.name for p in checkpoint_dir.glob("export-step_*") if (p / EXPORT_CONFIG_FILE).is_file())
            raise DraftSourceError(
                f"--checkpoint {value}: {path} is not an exported draft (no {EXPORT_CONFIG_FILE}); this run has "
                f"{', '.join(have) or 'no export'}; fix: pick one of them, or a checkpoint (step_N)"
            )
    else:
        path = Path(value).expanduser()
    if is_complete(path):
        return _checkpoint(path)
    if path.is_dir() and (path / STATE_FILE).is_file():
        raise DraftSourceError(
            f"--checkpoint {value}: {path.name} holds {STATE_FILE}, but a checkpoint folder is named "
            f"{STEP_PREFIX}NNNNNNNN (its step is read from the name); fix: copy it under its original name, e.g. "
            f"{step_dir_name(40)}"
        )
    if (path / EXPORT_CONFIG_FILE).is_file():
        step = re.search(r"step_(\d+)$", path.name)
        return DraftSource("export", path, path.name, int(step.group(1)) if step else None)
    raise DraftSourceError(
        f"--checkpoint {value}: neither latest, step_N, untrained, a checkpoint folder (with {STATE_FILE}) nor a "
        f"draft folder with {EXPORT_CONFIG_FILE} and *.safetensors; fix: use one of those (latest is the newest "
        "checkpoint)"
    )


def _checkpoint(path: Path) -> DraftSource:
    return DraftSource("checkpoint", path, path.name, step_of(path.name))


def refuse_another_runs_draft(source: DraftSource, checkpoint_dir: Path, job: str, out_given: bool) -> None:
    """An evaluation files its results under the job's ``eval/<draft>/`` and draws them into the job's
    acceptance-over-steps plot: a checkpoint or export of another run would be mixed into this run's
    figures under its label. Refused (naming the run it belongs to, when its folder has a job record),
    unless ``--out`` puts the results elsewhere. Evaluating it as its own run's keeps it with that run."""
    if source.path is None or out_given:
        return
    path, own = source.path.resolve(), checkpoint_dir.resolve()
    if path == own or own in path.parents:
        return
    owner = next((p for p in path.parents if (p / "job.json").is_file()), None)
    whose = f"job folder {owner}" if owner else "another run (no job folder above it)"
    again = (
        f"`python3 -m launcher eval {owner} --checkpoint {source.label}` evaluates it as that run's own, into its "
        "folder"
        if owner
        else "evaluate it from the job that wrote it"
    )
    raise DraftSourceError(
        f"--checkpoint {source.path} belongs to {whose}, not to job {job} (its checkpoints are in {checkpoint_dir}): "
        f"its results would be filed under job {job}'s eval/{source.label} and drawn into its acceptance over "
        f"steps, mixing two runs under one label. Fix: {again}, or give --out DIR to keep these results apart"
    )
