"""Nothing a user types runs as a command: batch scripts rendered from hostile values, run under bash.

Each case renders a script (the launcher's ``--dry-run`` form and the manual ``sbatch/`` form) from
recipe values and recipe file names full of shell syntax (``$(...)``, backticks, quotes, spaces,
``;``), then runs it under bash with stub ``srun``, ``python3`` and ``sleep`` first on PATH. A ``touch`` hidden
in a value would create a marker file; none may appear, and the stubs must receive the job folder
and the recipe path exactly as typed. Values that cannot be made safe on one script line (a newline
in an ``#SBATCH`` value, shell syntax in ``job.python``, a non-address ``bind_address``) are refused
at load time: the bad-input corpus (tests/test_bad_inputs.py) holds those.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from launcher import cli as launcher_cli
from launcher.render import RenderOptions, render_script, shell_word
from runtime.recipe import load_recipe

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny.yaml"

STUB = """#!/bin/bash
# Records its arguments, NUL-separated, in a file of its own (the components run in parallel).
printf '%s\\0' "$@" > "$STUB_LOG.$$"
"""

HOSTILE = [
    "a b $(touch {m}/PWN_dollar)",
    "c`touch {m}/PWN_backtick`",
    "d'$(touch {m}/PWN_single)'",
    'e"$(touch {m}/PWN_double)"',
    "f; touch {m}/PWN_semicolon;",
    "g}}${{x:-$(touch {m}/PWN_brace)}}",
]


def _stubs(folder: Path) -> Path:
    bin_dir = folder / "stub-bin"
    bin_dir.mkdir()
    for name in ("srun", "python3"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    (bin_dir / "sleep").write_text("#!/bin/sh\n")  # the supervision loop's pauses: no waiting in a test
    (bin_dir / "sleep").chmod(0o755)
    return bin_dir


def _run_script(script: str, folder: Path, env: dict[str, str]) -> list[list[str]]:
    """Run ``script`` under bash with the stubs; returns each stub call's arguments."""
    path = folder / "job.sh"
    path.write_text(script)
    log = folder / "stub.log"
    bin_dir = _stubs(folder)
    full_env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(folder),
        "STUB_LOG": str(log),
        "SLURM_JOB_ID": "77",
        "DSPARK_VENV": str(folder / "no-venv"),
        **env,
    }
    # The supervision loop ends at once: the stub components exit immediately.
    done = subprocess.run(["bash", str(path)], env=full_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return [p.read_text().split("\0")[:-1] for p in sorted(folder.glob("stub.log.*"))]


def _markers(folder: Path) -> list[Path]:
    """Files a hidden ``touch {marks}/PWN_x`` made (a folder spelt literally with the same text is fine)."""
    return sorted(p for p in (folder / "marks").iterdir() if p.name.startswith("PWN_"))


def _argument_after(calls: list[list[str]], flag: str) -> set[str]:
    return {call[call.index(flag) + 1] for call in calls if flag in call}


@pytest.mark.parametrize("pattern", HOSTILE, ids=[h.split("(")[0].split("`")[0].strip() for h in HOSTILE])
def test_a_dry_run_script_runs_no_command_hidden_in_the_runs_dir_or_recipe_path(
    pattern: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    value = pattern.format(m=marks)
    recipe = tmp_path / "recipes" / f"{value.replace('/', '_')}.yaml"
    recipe.parent.mkdir()
    shutil.copy(TINY, recipe)
    runs = tmp_path / f"runs {value}"
    code = launcher_cli.main([str(recipe), "--dry-run", "--set", f"job.runs_dir={runs}"])
    out = capsys.readouterr().out
    assert code == 0, out
    calls = _run_script(out, tmp_path, {"DSPARK_REPO": str(tmp_path)})
    assert not _markers(tmp_path), f"a command ran: {_markers(tmp_path)}\n{out}"
    job_dirs = _argument_after(calls, "--job-dir")
    assert job_dirs == {str(runs / "tiny" / "<stamp>")}, job_dirs
    assert _argument_after(calls, "resolve") == {str(recipe)}, calls
    assert (runs / "tiny" / "<stamp>" / "logs").is_dir(), "the script made the job folder the launcher names"
    # The printed sbatch command is one shell word too.
    command = next(line for line in out.splitlines() if line.startswith("# command: sbatch "))
    assert shell_word(str(runs / "tiny" / "<stamp>" / "submission.sh")) in command


@pytest.mark.parametrize("pattern", HOSTILE[:3], ids=["dollar", "backtick", "single"])
def test_the_manual_script_runs_no_command_hidden_in_a_relative_runs_dir(pattern: str, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    value = pattern.format(m=marks).replace("/", "_")  # one folder under the repository
    loaded = load_recipe(TINY, overrides=[f"job.runs_dir={value}"])
    script = render_script(loaded.recipe, RenderOptions(recipe_file=f"recipes/{value}.yaml"))
    calls = _run_script(script, tmp_path, {"SLURM_SUBMIT_DIR": str(tmp_path)})
    assert not _markers(tmp_path), script
    assert _argument_after(calls, "--job-dir") == {str(tmp_path / value / "tiny" / "77")}
    assert _argument_after(calls, "resolve") == {f"recipes/{value}.yaml"}


def test_a_home_runs_dir_is_the_same_folder_for_the_launcher_and_the_script(tmp_path: Path) -> None:
    loaded = load_recipe(TINY, overrides=["job.runs_dir=~/my runs"])
    script = render_script(loaded.recipe, RenderOptions(recipe_file="recipes/tiny.yaml"))
    calls = _run_script(script, tmp_path, {"SLURM_SUBMIT_DIR": str(tmp_path)})
    assert _argument_after(calls, "--job-dir") == {str(tmp_path / "my runs" / "tiny" / "77")}


def test_quoted_values_reach_srun_and_sbatch_lines_as_typed(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    hostile = f"x $(touch {marks}/PWN_srun)"
    overrides = [
        f"job.trainer.srun_args=['--comment={hostile}']",
        f"job.partition=p $(touch {marks}/PWN_partition)",
        f"job.trainer.extra_sbatch={{comment: 'c `touch {marks}/PWN_extra`'}}",
        f"job.container_image=img $(touch {marks}/PWN_image)",
    ]
    loaded = load_recipe(TINY, overrides=overrides)
    script = render_script(loaded.recipe, RenderOptions(recipe_file="recipes/tiny.yaml"))
    for line in script.splitlines():
        if line.startswith("#SBATCH --partition"):
            assert line == f"#SBATCH --partition={shell_word(f'p $(touch {marks}/PWN_partition)')}"
    calls = _run_script(script, tmp_path, {"SLURM_SUBMIT_DIR": str(tmp_path)})
    assert not _markers(tmp_path), script
    assert any(f"--comment={hostile}" in call for call in calls), calls
    assert any(f"--container-image=img $(touch {marks}/PWN_image)" in call for call in calls), calls


def test_shell_word_refuses_a_line_break() -> None:
    assert shell_word("plain/path-1.yaml") == "plain/path-1.yaml"
    assert shell_word("a b") == "'a b'"
    for bad in ("a\nb", "a\rb", "a\x00b"):
        with pytest.raises(ValueError, match="control character"):
            shell_word(bad)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_checked_in_scripts_still_parse() -> None:
    for script in sorted((REPO / "sbatch").glob("*.sbatch")):
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, env=dict(os.environ))
        assert done.returncode == 0, f"{script}: {done.stderr}"


def test_the_printed_resume_command_is_one_word_per_argument(tmp_path: Path) -> None:
    """The resume line every stop and failure prints, pasted into bash, runs nothing hidden in the job
    folder's name and hands the launcher the folder exactly (the job's own recipe is read from it)."""
    from runtime.shared.contracts import resume_command

    marks = tmp_path / "marks"
    marks.mkdir()
    job_dir = tmp_path / f"runs/my x$(touch {marks}/PWN_dollar)`touch {marks}/PWN_job`"
    line = resume_command(job_dir, local=True)
    calls = _run_script(line + "\n", tmp_path, {})
    assert not _markers(tmp_path), line
    assert calls == [["-m", "launcher", "--resume", str(job_dir), "--local"]], calls
