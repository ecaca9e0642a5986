"""Whose a draft is (torch-free: the trainer writes the records, ``runtime.evaluate`` and the launcher's
``eval`` check them).

An evaluation files its results under the job's ``eval/<draft>/`` and draws them into the job's
acceptance over steps. A draft that another run wrote, copied into this run's ``checkpoints/``, would be
reported as this run's. So every draft records the run that wrote it:

- an export (``export-step_N/``) in ``provenance.json`` beside its weights: ``job_id`` (``job.json``'s, what
  ``launcher status`` and ``launcher eval`` name the job by), ``job_dir``, the resolved recipe's
  ``recipe_digest``, the ``step`` and ``weights_sha256`` (the SHA-256 of every ``*.safetensors`` file);
  ``export.sha256`` covers it like every other file of the export;
- a checkpoint (``step_N/``) ``job_id`` and ``job_dir`` in its sealed ``trainer_state.json``.

The evaluation refuses a draft whose recorded ``job_id`` is not this run's, and an export whose weights do
not match its ``weights_sha256``, in one line naming the file, the field and the fix. A resumed job
(``--resume``) is the same run: the job ids of its resume parents count as its own (with a configured
``trainer.checkpoint.dir`` they share one checkpoint folder). ``--out DIR`` keeps the results apart, so it
lets another run's draft through, as it does for one outside the run's folder.

Drafts written before these records (no ``provenance.json``, no ``job_id`` in the state) are accepted with
a one-line note: their run cannot be told, and refusing them would strand every finished run's drafts.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.files import atomic_write_text
from runtime.shared.checkpoint_folders import STATE_FILE, DraftSource
from runtime.shared.checkpoint_integrity import (
    EXPORT_MANIFEST,
    digests_of,
    export_fix,
    previous_fix,
    verify_export,
)
from runtime.shared.contracts import ENV_SLURM_JOB_ID, JOB_RECORD_FILENAME
from runtime.user_errors import UserError

EXPORT_PROVENANCE = "provenance.json"
"""In an exported draft folder: the run that wrote it (see the module's docstring)."""
PROVENANCE_FORMAT = "dspark-export-provenance/1"
JOB_ID_FIELD = "job_id"
WEIGHTS_FIELD = "weights_sha256"
MAX_RESUME_PARENTS = 100
"""Resume parents followed at most (a hand-edited record could make the chain a loop)."""


class DraftOwnerError(UserError, ValueError):
    """A draft that is not this run's, or whose weights are not the ones recorded; the message names the
    file, the field and the fix."""


@dataclass(frozen=True)
class RunOrigin:
    """The run that writes a draft, as the trainer knows it."""

    job_id: str | None
    """``job.json``'s ``job_id`` (or the Slurm leader id); None where there is no job (a benchmark)."""
    job_dir: str
    recipe_digest: str | None
    step: int | None

    def job_fields(self) -> dict[str, Any]:
        """What a checkpoint's ``trainer_state.json`` records of the run."""
        return {JOB_ID_FIELD: self.job_id, "job_dir": self.job_dir}


def job_id_of(job_dir: Path, env: Mapping[str, str] | None = None) -> str | None:
    """The job id of the job folder ``job_dir``: its ``job.json``'s ``job_id`` (what the evaluation
    compares with), else the Slurm leader id of the environment (a job whose record is not written
    yet), else None (no job: a benchmark, a bare ``launcher resolve``)."""
    job_id = _record(job_dir).get(JOB_ID_FIELD)
    if isinstance(job_id, str) and job_id:
        return job_id
    return (env if env is not None else os.environ).get(ENV_SLURM_JOB_ID) or None


def run_origin(job_dir: Path, recipe_digest: str | None, step: int | None) -> RunOrigin:
    """The origin recorded in what the trainer of ``job_dir`` writes at ``step``."""
    return RunOrigin(job_id_of(job_dir), str(job_dir), recipe_digest, step)


def own_job_ids(job_dir: Path) -> list[str]:
    """This job's id and those of the jobs it resumes (``--resume``: the same run), newest first; empty
    when ``job_dir`` has no ``job.json``."""
    found: list[str] = []
    record = _record(job_dir)
    while len(found) < MAX_RESUME_PARENTS:
        job_id = record.get(JOB_ID_FIELD)
        if not job_id or job_id in found:
            break
        found.append(str(job_id))
        parent = record.get("parent")
        if not isinstance(parent, dict) or parent.get("kind") != "resume" or not parent.get(JOB_ID_FIELD):
            break
        # The parent's own record names its parents; a parent whose folder is gone still counts itself.
        above = _record(Path(str(parent["job_dir"]))) if parent.get("job_dir") else {}
        record = above if above.get(JOB_ID_FIELD) == parent[JOB_ID_FIELD] else {JOB_ID_FIELD: parent[JOB_ID_FIELD]}
    return found


def write_export_provenance(folder: Path, origin: RunOrigin) -> dict[str, dict[str, Any]]:
    """Write ``provenance.json`` into the export ``folder`` (its weights written; before the manifest,
    which then covers it). Returns the weights' digests (by file name) for the manifest to reuse."""
    weights = digests_of(folder, sorted(folder.glob("*.safetensors")))
    payload = {
        "format": PROVENANCE_FORMAT,
        JOB_ID_FIELD: origin.job_id,
        "job_dir": origin.job_dir,
        "recipe_digest": origin.recipe_digest,
        "step": origin.step,
        WEIGHTS_FIELD: {name: digest["sha256"] for name, digest in sorted(weights.items())},
        "written_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    atomic_write_text(folder / EXPORT_PROVENANCE, json.dumps(payload, indent=2) + "\n")
    return weights


def refuse_another_runs_record(
    source: DraftSource, job_dir: Path, out_given: bool, note: Callable[[str], None] | None = None
) -> None:
    """Refuse a checkpoint or export whose record names another job than ``job_dir``'s (or its resume
    parents'), unless ``--out`` keeps the results apart. A draft without a record (written before them)
    is accepted, and ``note`` says so."""
    if source.path is None or source.kind not in ("checkpoint", "export"):
        return
    file = source.path / (EXPORT_PROVENANCE if source.kind == "export" else STATE_FILE)
    record = _json_object(file) if file.is_file() else {}
    if record is None:
        raise DraftOwnerError(
            f"--checkpoint {source.label}: {file} is unreadable or not a JSON object, so whose run the draft is "
            f"cannot be told. Fix: {export_fix(source.path) if source.kind == 'export' else previous_fix(source.path, 'eval')}"
        )
    if JOB_ID_FIELD not in record:
        if note is not None:
            what = f"has no {EXPORT_PROVENANCE}" if source.kind == "export" else f"{STATE_FILE} records no job_id"
            note(f"note: {source.kind} {source.path} {what} (written before drafts recorded their run): accepted")
        return
    recorded = record[JOB_ID_FIELD]
    own = own_job_ids(job_dir)
    if recorded is None or not own:
        if note is not None:
            why = "records no job" if recorded is None else f"{job_dir} has no {JOB_RECORD_FILENAME} to compare with"
            note(f"note: {file} {why}: whose run the draft is cannot be checked; accepted")
        return
    if recorded in own or out_given:
        return
    mine = repr(own[0]) + (f" (or its resume parents {', '.join(map(repr, own[1:]))})" if own[1:] else "")
    raise DraftOwnerError(
        f"--checkpoint {source.label}: {file} field {JOB_ID_FIELD} is {recorded!r}, not this run's {mine}: the "
        f"draft was written by another run and copied into {source.path.parent}, so its results would be filed "
        f"under {job_dir / 'eval' / source.label} and drawn into this run's acceptance over steps, mixing two "
        f"runs under one label. Fix: {_owner_fix(source.path, source.label, record)}, or keep these results apart: "
        f"`python3 -m launcher eval {job_dir} --checkpoint {source.label} --out DIR`"
    )


def verify_export_whole(folder: Path, note: Callable[[str], None] | None = None) -> None:
    """Check an exported draft: every file against ``export.sha256``
    (:func:`~runtime.shared.checkpoint_integrity.verify_export`) and its weights against
    ``provenance.json``'s ``weights_sha256`` (a manifest rewritten after an edit does not hide it)."""
    provenance_file = folder / EXPORT_PROVENANCE
    fix = export_fix(folder)
    if provenance_file.is_file() and not (folder / EXPORT_MANIFEST).is_file():
        raise DraftOwnerError(
            f"exported file {folder / EXPORT_MANIFEST} is missing, though {provenance_file} says the export wrote "
            f"one: its files cannot be checked. Fix: {fix}"
        )
    actual = verify_export(folder, note=note)
    if not provenance_file.is_file():
        return
    recorded = (_json_object(provenance_file) or {}).get(WEIGHTS_FIELD)
    if not isinstance(recorded, dict) or not recorded:
        raise DraftOwnerError(f"{provenance_file} field {WEIGHTS_FIELD} is missing or empty. Fix: {fix}")
    weights = {p.name for p in folder.glob("*.safetensors")}
    for name in sorted(weights | set(recorded)):
        got = actual.get(name, {}).get("sha256") if actual else None
        if got != recorded.get(name):
            raise DraftOwnerError(
                f"exported file {folder / name} does not match {provenance_file} field {WEIGHTS_FIELD} (sha256 "
                f"{got or 'none: the file is gone'}, recorded {recorded.get(name) or 'none: the export did not write it'}"
                f"). Fix: {fix}"
            )


def _owner_fix(path: Path, label: str, record: dict[str, Any]) -> str:
    """Evaluating the draft under the run that wrote it: a command that works as printed where that run's
    folder still holds it, else where it belongs."""
    owner = Path(str(record.get("job_dir") or ""))
    if (
        record.get("job_dir")
        and _record(owner).get(JOB_ID_FIELD) == record[JOB_ID_FIELD]
        and (owner / "checkpoints" / path.name).is_dir()
    ):
        return f"evaluate it as its own run's, `python3 -m launcher eval {owner} --checkpoint {label}`"
    return f"move {path} out of {path.parent} and evaluate it under job {record[JOB_ID_FIELD]}, the run that wrote it"


def _record(job_dir: Path) -> dict[str, Any]:
    """``job_dir``'s ``job.json`` as a dict; empty when there is none or it is unreadable (the launcher
    reports a damaged record where it reads it)."""
    file = job_dir / JOB_RECORD_FILENAME
    return (_json_object(file) or {}) if file.is_file() else {}


def _json_object(file: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None
