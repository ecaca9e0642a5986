"""Eval results stay with their run, and an evaluated checkpoint is trusted only whole (issue 35, items 2
and 6): ``eval JOB --checkpoint <another run's checkpoint>`` is refused (it would be filed under JOB's
eval/step_N and drawn into JOB's acceptance over steps), naming the run it belongs to and the command that
evaluates it as that run's own; ``--out DIR`` keeps such results apart. A checkpoint with an edited
``trainer_state.json`` is refused by the evaluation, naming the file and the previous checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.shared.checkpoint_folders import DraftSourceError, refuse_another_runs_draft, resolve_draft_source
from runtime.user_errors import UserError
from tests.test_resume_continuity import _job

REPO = Path(__file__).resolve().parents[1]


def _checkpoint(job_dir: Path, step: int) -> Path:
    path = job_dir / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "trainer_state.json").write_text("{}")
    return path


def test_another_runs_checkpoint_is_refused_naming_its_run_and_the_way_to_evaluate_it(tmp_path: Path) -> None:
    mine, theirs = tmp_path / "runs" / "tiny" / "a", tmp_path / "runs" / "tiny" / "b"
    for job in (mine, theirs):
        _checkpoint(job, 8)
        (job / "job.json").write_text("{}")
    own = resolve_draft_source("step_8", mine / "checkpoints")
    refuse_another_runs_draft(own, mine / "checkpoints", "local-a", out_given=False)  # its own: fine
    foreign = resolve_draft_source(str(theirs / "checkpoints" / "step_00000008"), mine / "checkpoints")
    with pytest.raises(DraftSourceError) as err:
        refuse_another_runs_draft(foreign, mine / "checkpoints", "local-a", out_given=False)
    message = str(err.value)
    assert f"belongs to job folder {theirs}, not to job local-a" in message
    assert "filed under job local-a's eval/step_00000008 and drawn into its acceptance over steps" in message
    assert f"`python3 -m launcher eval {theirs} --checkpoint step_00000008`" in message and "--out DIR" in message
    refuse_another_runs_draft(foreign, mine / "checkpoints", "local-a", out_given=True)  # results kept apart
    export = theirs / "checkpoints" / "export-step_00000008"
    export.mkdir()
    (export / "config.json").write_text("{}")
    with pytest.raises(DraftSourceError, match="belongs to job folder") as err:
        refuse_another_runs_draft(resolve_draft_source(str(export), mine / "checkpoints"), mine / "checkpoints",
                                  "local-a", out_given=False)  # fmt: skip
    # The refusal's own fix works as printed: the export named as the owner's own, by its folder name.
    assert f"`python3 -m launcher eval {theirs} --checkpoint export-step_00000008`" in str(err.value)
    by_name = resolve_draft_source("export-step_00000008", theirs / "checkpoints")
    assert (by_name.kind, by_name.path, by_name.step) == ("export", export, 8)
    refuse_another_runs_draft(by_name, theirs / "checkpoints", "theirs", out_given=False)
    with pytest.raises(DraftSourceError, match="is not an exported draft.*this run has export-step_00000008"):
        resolve_draft_source("export-step_00000016", theirs / "checkpoints")


def test_launcher_eval_refuses_another_runs_checkpoint_before_anything_starts(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    mine, theirs = _job(runs, job_id="mine"), _job(runs, job_id="theirs")
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "eval", "mine", "--runs-dir", str(runs), "--local",
         "--checkpoint", str(theirs / "checkpoints" / "step_00000008")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: --checkpoint") and f"belongs to job folder {theirs}, not to job mine" in line
    assert not (mine / "eval").exists()


def test_the_evaluation_refuses_a_checkpoint_whose_state_was_edited(tmp_path: Path) -> None:
    import torch

    from tests.support.trainer_runs import save_one_rank

    runs = tmp_path / "runs"
    job_dir = _job(runs, job_id="mine")
    folder = job_dir / "checkpoints"
    for step in (8, 16):
        model = torch.nn.Linear(8, 8)
        optimizer = torch.optim.AdamW(model.parameters())
        save_one_rank(folder, model, optimizer, step)
    state = folder / "step_00000016" / "trainer_state.json"
    state.write_text(state.read_text().replace('"step": 16', '"step": 17'))
    done = subprocess.run(
        [sys.executable, "-m", "runtime.evaluate", "--recipe", str(job_dir / "recipe.resolved.json"),
         "--checkpoint", "latest"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert f"{state} does not match its seal" in line
    assert "Fix: evaluate the previous checkpoint, --checkpoint step_00000008" in line
    assert not (job_dir / "eval").exists()
    assert json.loads(state.read_text())["step"] == 17


@pytest.mark.parametrize("edit", ["config.json", "model.safetensors", "export.sha256", "added", "none"])
def test_an_exported_draft_is_checked_against_its_manifest(tmp_path: Path, edit: str, capsys) -> None:
    from runtime.shared.checkpoint_integrity import (
        EXPORT_MANIFEST,
        CheckpointIntegrityError,
        verify_export,
        write_export_manifest,
    )

    export = tmp_path / "export-step_00000016"
    export.mkdir()
    (export / "config.json").write_text('{"num_hidden_layers": 1}\n')
    (export / "model.safetensors").write_bytes(b"\x10" * 64)
    write_export_manifest(export)
    verify_export(export)  # whole
    if edit == "none":
        (export / EXPORT_MANIFEST).unlink()
        verify_export(export, note=print)
        said = capsys.readouterr().out
        assert "has no export.sha256" in said and "accepted as a legacy export" in said
        return
    target = export / (edit if edit != "added" else "extra.safetensors")
    if edit == "config.json":
        target.write_text('{"num_hidden_layers": 2}\n')
    elif edit == "model.safetensors":
        target.write_bytes(b"\x10" * 63 + b"\x11")
    elif edit == "export.sha256":
        text = target.read_text()
        target.write_text(("1" if text[0] != "1" else "2") + text[1:])
    else:
        target.write_bytes(b"0")
    with pytest.raises(CheckpointIntegrityError) as err:
        verify_export(export)
    message = str(err.value)
    # an edited manifest line shows as the file it records (config.json sorts first)
    named = export / "config.json" if edit == "export.sha256" else target
    assert f"exported file {named} " in message, message
    assert (
        "Fix: export the draft again from its checkpoint, or evaluate the checkpoint itself (--checkpoint step_00000016)"
        in message
    )


def _export_of(job_dir: Path, job_id: str | None, step: int = 16) -> Path:
    """An export folder written as the trainer writes one (weights, config, provenance, manifest), by job
    ``job_id`` of folder ``job_dir``, in ``job_dir``'s checkpoints."""
    from runtime.shared.checkpoint_integrity import write_export_manifest
    from runtime.shared.draft_provenance import RunOrigin, write_export_provenance

    export = job_dir / "checkpoints" / f"export-step_{step:08d}"
    export.mkdir(parents=True)
    (export / "config.json").write_text('{"num_hidden_layers": 1}\n')
    (export / "model.safetensors").write_bytes(bytes([len(job_id or "")]) * 64)
    weights = write_export_provenance(export, RunOrigin(job_id, str(job_dir), "d" * 64, step))
    write_export_manifest(export, known=weights)
    return export


def _job_record(job_dir: Path, job_id: str, parent: dict[str, str] | None = None) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "job.json").write_text(json.dumps({"job_id": job_id, "parent": parent}))


def test_an_export_records_its_run_and_another_runs_copied_in_is_refused(tmp_path: Path, capsys) -> None:
    import shutil

    from runtime.shared.draft_provenance import DraftOwnerError, refuse_another_runs_record, verify_export_whole

    mine, theirs = tmp_path / "runs" / "tiny" / "a", tmp_path / "runs" / "tiny" / "b"
    _job_record(mine, "local-a")
    _job_record(theirs, "local-b")
    own = _export_of(mine, "local-a")
    record = json.loads((own / "provenance.json").read_text())
    assert (record["job_id"], record["step"], record["recipe_digest"]) == ("local-a", 16, "d" * 64)
    assert record["weights_sha256"] == {"model.safetensors": hashlib.sha256(bytes([7]) * 64).hexdigest()}
    assert "provenance.json" in (own / "export.sha256").read_text()  # the manifest covers it
    source = resolve_draft_source("export-step_00000016", mine / "checkpoints")
    refuse_another_runs_record(source, mine, out_given=False, note=print)  # its own: accepted, silently
    verify_export_whole(own)
    assert capsys.readouterr().out == ""

    # Another run's export, copied into this run's checkpoints/ under a name of this run's.
    foreign = _export_of(theirs, "local-b", step=8)
    copied = mine / "checkpoints" / "export-step_00000008"
    shutil.copytree(foreign, copied)
    source = resolve_draft_source("export-step_00000008", mine / "checkpoints")
    refuse_another_runs_draft(source, mine / "checkpoints", "local-a", out_given=False)  # by path: looks like ours
    verify_export_whole(copied)  # and it is whole
    with pytest.raises(DraftOwnerError) as err:
        refuse_another_runs_record(source, mine, out_given=False)
    message = str(err.value)
    assert "\n" not in message
    assert f"{copied / 'provenance.json'} field job_id is 'local-b', not this run's 'local-a'" in message
    # The fix works as printed: the owner's folder still holds it, under the same name.
    assert f"`python3 -m launcher eval {theirs} --checkpoint export-step_00000008`" in message
    assert f"`python3 -m launcher eval {mine} --checkpoint export-step_00000008 --out DIR`" in message
    refuse_another_runs_record(resolve_draft_source("export-step_00000008", theirs / "checkpoints"), theirs, False)
    refuse_another_runs_record(source, mine, out_given=True)  # results kept apart
    shutil.rmtree(foreign)  # the owner's copy is gone: the fix says where it belongs instead
    with pytest.raises(DraftOwnerError, match=f"move {copied} out of .* under job local-b, the run that wrote it"):
        refuse_another_runs_record(source, mine, out_given=False)

    # A resumed job is the same run: its parent's export is its own.
    resumed = tmp_path / "runs" / "tiny" / "c"
    _job_record(resumed, "local-c", parent={"kind": "resume", "job_id": "local-a", "job_dir": str(mine)})
    refuse_another_runs_record(resolve_draft_source(str(own), mine / "checkpoints"), resumed, out_given=False)
    forked = tmp_path / "runs" / "tiny" / "d"
    _job_record(forked, "local-d", parent={"kind": "fork", "job_id": "local-a", "job_dir": str(mine)})
    with pytest.raises(DraftOwnerError, match="field job_id is 'local-a', not this run's 'local-d'"):
        refuse_another_runs_record(resolve_draft_source(str(own), mine / "checkpoints"), forked, out_given=False)


@pytest.mark.parametrize("manifest", ["kept", "rewritten"])
def test_an_export_whose_weights_were_changed_is_refused(tmp_path: Path, manifest: str) -> None:
    from runtime.shared.checkpoint_integrity import CheckpointIntegrityError
    from runtime.shared.draft_provenance import verify_export_whole

    export = _export_of(tmp_path / "job", "local-a")
    weights = export / "model.safetensors"
    weights.write_bytes(b"\x11" * 64)
    if manifest == "kept":  # the manifest sees it
        with pytest.raises(CheckpointIntegrityError, match=f"exported file {weights} is corrupt"):
            verify_export_whole(export)
        return
    # The manifest rewritten to match (sha256sum * > export.sha256): the provenance record still sees it.
    names = sorted(p.name for p in export.iterdir() if p.name != "export.sha256")
    (export / "export.sha256").write_text(
        "".join(f"{hashlib.sha256((export / n).read_bytes()).hexdigest()}  {n}\n" for n in names)
    )
    with pytest.raises(UserError) as err:
        verify_export_whole(export)
    message = str(err.value)
    assert f"exported file {weights} does not match {export / 'provenance.json'} field weights_sha256" in message
    assert "Fix: export the draft again from its checkpoint, or evaluate the checkpoint itself" in message


def test_drafts_written_before_the_records_are_accepted_with_a_note(tmp_path: Path, capsys) -> None:
    from runtime.shared.draft_provenance import refuse_another_runs_record, verify_export_whole

    job_dir = tmp_path / "job"
    _job_record(job_dir, "local-a")
    export = _export_of(job_dir, "local-a")
    for name in ("provenance.json", "export.sha256"):
        (export / name).unlink()
    source = resolve_draft_source(str(export), job_dir / "checkpoints")
    refuse_another_runs_record(source, job_dir, out_given=False, note=print)
    verify_export_whole(export, note=print)
    checkpoint = _checkpoint(job_dir, 8)
    refuse_another_runs_record(resolve_draft_source("8", job_dir / "checkpoints"), job_dir, False, note=print)
    said = capsys.readouterr().out.splitlines()
    assert said[0] == (
        f"note: export {export} has no provenance.json (written before drafts recorded their run): accepted"
    )
    assert "accepted as a legacy export" in said[1]
    assert said[2].startswith(f"note: checkpoint {checkpoint} trainer_state.json records no job_id")


def test_a_checkpoint_records_its_run_and_another_runs_is_refused(tmp_path: Path) -> None:
    from runtime.shared.draft_provenance import DraftOwnerError, refuse_another_runs_record

    job_dir = tmp_path / "job"
    _job_record(job_dir, "local-a")
    checkpoint = _checkpoint(job_dir, 8)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 8, "job_id": "local-b", "job_dir": "/gone"}))
    with pytest.raises(DraftOwnerError) as err:
        refuse_another_runs_record(resolve_draft_source("8", job_dir / "checkpoints"), job_dir, out_given=False)
    assert f"{checkpoint / 'trainer_state.json'} field job_id is 'local-b', not this run's 'local-a'" in str(err.value)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 8, "job_id": "local-a"}))
    refuse_another_runs_record(resolve_draft_source("8", job_dir / "checkpoints"), job_dir, out_given=False)
