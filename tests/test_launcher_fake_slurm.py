"""The launcher's Slurm side against fake ``sbatch``/``sacct``/``scancel`` at the process boundary
(tests/support/fake_slurm.py): submission through submitit (launcher/hetjob.py), state from sacct's
hetjob rows (launcher/slurm_state.py, launcher/control.py), cancel, and what the operator is told when
Slurm answers badly. These run anywhere, without root; the real local cluster tests
(test_launcher_slurm.py, test_slurm_local.py) run the same paths against real Slurm."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from launcher.control import CancelError, cancel_job, job_report
from launcher.jobs import JobRecord, find_record
from launcher.slurm_state import SlurmUnreachableError, query_sacct
from runtime.shared.acceptance_length import POOLED_KEY
from runtime.shared.data_files import sha256_file, write_rows
from tests.support.fake_slurm import FakeSlurm
from tests.support.launcher_cli import launch, probe_overrides

SACCT_HEADER = "JobID|JobName|State|ExitCode|Elapsed|NodeList|Reason\n"


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSlurm:
    slurm = FakeSlurm(tmp_path / "fake-slurm")
    monkeypatch.setenv("PATH", slurm.environ()["PATH"])
    return slurm


def slurm_record(tmp_path: Path, job_id: str = "4242") -> JobRecord:
    return JobRecord(
        job_id=job_id,
        mode="slurm",
        name="tiny",
        job_dir=str(tmp_path / "job"),
        recipe_source="recipes/tiny.yaml",
        recipe_digest="0" * 64,
        smoke=False,
        probe=True,
        components={"capture": 1, "trainer": 4},
    )


def small_data(tmp_path: Path) -> list[str]:
    """``--set`` items that point the recipe at a small valid data file (the submission checks its
    SHA-256), so this test needs no tiny target build."""
    rows = [{"id": f"r{i}", "input_ids": [1, 5 + i, 6, 2], "loss_mask": [0, 0, 1, 1]} for i in range(4)]
    path = tmp_path / "train.jsonl"
    write_rows(path, rows)
    sets = [f"data.train_path={path}", f"data.expected_sha256={sha256_file(path)}", "data.num_rows=null"]
    return [arg for item in sets for arg in ("--set", item)]


def test_submit_status_gate_and_cancel_through_the_launcher(fake: FakeSlurm, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    fake.answer("sbatch", stdout="Submitted batch job 4242\n")
    done = launch(["tiny", "--probe", *probe_overrides(runs), *small_data(tmp_path)], env=fake.environ())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "submitted job 4242" in done.stdout
    (submitted,) = fake.calls("sbatch")
    script = str(submitted["script"])
    assert script.count("#SBATCH hetjob") == 1 and "--het-group=0" in script and "--het-group=1" in script
    record = find_record("4242", runs)
    assert record.mode == "slurm" and record.components == {"capture": 1, "trainer": 4}
    assert (Path(record.job_dir) / "submission.sh").read_text() == script, "the job folder keeps what was submitted"
    layout = json.loads((Path(record.job_dir) / "submitit" / "tasks.json").read_text())
    assert layout == {"trainer_world_size": 4, "capture_tasks": 1}

    fake.answer(
        "sacct",
        stdout=SACCT_HEADER + "4242+0|tiny|RUNNING|0:0|00:01:02|node1|None\n"
        "4242+1|tiny|PENDING|0:0|00:00:00||Resources\n",
    )
    status = launch(["status", "4242", "--runs-dir", str(runs)], env=fake.environ())
    assert status.returncode == 0, status.stdout + status.stderr
    assert "RUNNING" in status.stdout and "(waiting: Resources)" in status.stdout, "why the trainer is pending"
    assert fake.calls("sacct")[-1]["argv"][:2] == ["-j", "4242"]

    no_rank = launch(["logs", "4242", "--rank", "99", "--runs-dir", str(runs)], env=fake.environ())
    assert no_rank.returncode == 2 and "has no task of any component rank 99" in no_rank.stderr, no_rank.stderr
    assert "trainer ranks 0..3" in no_rank.stderr

    gate = launch(["gate", "4242", "--runs-dir", str(runs)], env=fake.environ())
    assert gate.returncode == 2 and "was not a --smoke job" in gate.stderr and "--smoke" in gate.stderr, gate.stderr
    assert "Traceback" not in gate.stderr and not (Path(record.job_dir) / "gate.json").exists(), "nothing written"

    cancelled = launch(["cancel", "4242", "--runs-dir", str(runs)], env=fake.environ())
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert [c["argv"] for c in fake.calls("scancel")] == [["4242"]], "the leader id cancels both components"


def test_a_failed_component_makes_the_job_failed_while_the_other_runs(fake: FakeSlurm, tmp_path: Path) -> None:
    fake.answer(
        "sacct",
        stdout=SACCT_HEADER
        + "4242+0|tiny|FAILED|3:0|00:00:20|node1|None\n4242+0.0|python3|FAILED|3:0|00:00:19|node1|\n"
        "4242+1|tiny|RUNNING|0:0|00:00:20|node2|None\n",
    )
    report = job_report(slurm_record(tmp_path))
    assert report.state == "FAILED", "nobody waits on a job that cannot succeed"
    states = {c.name: (c.state, c.exit_code, c.nodes) for c in report.components}
    assert states == {"capture": ("FAILED", "3:0", "node1"), "trainer": ("RUNNING", "0:0", "node2")}


def test_slurm_that_does_not_answer_is_named_not_taken_for_a_state(fake: FakeSlurm, tmp_path: Path) -> None:
    fake.answer("sacct", stderr="sacct: error: Problem talking to the database: Connection refused\n", exit_code=1)
    with pytest.raises(SlurmUnreachableError, match=r"exit 1: sacct: error: Problem talking to the database"):
        query_sacct("4242")
    report = job_report(slurm_record(tmp_path))
    assert report.state == "UNKNOWN" and report.slurm_unreachable
    assert "Problem talking to the database" in report.note
    assert {c.state for c in report.components} == {"UNKNOWN"}


def test_no_sacct_on_this_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(SlurmUnreachableError, match="sacct is not installed here"):
        query_sacct("4242")


def test_a_failing_scancel_is_reported_with_slurms_words(fake: FakeSlurm, tmp_path: Path) -> None:
    fake.answer(
        "scancel", stderr="scancel: error: Kill job error on job id 4242: Access/permission denied\n", exit_code=1
    )
    with pytest.raises(CancelError, match="scancel 4242 failed: .*Access/permission denied"):
        cancel_job(slurm_record(tmp_path))


def test_cancel_of_a_job_slurm_does_not_know_says_so(fake: FakeSlurm, tmp_path: Path) -> None:
    fake.answer("scancel", stderr="scancel: error: Invalid job id specified\n", exit_code=1)
    with pytest.raises(CancelError, match="Slurm does not know job 4242 .*nothing was cancelled"):
        cancel_job(slurm_record(tmp_path))


def test_cancel_of_a_finished_local_job_leaves_a_process_that_reused_its_pid_alone(tmp_path: Path) -> None:
    import dataclasses
    import datetime as dt
    import subprocess
    import time

    recorded_at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=30)
    stranger = subprocess.Popen(["sleep", "60"])  # started after the job was recorded: not its supervisor
    try:
        record = dataclasses.replace(
            slurm_record(tmp_path, "local-1"),
            mode="local",
            supervisor_pid=stranger.pid,
            submitted_at=recorded_at.isoformat(timespec="seconds"),
        )
        with pytest.raises(CancelError, match="is not running"):
            cancel_job(record)
        time.sleep(0.2)
        assert stranger.poll() is None, "the process that reused the pid was signalled"
    finally:
        stranger.kill()
        stranger.wait()


def _resolved_job(tmp_path: Path, *overrides: str) -> JobRecord:
    """A finished-looking job folder: its resolved tiny recipe, a job record and a checkpoint at step 8
    (its trainer state only: the launcher checks that the evaluated checkpoint is complete)."""
    from launcher.jobs import write_record

    record = slurm_record(tmp_path, job_id="5151")
    # its record goes into the test's runs folder, never the repository's runs/
    sets = [arg for item in (f"job.runs_dir={tmp_path / 'runs'}", *overrides) for arg in ("--set", item)]
    done = launch(["resolve", "tiny", "--job-dir", record.job_dir, "--slurm-job-id", "5151", *sets])
    assert done.returncode == 0, done.stderr
    write_record(record, tmp_path / "runs")
    step = Path(record.job_dir) / "checkpoints" / "step_00000008"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    return record


def test_eval_is_submitted_as_a_one_node_job_running_the_rendered_script(fake: FakeSlurm, tmp_path: Path) -> None:
    from launcher.eval_job import render_eval_script
    from runtime.recipe import load_resolved

    record = _resolved_job(tmp_path)
    fake.answer("sbatch", stdout="6161\n")
    args = ["eval", record.job_dir, "--checkpoint", "step_8", "--eval-set", "tiny-heldout", "--set", "eval.seed=3"]
    done = launch(args, env=fake.environ())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "submitted eval job 6161" in done.stdout and f"tail -f {record.job_dir}/eval/slurm-6161.out" in done.stdout
    (call,) = fake.calls("sbatch")
    recipe = load_resolved(Path(record.job_dir) / "recipe.resolved.json").recipe
    assert call["script"] == render_eval_script(recipe, "recipes/tiny.yaml")
    argv = call["argv"]
    assert "--parsable" in argv and f"--output={record.job_dir}/eval/slurm-%j.out" in argv
    # The job's settings travel in sbatch's environment, never inside --export= (which splits at commas)
    assert [a for a in argv if a.startswith("--export")] == ["--export=ALL"]
    assert call["env"]["DSPARK_JOB_DIR"] == record.job_dir and call["env"]["DSPARK_EVAL_CHECKPOINT"] == "step_8"
    assert call["env"]["DSPARK_EVAL_ARGS"] == "--eval-set tiny-heldout --set eval.seed=3"
    # a refusal by sbatch reaches the operator in one line
    fake.answer("sbatch", stderr="sbatch: error: invalid partition specified: gpu\n", exit_code=1)
    done = launch(["eval", record.job_dir], env=fake.environ())
    assert done.returncode == 2 and "sbatch refused the eval job: sbatch: error: invalid partition" in done.stderr


def test_eval_without_slurm_says_to_use_local(tmp_path: Path) -> None:
    record = _resolved_job(tmp_path)
    done = launch(["eval", record.job_dir], env={"PATH": "/nonexistent"})
    assert done.returncode == 2
    assert "sbatch is not on PATH" in done.stderr and "--local" in done.stderr


def test_after_training_submits_the_eval_job_afterok_the_training_job(fake: FakeSlurm, tmp_path: Path) -> None:
    """eval.after_training on Slurm: the eval job goes in with the training job, held by
    --dependency=afterok on it; job.json keeps its id and status shows its state; --dry-run shows both
    scripts."""
    from launcher.eval_job import render_eval_script
    from runtime.recipe import load_resolved

    runs = tmp_path / "runs"
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    args = ["tiny", *probe_overrides(runs, short_run=False), *small_data(tmp_path)]
    args += ["--set", f"capture.target_path={target}", "--set", "eval.after_training=true"]

    dry = launch([*args, "--dry-run"], env=fake.environ())
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "# ---- eval.after_training: the eval job" in dry.stdout
    assert "sbatch --dependency=afterok:<training job id>" in dry.stdout and not fake.calls("sbatch")

    fake.answer("sbatch", stdout="Submitted batch job 4242\n")
    done = launch(args, env=fake.environ())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "submitted eval job 4242 (eval.after_training)" in done.stdout
    hetjob, evaluation = fake.calls("sbatch")
    assert "#SBATCH hetjob" in str(hetjob["script"])
    assert "--dependency=afterok:4242" in evaluation["argv"]
    record = find_record("4242", runs)
    assert record.eval_job_id == "4242"
    resolved = load_resolved(Path(record.job_dir) / "recipe.resolved.json")
    assert evaluation["script"] == render_eval_script(resolved.recipe, record.recipe_source)

    fake.answer("sacct", stdout=SACCT_HEADER + "4242|tiny-eval|PENDING|0:0|00:00:00||Dependency\n")
    status = launch(["status", "4242", "--runs-dir", str(runs)], env=fake.environ())
    assert "eval job 4242 (after training): PENDING (Dependency)" in status.stdout, status.stdout


def test_the_run_headline_gives_trained_against_untrained_and_the_speed_up(tmp_path: Path) -> None:
    from launcher.after_training import headline

    def figures(accept: float, rate: float, speedup: float | None) -> dict[str, object]:
        return {"overall": {POOLED_KEY: accept, "tokens_per_s": rate}, "speedup_vs_plain": speedup}

    results = {
        "draft": {"label": "step_00000096"},
        "sets": {"tiny-heldout": 32},
        "device": "cpu",
        "passes": [
            {
                "temperature": 0.0,
                "plain": {"overall": {"tokens_per_s": 100.0}},
                "drafts": {"step_00000096": figures(3.25, 190.0, 1.9), "untrained": figures(1.5, 90.0, 0.9)},
            },
            {
                "temperature": 1.0,
                "plain": {"overall": {"tokens_per_s": 110.0}},
                "drafts": {
                    "step_00000096": {
                        **figures(3.0, 165.0, 1.5),
                        "speedup_spread": [0.9, 2.1],
                        "speedup_trust": "under load",
                        "load_average": 5.2,
                        "other_load": 3.2,
                        "cores": 2,
                    },
                    "untrained": figures(1.1, 60.0, 0.55),
                },
            },
        ],
    }
    path = tmp_path / "eval" / "step_00000096" / "results.json"
    path.parent.mkdir(parents=True)
    (path.parent / "slot_accept_rate.png").write_bytes(b"")
    lines = headline(results, path)
    table = "\n".join(lines)
    assert "draft step_00000096 against an untrained draft of the same shape, 32 held-out prompts" in lines[0]
    assert "0       3.25      1.50  +1.75       190.0        100.0               1.90x" in table
    # A speed-up taken while other work loaded the machine is printed with its spread, marked, and said so.
    assert "1       3.00      1.10  +1.90       165.0        110.0  1.50x (0.90-2.10)?" in table
    assert (
        "? T=1: speed-up taken under load (load average 5.2 on 2 core(s), 3.2 of it other work): the acceptance "
        "lengths stand, this speed-up does not" in table
    )
    assert str(path) in table and "slot_accept_rate.png" in table


def test_cancel_of_a_finished_slurm_job_says_so_and_signals_nothing(fake: FakeSlurm, tmp_path: Path) -> None:
    fake.answer(
        "sacct",
        stdout=SACCT_HEADER
        + "4242+0|tiny|COMPLETED|0:0|00:01:00|node1|None\n4242+1|tiny|COMPLETED|0:0|00:01:00|node2|None\n",
    )
    with pytest.raises(CancelError, match=r"job 4242 already ended \(COMPLETED\), so nothing was signalled"):
        cancel_job(slurm_record(tmp_path))
    assert fake.calls("scancel") == [], "scancel was not run for an ended job"


def test_a_folder_with_commas_and_percent_signs_reaches_slurm_as_one_literal_value(
    fake: FakeSlurm, tmp_path: Path
) -> None:
    """sbatch splits --export at commas and expands %j/%x in --output: a job folder named so is neither
    an injected variable nor a lost log."""
    record = _resolved_job(tmp_path / "a,PATH=evil%x%j")
    fake.answer("sbatch", stdout="6262\n")
    done = launch(["eval", record.job_dir, "--checkpoint", "step_8"], env=fake.environ())
    assert done.returncode == 0, done.stdout + done.stderr
    (call,) = fake.calls("sbatch")
    assert call["env"]["DSPARK_JOB_DIR"] == record.job_dir and "PATH" not in call["env"]
    assert f"--output={record.job_dir.replace('%', '%%')}/eval/slurm-%j.out" in call["argv"]
    assert [a for a in call["argv"] if a.startswith("--export")] == ["--export=ALL"]


@pytest.mark.parametrize("job_id", ["--me", "--user=root", "4242,4243", "-1", "\x1b]0;PWNED\x07"])
def test_a_job_record_whose_id_is_not_a_slurm_id_reaches_no_slurm_command(
    fake: FakeSlurm, tmp_path: Path, job_id: str
) -> None:
    """A tampered or foreign job.json: its id would be an option of scancel (``--me`` cancels every job of
    the operator), a list, or escape codes on the terminal. Refused where the record is read."""
    folder = tmp_path / "copy"
    folder.mkdir()
    payload = dataclasses.asdict(slurm_record(tmp_path))
    payload.update(job_id=job_id, job_dir=str(folder))
    (folder / "job.json").write_text(json.dumps(payload))
    for command in ("cancel", "status", "logs"):
        done = launch([command, str(folder)], env=fake.environ())
        assert done.returncode == 2, done.stdout + done.stderr
        (line,) = done.stderr.splitlines()
        assert "field 'job_id'" in line and "is not a slurm job id" in line and "\x1b" not in line, line
    assert fake.calls("scancel") == [] and fake.calls("sacct") == []
