"""Issue 15, items 8 and 9: bad recipe inputs get one clear error at load time, and credentials never
reach a recipe or a file written from it (``recipe.resolved.json``, error messages)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launcher.jobs import JobLookupError, find_record
from runtime.recipe import RecipeError, load_recipe
from runtime.recipe.checks import check_recipe

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny.yaml"


def problems_of(*overrides: str, path: Path = TINY) -> str:
    with pytest.raises(RecipeError) as err:
        load_recipe(path, overrides=list(overrides))
    return str(err.value)


def test_duplicate_yaml_key_is_refused_with_both_lines(tmp_path: Path) -> None:
    text = TINY.read_text().replace("  name: tiny\n", "  name: tiny\n  name: other\n", 1)
    recipe = tmp_path / "dup.yaml"
    recipe.write_text(text)
    message = problems_of(path=recipe)
    assert "duplicate key 'name' (first given at line" in message and "keep one of them" in message


def test_non_utf8_recipe_names_the_byte_and_line(tmp_path: Path) -> None:
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes(TINY.read_bytes().replace(b"description: >", b"description: caf\xe9 >", 1))
    message = problems_of(path=recipe)
    assert "not UTF-8 text: byte 0xe9 at line" in message and "save the recipe as UTF-8" in message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.optimizer.lr=inf", "trainer.optimizer.lr .*finite number"),
        ("trainer.optimizer.lr=1e400", "trainer.optimizer.lr .*finite number"),
        ("trainer.optimizer.betas=[0.9, 1.5]", r"betas \[0.9, 1.5\] are outside \[0, 1\)"),
        ("trainer.micro_batch_size=true", r"trainer.micro_batch_size .*valid integer.*got 'true'"),
        ("trainer.epochs=100000000000", "trainer.epochs .*less than or equal to 10000"),
        ("job.name=..", r"'\.\.' is not a plain folder name"),
        ("job.name=../escape", "is not a plain folder name"),
    ],
)
def test_bad_values_fail_at_load_time_naming_the_field(override: str, expected: str) -> None:
    import re

    message = problems_of(override)
    assert re.search(expected, message), message


def test_watermark_fix_is_never_a_negative_number() -> None:
    loaded = load_recipe(TINY)
    sizes = dict.fromkeys(("store_cap_bytes", "high_watermark_bytes", "global_segment_bytes"), 16 << 20)
    transport = loaded.recipe.transport.model_copy(update={**sizes, "low_watermark_bytes": 8 << 20})
    capture = loaded.recipe.capture.model_copy(update={"batch_size": 64})
    recipe = loaded.recipe.model_copy(update={"capture": capture, "transport": transport})
    found = [p for p in check_recipe(recipe) if p.path == "transport.high_watermark_bytes"]
    assert found, "the overshoot is reported"
    assert "at most -" not in found[0].fix
    assert "raise transport.store_cap_bytes" in found[0].fix and "lower capture.batch_size" in found[0].fix


def test_resume_of_an_unknown_job_suggests_an_option_that_exists(tmp_path: Path) -> None:
    with pytest.raises(JobLookupError) as err:
        find_record("nope", tmp_path, runs_dir_hint="--set job.runs_dir=FOLDER")
    assert "--set job.runs_dir=FOLDER" in str(err.value) and "--runs-dir" not in str(err.value)
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "tiny", "--plan", "--resume", "nope", "--set", f"job.runs_dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "--runs-dir" not in done.stderr, done.stderr


@pytest.mark.parametrize("name", ["WANDB_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD"])
def test_credentials_in_job_env_are_refused_and_never_echoed(name: str, tmp_path: Path) -> None:
    secret = "s3cr3tVALUEfor15"
    message = problems_of(f"job.env.{name}={secret}")
    assert f"{name} looks like a credential" in message and "export it in the submitting shell" in message
    assert secret not in message
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "tiny", "--plan", "--set", f"job.env.{name}={secret}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and secret not in done.stdout + done.stderr
    assert not list(tmp_path.rglob("recipe.resolved.json"))


def test_ordinary_environment_names_still_pass() -> None:
    recipe = load_recipe(TINY, overrides=["job.env.OMP_NUM_THREADS=2", "job.env.NCCL_DEBUG=WARN"]).recipe
    assert recipe.job.env["OMP_NUM_THREADS"] == "2"


def test_resume_under_another_draft_target_or_data_is_refused_before_submission(tmp_path: Path) -> None:
    from launcher.jobs import JobRecord, write_record

    runs = tmp_path / "runs"
    job_dir = runs / "tiny" / "old"
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "resolve", "tiny", "--job-dir", str(job_dir), "--set", f"job.runs_dir={runs}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (job_dir / "checkpoints" / "step_00000008").mkdir(parents=True)
    (job_dir / "checkpoints" / "step_00000008" / "trainer_state.json").write_text("{}")
    write_record(
        JobRecord(job_id="old-job", mode="local", name="tiny", job_dir=str(job_dir), recipe_source="recipes/tiny.yaml",
                  recipe_digest="0" * 64, smoke=False, probe=False, components={"capture": 1, "trainer": 4}),
        runs,
    )  # fmt: skip

    def resume(*sets: str) -> subprocess.CompletedProcess[str]:
        args = ["tiny", "--plan", "--resume", "old-job", "--set", f"job.runs_dir={runs}"]
        for item in sets:
            args += ["--set", item]
        return subprocess.run(
            [sys.executable, "-m", "launcher", *args], cwd=REPO, capture_output=True, text=True, timeout=120
        )

    assert resume().returncode == 0  # the same recipe resumes
    refused = resume("trainer.draft.num_layers=2", "capture.target_revision=other", "data.expected_sha256=" + "ab" * 32)
    assert refused.returncode == 2
    for part in (
        "cannot resume job old-job",
        "trainer.draft.num_layers 1 -> 2",
        'capture.target_revision "tiny-v1" -> "other"',
        'data.expected_sha256 "manifest" -> "abab',
        f"Fix: `python3 -m launcher --resume {job_dir} --local` continues with the job's own recipe",
        f"--fork {job_dir} --set",
    ):
        assert part in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr


def test_set_on_the_smoke_overlay_is_checked_like_the_file_and_named_as_the_set() -> None:
    typo = problems_of("smoke.trainer.epoks=1")
    assert "smoke.trainer.epoks (from --set smoke.trainer.epoks=1): unknown key 'epoks'" in typo
    assert "rename it to 'epochs'" in typo
    out_of_range = problems_of("smoke.trainer.epochs=0")
    assert "smoke.trainer.epochs (from --set smoke.trainer.epochs=0)" in out_of_range
    assert "use a value >= 1" in out_of_range
    # applied to the overlay, so --smoke runs with it
    smoke = load_recipe(TINY, ["smoke.trainer.max_steps=2"], smoke=True).recipe
    assert smoke.trainer.max_steps == 2


def test_a_range_error_names_the_allowed_range() -> None:
    assert "use a value > 0.0" in problems_of("trainer.optimizer.lr=-1")


def test_a_closed_pipe_ends_the_launcher_quietly() -> None:
    """``--dry-run | head -1``: the reader leaves early; no traceback, the shell's SIGPIPE status.
    (``true`` leaves at once, before the launcher has written anything: the case is certain.)"""
    done = subprocess.run(
        f"{sys.executable} -m launcher tiny --dry-run | true; exit ${{PIPESTATUS[0]}}",
        shell=True, executable="/bin/bash", cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.stderr == "" and done.returncode == 141


def test_cuda_without_gpus_and_more_ranks_than_gpus_are_refused_at_load_time() -> None:
    message = problems_of("trainer.device=cuda")
    assert "trainer.device (from --set trainer.device=cuda): is cuda, but job.trainer.gpus_per_node is 0" in message
    assert "or trainer.device: cpu" in message
    assert "capture.device (from --set capture.device=cuda): is cuda" in problems_of("capture.device=cuda")
    k3 = REPO / "recipes" / "kimi_k3_v1c.yaml"
    crowded = problems_of("job.trainer.tasks_per_node=8", "trainer.gradient_accumulation_steps=16", path=k3)
    assert (
        "job.trainer.tasks_per_node (from --set job.trainer.tasks_per_node=8): is 8, but job.trainer.gpus_per_node is 4"
        in crowded
    )
    assert "job.trainer.gpus_per_node: 8" in crowded


def test_a_refusal_names_the_set_that_caused_it_not_the_recipe_file() -> None:
    """``--set job.capture.gpus_per_node=4`` leaves K3's TP8 server too few GPUs: the problems sit on
    ``capture.sglang.tp_size`` and ``job.capture.nodes`` (values of the file), but the input that caused
    them is the --set their messages name."""
    k3 = REPO / "recipes" / "kimi_k3_v1c.yaml"
    message = problems_of("job.capture.gpus_per_node=4", path=k3)
    assert "capture.sglang.tp_size (from --set job.capture.gpus_per_node=4): is 8" in message
    assert "job.capture.nodes (from --set job.capture.gpus_per_node=4): is 1" in message
    assert "(from recipes/kimi_k3_v1c.yaml)" not in message and f"(from {k3})" not in message


def test_the_reserved_environment_names_cover_the_contract() -> None:
    """job.env may not set what the launcher sets itself: the schema's list holds every contract name."""
    from launcher.environment import RENDEZVOUS_VARIABLES
    from runtime.recipe.schema import RESERVED_ENV_NAMES
    from runtime.shared import contracts

    contract = {v for k, v in vars(contracts).items() if k.startswith("ENV_") and isinstance(v, str)}
    assert contract and contract | set(RENDEZVOUS_VARIABLES) <= RESERVED_ENV_NAMES
    for name in ("DSPARK_JOB_DIR", "MASTER_ADDR", "PATH"):
        with pytest.raises(RecipeError, match="environment contract"):
            load_recipe(TINY, overrides=[f"job.env.{name}=x"])
    assert load_recipe(TINY, overrides=["job.env.DSPARK_PROBE_HOLD_S=5"]).recipe.job.env == {"DSPARK_PROBE_HOLD_S": "5"}
