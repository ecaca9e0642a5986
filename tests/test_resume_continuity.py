"""A resumed run is the same run: ``--resume JOB`` continues with the job's own resolved recipe (its --set
overrides included), refuses a recipe or --set that changes what results depend on (each field
``old -> new``), lets the run grow only where the schedule's past does not depend on its length, and
``--fork JOB`` continues as a new run that records its parent. (Whole runs that stop and resume bit for
bit: tests/test_hardening_shutdown.py, tests/test_e2e_tiny.py.)"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import cli
from launcher.control import job_report
from launcher.jobs import JobRecord, find_record, write_record
from launcher.resume_point import ResumePointError
from runtime.recipe import continuity, load_recipe
from runtime.shared.contracts import resume_command

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny.yaml"


def _job(runs: Path, *sets: str, job_id: str = "old-job", mode: str = "local") -> Path:
    """A resolved tiny job folder with one (empty) checkpoint and its record: what --resume reads."""
    job_dir = runs / "tiny" / job_id
    args = [sys.executable, "-m", "launcher", "resolve", "tiny", "--job-dir", str(job_dir)]
    for item in (f"job.runs_dir={runs}", *sets):
        args += ["--set", item]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (job_dir / "checkpoints" / "step_00000008").mkdir(parents=True)
    (job_dir / "checkpoints" / "step_00000008" / "trainer_state.json").write_text("{}")
    record = JobRecord(
        job_id=job_id, mode=mode, name="tiny", job_dir=str(job_dir), recipe_source="recipes/tiny.yaml",
        recipe_digest="0" * 64, smoke=False, probe=False, components={"capture": 1, "trainer": 4},
    )  # fmt: skip
    write_record(record, runs)
    return job_dir


def _args(*argv: str) -> argparse.Namespace:
    return cli._submit_parser().parse_args(list(argv))


def test_only_the_listed_fields_are_safe_and_everything_else_is_a_result_field() -> None:
    base = load_recipe(TINY).recipe
    assert continuity.is_safe("job.time_limit_min") and continuity.is_safe("transport.master_rpc_port")
    assert continuity.is_safe("plan.train_mfu") and continuity.is_safe("trainer.log_every_steps")
    for result_field in (
        "trainer.optimizer.lr",
        "trainer.schedule.type",
        "data.expected_sha256",
        "trainer.prompt_seed",
        "trainer.seed",
        "trainer.global_batch_size",
        "trainer.gradient_accumulation_steps",
        "trainer.draft.num_layers",
        "capture.aux_layer_ids",
        "trainer.loss.ce_weight",
        "job.trainer.tasks_per_node",
    ):
        assert not continuity.is_safe(result_field), result_field
    other = load_recipe(TINY, ["trainer.optimizer.lr=0.001", "job.time_limit_min=7", "trainer.loss.ce_weight=0.5"])
    found = {c.field: c.describe() for c in continuity.changes(base, other.recipe)}
    assert found == {
        "trainer.optimizer.lr": "trainer.optimizer.lr 0.005 -> 0.001",
        "job.time_limit_min": f"job.time_limit_min {base.job.time_limit_min} -> 7",
        "trainer.loss.ce_weight": f"trainer.loss.ce_weight {base.trainer.loss.ce_weight} -> 0.5",
    }
    refused, why = continuity.refused_changes(base, other.recipe)
    assert [c.field for c in refused] == ["trainer.loss.ce_weight", "trainer.optimizer.lr"] and why == ""


def test_the_length_may_change_only_where_the_schedules_past_does_not_depend_on_it() -> None:
    constant = load_recipe(TINY, ["trainer.max_steps=16"]).recipe
    assert continuity.refused_changes(constant, load_recipe(TINY).recipe) == ([], "")  # the runbook's rehearsal
    cosine = ["trainer.schedule.type=cosine"]
    short, full = load_recipe(TINY, [*cosine, "trainer.max_steps=16"]).recipe, load_recipe(TINY, cosine).recipe
    refused, why = continuity.refused_changes(short, full)
    assert [c.describe() for c in refused] == ["trainer.max_steps 16 -> null"]
    assert "cosine spreads its curve over the run's total steps" in why and "trainer.schedule.total_steps" in why
    fixed = [*cosine, "trainer.schedule.total_steps=64"]
    assert continuity.refused_changes(
        load_recipe(TINY, [*fixed, "trainer.max_steps=16"]).recipe, load_recipe(TINY, fixed).recipe
    ) == ([], "")


def test_the_runbook_lists_exactly_the_safe_fields() -> None:
    runbook = (REPO / "RUNBOOK.md").read_text()
    section = runbook.split("What a resume may change", 1)[1].split("\n\n", 2)[1]
    listed = set(re.findall(r"`([a-z_.]+)`", section))
    assert listed == set(continuity.SAFE_TO_CHANGE), sorted(listed ^ set(continuity.SAFE_TO_CHANGE))


def test_resume_without_a_recipe_is_the_jobs_own_recipe_overrides_included(tmp_path: Path, capsys) -> None:
    runs = tmp_path / "runs"
    job_dir = _job(runs, "trainer.optimizer.lr=0.001", "job.master_port=32123")
    loaded, parent = cli.continue_job(_args("--resume", "old-job", "--set", f"job.runs_dir={runs}", "--local"))
    assert loaded.recipe.trainer.optimizer.lr == 0.001 and loaded.recipe.job.master_port == 32123
    checkpoint = job_dir / "checkpoints" / "step_00000008"
    assert loaded.recipe.trainer.checkpoint.resume_from == str(checkpoint)
    assert parent == {"kind": "resume", "job_id": "old-job", "job_dir": str(job_dir), "checkpoint": str(checkpoint)}
    assert "trainer.optimizer.lr=0.001" in loaded.overrides and loaded.source == "recipes/tiny.yaml"
    # a safe change is taken, and said
    loaded, _ = cli.continue_job(_args("--resume", str(job_dir), "--set", "job.time_limit_min=7"))
    assert loaded.recipe.job.time_limit_min == 7 and loaded.recipe.trainer.optimizer.lr == 0.001
    assert "changed from job old-job: job.time_limit_min " in capsys.readouterr().out
    # the printed resume command is just --resume JOB
    assert resume_command(job_dir, local=True) == f"python3 -m launcher --resume {job_dir} --local"


def test_a_resume_that_changes_the_lr_is_refused_before_anything_starts(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    job_dir = _job(runs, "trainer.optimizer.lr=0.001")
    before = sorted(p.name for p in (runs / "tiny").iterdir())
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "tiny", "--local", "--resume", "old-job", "--set", f"job.runs_dir={runs}",
         "--set", "trainer.optimizer.lr=0.002"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: cannot resume job old-job") and "trainer.optimizer.lr 0.001 -> 0.002" in line
    assert f"`python3 -m launcher --resume {job_dir} --local`" in line and f"--fork {job_dir} --set" in line
    assert sorted(p.name for p in (runs / "tiny").iterdir()) == before, "no job folder was made"
    # a schedule whose curve spans the run: a longer run is refused with the reason
    cosine = _job(runs, "trainer.schedule.type=cosine", "trainer.max_steps=16", job_id="cos-job")
    with pytest.raises(cli.LaunchError, match=r"trainer\.max_steps 16 -> null \(the run's length may change only"):
        cli.continue_job(_args("tiny", "--resume", str(cosine), "--set", "trainer.max_steps=null"))


def test_a_job_without_a_checkpoint_resumes_as_the_same_run_from_its_start(tmp_path: Path, capsys) -> None:
    """A run stopped before its first checkpoint: the printed resume command runs the same run again from
    step 0 (before, it was refused although status printed it); a fork of it has nothing to fork."""
    runs = tmp_path / "runs"
    job_dir = _job(runs, "trainer.optimizer.lr=0.001")
    (job_dir / "checkpoints" / "step_00000008" / "trainer_state.json").unlink()
    loaded, parent = cli.continue_job(_args("--resume", str(job_dir)))
    assert loaded.recipe.trainer.optimizer.lr == 0.001 and loaded.recipe.trainer.checkpoint.resume_from is None
    assert parent["checkpoint"].startswith("none") and "again from its start (step 0)" in capsys.readouterr().out
    with pytest.raises(cli.LaunchError, match="has no complete checkpoint to fork from"):
        cli.continue_job(_args("tiny", "--fork", str(job_dir)))


def test_a_fork_takes_changes_and_records_its_parent(tmp_path: Path, capsys) -> None:
    runs = tmp_path / "runs"
    job_dir = _job(runs, "trainer.optimizer.lr=0.001")
    loaded, parent = cli.continue_job(_args("tiny", "--fork", "old-job", "--set", f"job.runs_dir={runs}"))
    assert loaded.recipe.trainer.optimizer.lr == 0.005 and parent["kind"] == "fork"
    assert "changed from job old-job: trainer.optimizer.lr 0.001 -> 0.005" in capsys.readouterr().out
    child_dir = runs / "tiny" / "child"
    child_dir.mkdir(parents=True)
    record = cli._record_for(loaded, child_dir, "child-job", "local", False, parent)
    write_record(record, runs)
    written = json.loads((child_dir / "job.json").read_text())
    assert written["parent"]["job_id"] == "old-job" and written["parent"]["kind"] == "fork"
    shown = job_report(find_record("child-job", runs)).render()
    assert f"parent: forked from job old-job ({job_dir}) at {job_dir / 'checkpoints' / 'step_00000008'}" in shown
    with pytest.raises(cli.LaunchError, match="--resume and --fork exclude each other"):
        cli.submit(_args("tiny", "--fork", "old-job", "--resume", "old-job"))


def _sealed_checkpoint(folder: Path, step: int, payload: bytes = b"weights") -> Path:
    """A checkpoint folder as the trainer seals one: a dcp/ file recorded in trainer_state.json by size and
    SHA-256, the state sealed by trainer_state.json.sha256 (no torch needed to check it)."""
    from runtime.shared.checkpoint_integrity import file_digests, seal_json, write_seal

    path = folder / f"step_{step:08d}"
    (path / "dcp").mkdir(parents=True)
    (path / "dcp" / "__0_0.distcp").write_bytes(payload * 100)
    text, _ = seal_json({"step": step, "files": file_digests(path / "dcp")})
    (path / "trainer_state.json").write_text(text)
    write_seal(path, text.encode())
    return path


def test_a_damaged_newest_checkpoint_is_skipped_for_the_newest_whole_one_before_anything_starts(
    tmp_path: Path, capsys
) -> None:
    """The printed resume command never loops on a refused checkpoint: the launcher checks the checkpoint
    whole before anything starts and takes the newest whole one, saying what it skipped and why."""
    runs = tmp_path / "runs"
    job_dir = _job(runs, "trainer.optimizer.lr=0.001")
    shutil.rmtree(job_dir / "checkpoints")
    older = _sealed_checkpoint(job_dir / "checkpoints", 8)
    newest = _sealed_checkpoint(job_dir / "checkpoints", 16)
    (newest / "dcp" / "__0_0.distcp").write_bytes(b"flipped" * 100)  # same size, other bytes
    loaded, parent = cli.continue_job(_args("--resume", str(job_dir)))
    assert loaded.recipe.trainer.checkpoint.resume_from == str(older) and parent["checkpoint"] == str(older)
    said = capsys.readouterr().out
    assert f"skipped step_00000016 is not whole (checkpoint file {newest / 'dcp' / '__0_0.distcp'} is corrupt" in said
    assert "resuming from" in said and "step_00000008 (job old-job) (checked whole)" in said
    # The operator's own choice is honoured, not silently replaced by the newest checkpoint
    loaded, _ = cli.continue_job(_args("--resume", str(job_dir), "--set", f"trainer.checkpoint.resume_from={older}"))
    assert loaded.recipe.trainer.checkpoint.resume_from == str(older)
    assert "named by --set trainer.checkpoint.resume_from" in capsys.readouterr().out
    # ... and refused when it is the damaged one, naming the older one to take
    with pytest.raises(ResumePointError, match=r"resume_from=.*step_00000016.*is corrupt.*step_00000008"):
        cli.continue_job(_args("--resume", str(job_dir), "--set", f"trainer.checkpoint.resume_from={newest}"))
    with pytest.raises(cli.LaunchError, match="init_from .* starts a new run instead"):
        cli.continue_job(_args("--resume", str(job_dir), "--set", f"trainer.checkpoint.init_from={older}"))


def test_a_job_that_failed_on_the_checkpoint_it_started_from_resumes_from_the_one_before_it(
    tmp_path: Path, capsys
) -> None:
    """A run started from a checkpoint the trainer refused saved nothing of its own: its printed resume
    command takes the newest whole checkpoint before the refused one (it used to take the refused one again)."""
    runs = tmp_path / "runs"
    parent_checkpoints = tmp_path / "parent" / "checkpoints"
    older = _sealed_checkpoint(parent_checkpoints, 8)
    refused = _sealed_checkpoint(parent_checkpoints, 16)
    (refused / "trainer_state.json").write_text((refused / "trainer_state.json").read_text().replace("16", "17"))
    job_dir = _job(runs, f"trainer.checkpoint.resume_from={refused}")
    shutil.rmtree(job_dir / "checkpoints")
    loaded, _ = cli.continue_job(_args("--resume", str(job_dir)))
    assert loaded.recipe.trainer.checkpoint.resume_from == str(older)
    assert "skipped step_00000016 is not whole" in capsys.readouterr().out
    # nothing whole at all: refused before anything starts, each refusal named
    (older / "trainer_state.json.sha256").unlink()
    with pytest.raises(
        ResumePointError, match="has no whole checkpoint to continue from: step_00000016 .*step_00000008"
    ):
        cli.continue_job(_args("--resume", str(job_dir)))


def test_a_resume_that_names_the_recipe_keeps_the_runs_overrides_ports_included(tmp_path: Path, capsys) -> None:
    """RUNBOOK's `launcher tiny --resume latest --set ...`: the recipe named again does not bring its default
    ports back; the job's own --set come first, the ones given now after them."""
    runs = tmp_path / "runs"
    _job(runs, "job.master_port=45711", "transport.master_rpc_port=45712", "trainer.epochs=2")
    loaded, _ = cli.continue_job(
        _args("tiny", "--resume", "old-job", "--set", f"job.runs_dir={runs}", "--set", "trainer.epochs=3")
    )
    assert loaded.recipe.job.master_port == 45711 and loaded.recipe.transport.master_rpc_port == 45712
    assert loaded.recipe.trainer.epochs == 3
    assert "job.master_port" not in capsys.readouterr().out, "the ports are not a change"


def test_a_resume_says_when_the_recipe_file_changed_since_the_job_ran(tmp_path: Path, capsys) -> None:
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    recipe = recipes / "mine.yaml"
    recipe.write_text(TINY.read_text())
    runs = tmp_path / "runs"
    job_dir = runs / "mine" / "old"
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "resolve", str(recipe), "--job-dir", str(job_dir), "--set", f"job.runs_dir={runs}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    write_record(
        JobRecord(job_id="old", mode="local", name="tiny", job_dir=str(job_dir), recipe_source=str(recipe),
                  recipe_digest="0" * 64, smoke=False, probe=False, components={"capture": 1, "trainer": 4}),
        runs,
    )  # fmt: skip
    recipe.write_text(TINY.read_text().replace("weight_decay: 0.0", "weight_decay: 0.01"))
    cli.continue_job(_args("--resume", str(job_dir)))
    said = capsys.readouterr().out
    assert f"note: {recipe} has changed since job old ran (trainer.optimizer.weight_decay 0.0 -> 0.01)" in said
    assert "continues with the job's own recipe" in said


def test_a_probe_job_is_not_resumed_and_its_stop_says_to_run_the_probe_again(tmp_path: Path) -> None:
    from launcher.control import resume_hint
    from runtime.shared.contracts import resume_command_of

    runs = tmp_path / "runs"
    job_dir = _job(runs, "job.master_port=45711")
    record = find_record(str(job_dir), runs)
    record.probe = True
    write_record(record, runs)
    with pytest.raises(
        cli.LaunchError,
        match=r"was a --probe job.*run the probe again, `python3 -m launcher recipes/tiny.yaml --probe --set job.runs_dir=",
    ):
        cli.continue_job(_args("--resume", str(job_dir)))
    again = (
        f"python3 -m launcher recipes/tiny.yaml --probe --set job.runs_dir={runs} --set job.master_port=45711 --local"
    )
    assert resume_command_of(job_dir) == again
    assert (
        resume_hint(find_record(str(job_dir), runs)) == f"a probe keeps nothing to resume; run it again with `{again}`"
    )
