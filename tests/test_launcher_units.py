"""Launcher pieces that need no cluster: sacct parsing, host lists, the environment contract, the
plan's numbers, the golden sbatch scripts, dry runs, and the torch-free login path."""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.environment import RENDEZVOUS_VARIABLES, component_environment, expand_hostlist, slurm_placement
from launcher.eval_job import render_eval_script
from launcher.hetjob import HetInfoWatcher, task_index, task_owner
from launcher.plan import make_plan
from launcher.render import RenderOptions, render_script
from launcher.slurm_state import fold_state, parse_sacct
from runtime.recipe import RecipeError, load_recipe
from runtime.recipe.fit.host_memory import streamed_expert_host_bytes

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny.yaml"
K3 = REPO / "recipes" / "kimi_k3_v1c.yaml"
ONE_GPU = REPO / "recipes" / "one_gpu.yaml"

SACCT_RUNNING = """JobID|JobName|State|ExitCode|Elapsed|NodeList
41+0|tiny|RUNNING|0:0|00:00:12|node1
41+0.batch|batch|RUNNING|0:0|00:00:12|node1
41+0.0|python3|RUNNING|0:0|00:00:10|node1
41+1|tiny|RUNNING|0:0|00:00:12|node2
41+1.0|python3|RUNNING|0:0|00:00:10|node2
"""
SACCT_CAPTURE_FAILED = """JobID|JobName|State|ExitCode|Elapsed|NodeList
41+0|tiny|FAILED|3:0|00:00:20|node1
41+0.0|python3|FAILED|3:0|00:00:19|node1
41+1|tiny|RUNNING|0:0|00:00:20|node2
"""


def test_sacct_hetjob_rows_fold_into_one_state() -> None:
    running = parse_sacct(SACCT_RUNNING, "41")
    assert sorted(running) == [0, 1]
    assert running[0].nodes == "node1" and running[1].nodes == "node2"
    assert running[0].steps == {"batch": "RUNNING", "0": "RUNNING"}
    assert fold_state(running) == "RUNNING"
    failed = parse_sacct(SACCT_CAPTURE_FAILED, "41")
    assert failed[0].failed and not failed[1].terminal
    # One failed component fails the job while the other still runs: nobody waits forever.
    assert fold_state(failed) == "FAILED"
    assert parse_sacct(SACCT_RUNNING, "42") == {}


def test_submitit_watcher_understands_component_rows() -> None:
    info = HetInfoWatcher().read_info(SACCT_CAPTURE_FAILED)
    assert info["41"]["State"] == "FAILED"
    assert info["41+0"]["State"] == "FAILED" and info["41+1"]["State"] == "RUNNING"


def test_task_ids_are_unique_across_components() -> None:
    ids = [task_index("trainer", r, 4) for r in range(4)] + [task_index("capture", 0, 4)]
    assert ids == [0, 1, 2, 3, 4]
    assert [task_owner(i, 4) for i in ids] == [
        ("trainer", 0),
        ("trainer", 1),
        ("trainer", 2),
        ("trainer", 3),
        ("capture", 0),
    ]


def test_hostlist_expansion() -> None:
    assert expand_hostlist("node[1-3,7],gpu01") == ["node1", "node2", "node3", "node7", "gpu01"]
    assert expand_hostlist("h[08-10]") == ["h08", "h09", "h10"]
    assert expand_hostlist("") == []


def test_trainer_environment_from_its_own_het_group() -> None:
    recipe = load_recipe(TINY, overrides=["transport.bind_address=10.0.0.5", "job.trainer.cpus_per_task=2"]).recipe
    slurm = {
        "SLURM_JOB_NODELIST_HET_GROUP_0": "cap01",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "trn[01-02]",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_NODEID": "1",
        "SLURMD_NODENAME": "trn02",
        # inherited from a launching shell: must not leak into the component
        "RANK": "99",
        "MASTER_ADDR": "10.9.9.9",
        "MASTER_PORT": "1",
        "NODE_RANK": "7",
        "TORCHELASTIC_RUN_ID": "stale",
    }
    placement = slurm_placement(recipe, "trainer", slurm)
    env = component_environment(recipe, placement, Path("/job"), Path("/job/recipe.resolved.json"), slurm)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("5", "1", "8", "4")
    assert (env["NODE_RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("1", "trn01", "29511")
    assert "TORCHELASTIC_RUN_ID" not in env
    assert env["DSPARK_MOONCAKE_MASTER"] == "10.0.0.5:50151"
    assert env["DSPARK_MOONCAKE_METADATA"] == "http://10.0.0.5:18180/metadata"
    assert env["MC_TCP_BIND_ADDRESS"] == "10.0.0.5" and env["MC_TRANSFER_TIMEOUT"] == "60"

    capture_env = component_environment(
        recipe, slurm_placement(recipe, "capture", {**slurm, "SLURM_PROCID": "0"}), Path("/job"), Path("/r"), slurm
    )
    assert not set(RENDEZVOUS_VARIABLES) & set(capture_env), "capture gets no rendezvous variables"
    assert capture_env["DSPARK_COMPONENT"] == "capture"
    # Each task computes on the CPUs it is given, unless the caller or job.env says otherwise.
    assert (env["OMP_NUM_THREADS"], capture_env["OMP_NUM_THREADS"]) == (
        str(recipe.job.trainer.cpus_per_task),
        str(recipe.job.capture.cpus_per_task),
    )
    told = component_environment(recipe, placement, Path("/job"), Path("/r"), {**slurm, "OMP_NUM_THREADS": "3"})
    assert told["OMP_NUM_THREADS"] == "3"


def test_plan_reports_k3_numbers_and_the_hbm_blocker() -> None:
    plan = make_plan(load_recipe(K3, ["capture.expert_streaming.enabled=false"]).recipe)
    assert plan.numbers["sample_feature_bytes"] == 65536 * 6 * 7168 * 2 == 5_637_144_576
    assert plan.numbers["step_bytes"] == 128 * plan.numbers["sample_bytes"]
    assert 672 * 2**30 <= plan.numbers["step_bytes"] < 673 * 2**30
    messages = [b.message for b in plan.blockers]
    assert any("1,560 GB" in m and "1,128 GB" in m for m in messages)
    options = [o for b in plan.blockers for o in b.options]
    # What works comes first, as the exact --set line; the offload SGLang 0.5.23 cannot do comes last.
    assert options[0].endswith("--set job.capture.nodes=2 --set capture.sglang.tp_size=16"), options
    assert "host memory" in options[-1] and "not possible with SGLang 0.5.23" in options[-1]
    assert sum(len(o) for o in options) < 600, "the fix must stay readable"
    text = plan.render()
    assert "bottleneck" in text and "trainer idle" in text and "total per rank" in text
    tiny = make_plan(load_recipe(TINY).recipe)
    assert not tiny.blockers


def test_plan_models_the_commit_pipeline_and_a_capture_once_run() -> None:
    piped = make_plan(load_recipe(K3).recipe)
    unpiped = make_plan(load_recipe(K3, overrides=["capture.commit_staging_slots=0"]).recipe)
    commit_s = piped.numbers["sample_bytes"] / 5.2e9
    # Pipelined: the 1.08 s put hides behind the 3.9 s forward; without the pipeline it adds up.
    assert piped.numbers["capture_s_per_sample"] == pytest.approx(3.874, abs=1e-3)
    assert unpiped.numbers["capture_s_per_sample"] == pytest.approx(3.874 + commit_s, abs=1e-3)
    assert "overlapped with the next forward (1 staging slot(s)" in piped.render()
    assert "added to the capture: capture.commit_staging_slots is 0" in unpiped.render()
    # The recipe's feature cache: 462 rows at the capture rate, the other 4,146 of 36 x 128 samples at
    # the slower of the trainer and the cache read (5.25 GiB at the assumed 20 GB/s).
    read_s = piped.numbers["sample_bytes"] / 20e9
    assert piped.numbers["cache_read_s_per_sample"] == pytest.approx(read_s)
    later_s = max(piped.numbers["train_s_per_sample"], read_s)
    expected = 462 * piped.numbers["capture_s_per_sample"] + (36 * 128 - 462) * later_s
    assert piped.numbers["run_seconds"] == pytest.approx(expected)
    assert piped.numbers["run_seconds"] < 3600, "the K3 run takes under an hour by the plan's model"
    assert piped.numbers["feature_cache_bytes"] == 462 * piped.numbers["sample_bytes"]
    assert "run time with the cache" in piped.render()
    # Without it every epoch is captured again; the plan says what the cache would give.
    uncached = make_plan(load_recipe(K3, overrides=["trainer.feature_cache.enabled=false"]).recipe)
    assert uncached.numbers["run_seconds"] > 4 * 3600
    assert uncached.numbers["capture_once_run_seconds"] == pytest.approx(expected)
    assert "--set trainer.feature_cache.enabled=true" in uncached.render()
    # A trainer disk that cannot hold 2.37 TiB of features is a blocker naming both sizes.
    small = make_plan(load_recipe(K3, overrides=["plan.trainer_local_disk_bytes=1TB"]).recipe)
    (blocker,) = [b for b in small.blockers if "feature_cache" in b.message]
    assert "2.37 TiB" in blocker.message and "931.32 GiB" in blocker.message


def test_k3_plan_fits_with_streaming_and_checks_host_memory_per_node() -> None:
    plan = make_plan(load_recipe(K3).recipe)
    text = plan.render()
    assert "[OK] fits with streaming" in text and "exceed the capture node's HBM" not in text
    assert plan.blockers == [], [b.message for b in plan.blockers]
    assert "[WARN] the SGLang capture patch streams experts since kimi_k3_dspark_sglang_0.5.23/2" in text
    assert plan.numbers["capture_host_bytes"] == 8 * plan.numbers["streaming_host_bytes_per_gpu"] + 2**40
    assert plan.numbers["trainer_host_bytes"] == 0
    moved = make_plan(load_recipe(K3, ["transport.segment_placement=trainer"]).recipe)
    assert moved.numbers["capture_host_bytes"] == 8 * moved.numbers["streaming_host_bytes_per_gpu"]
    assert moved.numbers["trainer_host_bytes"] == 2**40
    # too little trainer host memory for the segment: refused before any plan, with both numbers
    with pytest.raises(RecipeError) as info:
        load_recipe(K3, ["transport.segment_placement=trainer", "plan.trainer_host_memory_bytes=512GiB"])
    assert "549.76 GB, below what lives there: Mooncake segment" in str(info.value) and "1,099.51 GB" in str(info.value)


def test_plan_host_memory_is_the_figure_the_checks_refuse_on() -> None:
    # Weights that would fit resident (B300) with streaming still on: the runtime streams, the
    # checks count the streamed experts, and the plan's host-memory row counts the same bytes.
    recipe = load_recipe(K3, ["plan.accelerator_memory_bytes=288GB"]).recipe
    plan = make_plan(recipe)
    assert plan.numbers["capture_host_bytes"] == streamed_expert_host_bytes(recipe) + 2**40
    assert streamed_expert_host_bytes(recipe) > 0


def test_weights_over_one_gpus_budget_but_under_the_total_hbm_are_a_blocker() -> None:
    # 1 TB fits 8 x 141 GB in total, but 125 GB per GPU exceeds the 102.2 GB budget at TP8.
    plan = make_plan(
        load_recipe(
            K3,
            [
                "capture.target_weight_bytes=1.0TB",
                "capture.routed_expert_weight_bytes=0.9TB",
                "capture.expert_streaming.enabled=false",
            ],
        ).recipe
    )
    (blocker,) = plan.blockers
    assert "125.0 GB per GPU" in blocker.message and "do not fit 8 x H200 at TP8" in blocker.message
    assert any("job.capture.nodes=2" in option for option in blocker.options)
    assert "[OK] the target's weights fit" not in plan.render()


def test_golden_sbatch_scripts_match_the_renderer() -> None:
    for path in (TINY, K3, ONE_GPU):
        loaded = load_recipe(path, display_name=f"recipes/{path.name}")
        expected = render_script(loaded.recipe, RenderOptions(recipe_file=loaded.source))
        checked_in = (REPO / "sbatch" / f"{loaded.recipe.job.name}.sbatch").read_text()
        assert checked_in == expected, f"sbatch/{loaded.recipe.job.name}.sbatch is stale: python3 -m launcher render"
        eval_script = REPO / "sbatch" / f"{loaded.recipe.job.name}.eval.sbatch"
        if loaded.recipe.eval is None:
            assert not eval_script.exists(), f"{eval_script.name} is left over: its recipe has no eval: section"
        else:
            expected = render_eval_script(loaded.recipe, loaded.source)
            assert eval_script.read_text() == expected, (
                f"sbatch/{eval_script.name} is stale: python3 -m launcher render"
            )


def test_hetjob_script_shape() -> None:
    text = (REPO / "sbatch" / "kimi_k3_v1c.sbatch").read_text()
    assert text.count("#SBATCH hetjob") == 1
    assert text.index("--gpus-per-node=8") < text.index("#SBATCH hetjob") < text.index("--ntasks-per-node=4")
    assert "srun --het-group=0" in text and "srun --het-group=1" in text
    assert ': "${K3_TARGET_DIR:?export K3_TARGET_DIR before sbatch (used by capture.target_path)}"' in text
    assert "/work/" not in text and "/root" not in text, "no absolute path of this machine"


def test_one_node_script_shares_one_node_between_two_overlapping_steps() -> None:
    from runtime.recipe.fit.slurm_request import memory_request

    recipe = load_recipe(ONE_GPU).recipe
    text = render_script(recipe, RenderOptions(recipe_file="recipes/one_gpu.yaml"))
    assert "#SBATCH hetjob" not in text and "--het-group" not in text
    assert text.count("#SBATCH --nodes=1") == 1 and "#SBATCH --ntasks-per-node=2" in text
    assert text.count("#SBATCH --gpus-per-node=1") == 1, "one GPU for the job: the steps share it"
    both = memory_request(recipe, "capture").requested_gib + memory_request(recipe, "trainer").requested_gib
    assert f"#SBATCH --mem={both}G" in text, "the node holds both components' memory"
    for component in ("capture", "trainer"):
        assert (
            f'srun --overlap --nodes=1 --ntasks=1 --cpus-per-task=4 --kill-on-bad-exit=1 --unbuffered --output="${{DSPARK_JOB_DIR//%/%%}}/logs/${{SLURM_JOB_ID}}_{component}_%t.out"'
            in text
        )  # noqa: E501
    # The same recipe as two het groups, each on a node of its own.
    separate = render_script(
        load_recipe(ONE_GPU, ["job.layout=separate_nodes"]).recipe, RenderOptions(recipe_file="recipes/one_gpu.yaml")
    )
    assert separate.count("#SBATCH hetjob") == 1 and "srun --het-group=1" in separate and "--overlap" not in separate


@pytest.mark.parametrize(
    ("overrides", "field", "says"),
    [
        (["job.trainer.nodes=2"], "job.trainer.nodes", "set job.trainer.nodes: 1, or job.layout: separate_nodes"),
        (
            ["job.trainer.exclusive=true"],
            "job.trainer.exclusive",
            "give job.capture.exclusive and job.trainer.exclusive the same value",
        ),  # noqa: E501
        (["plan.slurm_max_mem_per_node_gib=12"], "plan.slurm_max_mem_per_node_gib", "below the 19 GiB the one node"),
    ],
)
def test_one_node_layout_refuses_what_one_node_cannot_hold(overrides: list[str], field: str, says: str) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(ONE_GPU, overrides)
    problems = {p.path: p.render() for p in info.value.problems}
    assert says in problems[field], problems


def test_dry_run_prints_the_script_and_submits_nothing(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    done = subprocess.run(
        [
            *[sys.executable, "-m", "launcher", "kimi_k3_v1c", "--smoke", "--dry-run", "--set", f"job.runs_dir={runs}"],
            *["--set", "plan.trainer_local_disk_bytes=1GB"],  # a blocker: the dry run still prints, and names it
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.startswith("#!/bin/bash") and "srun --het-group=1" in done.stdout
    assert "# command: sbatch" in done.stdout and "nothing was submitted" in done.stdout
    assert "plan blocker" in done.stdout
    assert not runs.exists(), "a dry run creates no job folder"


def test_submission_refuses_missing_site_variables(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "kimi_k3_v1c"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 2
    assert "${K3_TARGET_DIR} is not set (used by capture.target_path)" in done.stderr
    # RUNBOOK section 10 quotes the message the launcher prints, word for word
    playbook = (REPO / "RUNBOOK.md").read_text().split("## 10. Failure playbook", 1)[1]
    row = next(line for line in playbook.splitlines() if "site path is unset" in line)
    quoted = row.split("`")[1]
    assert quoted in done.stderr, f"RUNBOOK section 10 quotes {quoted!r}; the launcher says: {done.stderr}"


def test_dry_run_names_unset_site_variables_as_the_submission_would(tmp_path: Path) -> None:
    """A dry run of a recipe whose ``${VAR}`` site paths are unset still prints the script, and says which
    variables a real submission would refuse on, with the fields that read them."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "kimi_k3_v1c", "--dry-run", "--set", f"job.runs_dir={tmp_path / 'runs'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert done.stdout.startswith("#!/bin/bash")
    assert "# not submittable here: recipe recipes/kimi_k3_v1c.yaml reads environment variables" in done.stdout
    for name, field in (("K3_TARGET_DIR", "capture.target_path"), ("K3_DATA_DIR", "data.train_path")):
        assert f"#   - ${{{name}}} is not set (used by {field})" in done.stdout
    site = {"K3_TARGET_DIR": "/t", "K3_DATA_DIR": "/d", "K3_INIT_CHECKPOINT": "/c", "K3_FEATURE_CACHE_DIR": "/f"}
    complete = subprocess.run(
        [sys.executable, "-m", "launcher", "kimi_k3_v1c", "--dry-run", "--set", f"job.runs_dir={tmp_path / 'runs'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**env, **site},
        check=True,
    )
    assert "not submittable here" not in complete.stdout


def test_bad_recipe_exits_2_with_one_clear_message() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "tiny", "--plan", "--set", "trainer.optimzer.lr=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert "recipes/tiny.yaml" in done.stderr and "did you mean 'optimizer'" in done.stderr.lower()
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("args", [["tiny", "--plan"], ["status", "--help"]])
def test_login_path_never_imports_torch(args: list[str]) -> None:
    probe = (
        "import sys, runpy\n"
        f"sys.argv = ['launcher', *{args!r}]\n"
        "try:\n    runpy.run_module('launcher', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip().endswith("NO-TORCH")


def _fake_sacct(bin_dir: Path, stdout: str = "", stderr: str = "", code: int = 0) -> dict[str, str]:
    """A ``sacct`` on PATH that prints what a real one prints in that situation (a process-boundary stub)."""
    import os

    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "sacct"
    script.write_text(f"#!/bin/sh\ncat <<'OUT'\n{stdout}OUT\ncat >&2 <<'ERR'\n{stderr}\nERR\nexit {code}\n")
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _slurm_record(tmp_path: Path, job_id: str = "77") -> Path:
    from launcher.jobs import JobRecord, write_record

    runs = tmp_path / "runs"
    job_dir = runs / "tiny" / "stamp"
    job_dir.mkdir(parents=True)
    record = JobRecord(job_id, "slurm", "tiny", str(job_dir), "recipes/tiny.yaml", "0" * 64, False, False)
    record.components = {"capture": 1, "trainer": 4}
    write_record(record, runs)
    return runs


def test_a_printed_command_names_the_job_so_that_it_finds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job in the default runs folder is named by its id (``status 77`` finds it); a job of another runs
    folder (``--set job.runs_dir=...``) by its folder, quoted for the shell, since ``status 77`` alone would
    look in the default one."""
    from launcher import jobs

    default_runs = tmp_path / "default runs"
    monkeypatch.setattr(jobs, "DEFAULT_RUNS_DIR", default_runs)
    runs = _slurm_record(tmp_path)
    record = jobs.find_record("77", runs)
    assert record.command_ref == shlex.quote(record.job_dir)
    jobs.write_record(record, default_runs)
    assert record.command_ref == "77"
    odd = tmp_path / "a b$(touch x)" / "tiny" / "stamp"
    odd.mkdir(parents=True)
    elsewhere = dataclasses.replace(record, job_id="78", job_dir=str(odd))
    assert shlex.split(elsewhere.command_ref) == [str(odd)]


def test_status_without_slurm_fails_and_says_how_to_reach_it(tmp_path: Path) -> None:
    runs = _slurm_record(tmp_path)
    env = _fake_sacct(
        tmp_path / "bin",
        stderr="sacct: error: Problem talking to the database: Connection refused",
        code=1,
    )
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "status", "77", "--runs-dir", str(runs)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "cannot tell the state of job 77" in done.stderr and "Connection refused" in done.stderr
    assert "tools/slurm_local up" in done.stderr and "UNKNOWN" not in done.stdout


def test_status_of_a_pending_job_names_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from launcher import control
    from launcher.jobs import find_record

    runs = _slurm_record(tmp_path)
    pending = "JobID|JobName|State|ExitCode|Elapsed|NodeList|Reason\n77+0|tiny|PENDING|0:0|00:00:00|None assigned|Resources\n77+1|tiny|PENDING|0:0|00:00:00|None assigned|Resources\n"
    env = _fake_sacct(tmp_path / "bin", stdout=pending)
    monkeypatch.setenv("PATH", env["PATH"])
    report = control.job_report(find_record("77", runs))
    assert report.state == "PENDING" and not report.slurm_unreachable
    assert [c.describe() for c in report.components] == ["capture PENDING (Resources)", "trainer PENDING (Resources)"]


def test_missing_inputs_are_built_by_the_recipes_prepare_commands(tmp_path: Path) -> None:
    from launcher.inputs import InputPreparationError, prepare_missing_inputs

    target, data, count = tmp_path / "target", tmp_path / "train.jsonl", tmp_path / "runs_of_prepare"
    build = f"echo x >> {count} && mkdir -p {target} && touch {data}"
    overrides = [f"capture.target_path={target}", f"data.train_path={data}", f"data.prepare_commands=['{build}']"]
    recipe = load_recipe(TINY, overrides=overrides).recipe
    lines: list[str] = []
    assert prepare_missing_inputs(recipe, REPO, "tiny", log=lambda line, **_: lines.append(line))
    assert target.is_dir() and data.exists() and count.read_text() == "x\n"
    assert any("missing" in line for line in lines)
    assert not prepare_missing_inputs(recipe, REPO, "tiny", log=lines.append), "nothing runs once inputs exist"
    assert count.read_text() == "x\n"
    data.unlink()
    failing = load_recipe(TINY, overrides=[*overrides[:2], "data.prepare_commands=['exit 4']"]).recipe
    with pytest.raises(InputPreparationError, match="`exit 4` failed with exit code 4"):
        prepare_missing_inputs(failing, REPO, "tiny", log=lambda *_, **__: None)


def test_a_python_without_the_venvs_packages_gets_one_line_naming_the_fix() -> None:
    """``python3 -m launcher`` from a stock interpreter (no submitit): one line, not an import traceback."""
    import subprocess
    import sys

    script = (
        "import runpy, sys\n"
        "sys.modules['submitit'] = None  # as if not installed\n"
        "sys.argv = ['launcher', 'tiny', '--plan']\n"
        "runpy.run_module('launcher', run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "lacks the package 'submitit'" in done.stderr and ".venv/bin/python3 -m launcher" in done.stderr


def test_resolve_never_rewrites_a_job_folders_recorded_recipe(tmp_path: Path) -> None:
    """The same recipe again keeps the file byte for byte (a requeued manual sbatch job resolves at each
    start); another recipe is refused, naming both digests, and the file stays as it was."""
    from launcher.cli import main

    job_dir = tmp_path / "job"
    assert main(["resolve", "tiny", "--job-dir", str(job_dir)]) == 0
    recorded = (job_dir / "recipe.resolved.json").read_bytes()
    assert main(["resolve", "tiny", "--job-dir", str(job_dir)]) == 0
    assert (job_dir / "recipe.resolved.json").read_bytes() == recorded
    assert main(["resolve", "tiny", "--job-dir", str(job_dir), "--set", "trainer.optimizer.lr=1e-4"]) == 2
    assert (job_dir / "recipe.resolved.json").read_bytes() == recorded
    assert main(["resolve", "kimi_k3_v1c", "--job-dir", str(job_dir)]) == 2
    assert (job_dir / "recipe.resolved.json").read_bytes() == recorded


def test_a_taken_port_refuses_a_local_run_before_anything_starts(tmp_path: Path) -> None:
    """--local binds every port of the job on this machine: one in use (another --local job, say) is
    refused up front, naming the field, with no job folder made and no process started."""
    import socket
    import subprocess
    import sys

    from runtime.transport.loopback import free_port

    runs = tmp_path / "runs"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        sets = [f"job.runs_dir={runs}", f"job.master_port={free_port()}", f"transport.master_rpc_port={free_port()}"]
        sets += [f"transport.metadata_http_port={taken}", f"transport.metrics_port={free_port()}"]
        command = [sys.executable, "-m", "launcher", "tiny", "--local", "--probe"]
        for item in sets:
            command += ["--set", item]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"transport.metadata_http_port {taken}" in done.stderr and "Nothing was started" in done.stderr
    assert "--set transport.metadata_http_port=PORT" in done.stderr and "Traceback" not in done.stderr
    assert not runs.exists(), "no job folder"


def test_a_second_local_run_is_refused_naming_the_running_job(tmp_path: Path) -> None:
    """A --local job still running with the same ports (here: its record and a live supervisor process,
    before it bound any port, as in the first seconds of a run) refuses a second run up front, naming
    it; nothing is started and the running job is not disturbed."""
    import datetime as dt
    import time

    from launcher.jobs import JobRecord, write_record
    from runtime.recipe import write_resolved
    from runtime.transport.loopback import free_port

    runs = tmp_path / "runs"
    sets = [f"job.runs_dir={runs}", f"job.master_port={free_port()}", f"transport.master_rpc_port={free_port()}"]
    sets += [f"transport.metadata_http_port={free_port()}", f"transport.metrics_port={free_port()}"]
    job_dir = runs / "tiny" / "first"
    (job_dir / "logs").mkdir(parents=True)
    write_resolved(load_recipe(TINY, overrides=sets), job_dir, REPO)
    # The running job's supervisor: a live process whose command line is `... -m launcher tiny --local`,
    # holding its job folder's lock as a supervisor does.
    from launcher.control import SUPERVISOR_LOCK

    holder = (
        "import fcntl, sys, time; h = open(sys.argv[1], 'w'); fcntl.flock(h, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(120)"
    )
    supervisor = subprocess.Popen(
        [sys.executable, "-c", holder, str(job_dir / SUPERVISOR_LOCK), "-m", "launcher", "tiny", "--local"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert supervisor.stdout is not None and supervisor.stdout.readline().strip() == "held"
        time.sleep(0.2)
        record = JobRecord(
            job_id="local-first",
            mode="local",
            name="tiny",
            job_dir=str(job_dir),
            recipe_source="tiny",
            recipe_digest="d",
            smoke=False,
            probe=True,
            components={"capture": 1, "trainer": 4},
            submitted_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            supervisor_pid=supervisor.pid,
        )
        write_record(record, runs)
        command = [sys.executable, "-m", "launcher", "tiny", "--local", "--probe"]
        for item in sets:
            command += ["--set", item]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "job local-first" in done.stderr and "is running on this machine" in done.stderr, done.stderr
        assert "transport.master_rpc_port" in done.stderr and "Nothing was started" in done.stderr
        # the job's folder, not its id: its runs folder is not the one `cancel ID` looks in
        assert f"python3 -m launcher cancel {job_dir}`" in done.stderr and "Traceback" not in done.stderr
        assert sorted(p.name for p in (runs / "tiny").iterdir()) == ["first"], "no second job folder"
        assert supervisor.poll() is None, "the running job is not disturbed"
        # Started in the same second as the first (both passed the early check before either had a
        # record): checked again under a lock just before the record is written; the fresh folder goes.
        from launcher.cli import LaunchError, _refuse_running_local_jobs, run_local
        from launcher.jobs import new_job_dir

        loaded = load_recipe(TINY, overrides=sets)
        late_dir = new_job_dir(REPO, loaded)
        with pytest.raises(LaunchError, match="job local-first .* is running on this machine"):
            run_local(loaded, late_dir, probe=True)
        assert not late_dir.exists() and supervisor.poll() is None
        # Other ports: the second run is not refused for the first one (the check compares ports).

        other = [*sets[:1], *(f"{s.split('=')[0]}={free_port()}" for s in sets[1:])]
        _refuse_running_local_jobs(load_recipe(TINY, overrides=other))
    finally:
        supervisor.kill()
        supervisor.wait()


def test_the_port_clash_check_covers_the_trainer_rendezvous_port() -> None:
    with pytest.raises(
        RecipeError, match=r"transport.master_rpc_port.*uses port 29511, already used by job.master_port"
    ):
        load_recipe(TINY, ["transport.master_rpc_port=29511"])


def test_cancel_of_a_copied_running_job_folder_leaves_the_original_supervisor_alone(tmp_path: Path) -> None:
    """The supervisor holds its own folder's lock open: the copy's record names its pid, but the copy
    is not its job (cancelling the copy once killed the original run)."""
    import datetime as dt
    import shutil
    import time

    from launcher.control import SUPERVISOR_LOCK, CancelError, cancel_job
    from launcher.jobs import JobRecord

    original = tmp_path / "runs" / "tiny" / "a"
    original.mkdir(parents=True)
    lock = original / SUPERVISOR_LOCK
    holder = (
        "import fcntl, sys, time; h = open(sys.argv[1], 'w'); fcntl.flock(h, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(120)"
    )
    supervisor = subprocess.Popen(
        [sys.executable, "-c", holder, str(lock), "-m", "launcher", "tiny", "--local"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert supervisor.stdout is not None and supervisor.stdout.readline().strip() == "held"
        time.sleep(1.1)  # the record is written after the supervisor started

        def record(folder: Path) -> JobRecord:
            return JobRecord(
                job_id=f"local-{folder.name}",
                mode="local",
                name="tiny",
                job_dir=str(folder),
                recipe_source="recipes/tiny.yaml",
                recipe_digest="d",
                smoke=False,
                probe=False,
                components={"capture": 1, "trainer": 4},
                submitted_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                supervisor_pid=supervisor.pid,
            )

        copy = tmp_path / "runs" / "tiny" / "b"
        shutil.copytree(original, copy)
        with pytest.raises(CancelError, match="is not running"):
            cancel_job(record(copy))
        # ... nor through a copy made without its dot files (rsync --exclude '.*', a tarball of what ls shows)
        bare = tmp_path / "runs" / "tiny" / "c"
        shutil.copytree(original, bare, ignore=shutil.ignore_patterns(".*"))
        assert not (bare / SUPERVISOR_LOCK).exists()
        with pytest.raises(CancelError, match="is not running"):
            cancel_job(record(bare))
        time.sleep(0.2)
        assert supervisor.poll() is None, "the original run's supervisor was signalled through a copy"
        assert "SIGTERM" in cancel_job(record(original))
        assert supervisor.wait(timeout=10) != 0
    finally:
        supervisor.kill()
        supervisor.wait()


def test_a_port_range_moves_every_port_of_a_local_job_that_no_set_names(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``DSPARK_PORT_RANGE`` with --local: the job's ports come from the range (two users or two suites on
    one machine, each with its own range, never collide), recorded as --set so a resume keeps them; a
    port the command line names stays."""
    from launcher import cli
    from runtime.recipe.checks import job_ports

    monkeypatch.setenv("DSPARK_PORT_RANGE", "47100-47199")
    loaded = cli._ports_from_the_range(cli.load("tiny", ["transport.metrics_port=47350"], False))
    ports = job_ports(loaded.recipe)
    assert ports["transport.metrics_port"] == 47350
    moved = {field: port for field, port in ports.items() if field != "transport.metrics_port"}
    assert moved and all(47100 <= port <= 47199 for port in moved.values()), ports
    assert len(set(moved.values())) == len(moved)
    assert [o for o in loaded.overrides if o.startswith("job.master_port=")] == [
        f"job.master_port={ports['job.master_port']}"
    ]
    assert "[local] ports from DSPARK_PORT_RANGE=47100-47199" in capsys.readouterr().out
    monkeypatch.delenv("DSPARK_PORT_RANGE")
    plain = cli._ports_from_the_range(cli.load("tiny", [], False))
    assert job_ports(plain.recipe)["job.master_port"] == load_recipe(TINY).recipe.job.master_port
