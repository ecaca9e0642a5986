"""Where each command may write (runtime.user_errors.output_place, and the callers that use it).

``render`` writes sbatch/ only for the repository's own recipes; a recipe elsewhere gets its scripts
next to itself or in ``--out``. Job folders stay inside their runs folder, and never land in the
repository root, the filesystem root or the home folder itself. The refusals are also in the
bad-input corpus; these tests check what IS written, and where.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import cli as launcher_cli
from launcher import jobs
from runtime.recipe import load_recipe
from runtime.user_errors import UserError, output_place

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny.yaml"


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.sbatch"))}


def test_render_of_a_recipe_outside_recipes_writes_next_to_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _digests(REPO / "sbatch")
    copy = tmp_path / "mine.yaml"
    shutil.copy(TINY, copy)
    copy.write_text(copy.read_text() + "\n# my copy\n")
    assert launcher_cli.main(["render", str(copy)]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "mine.sbatch").is_file() and (tmp_path / "mine.eval.sbatch").is_file(), out
    assert _digests(REPO / "sbatch") == before, "the checked-in scripts were rewritten"
    # --out names the folder; sbatch/ is refused for a recipe that is not the repository's.
    out_dir = tmp_path / "scripts"
    out_dir.mkdir()
    assert launcher_cli.main(["render", str(copy), "--out", str(out_dir)]) == 0
    assert sorted(p.name for p in out_dir.iterdir()) == ["mine.eval.sbatch", "mine.sbatch"]
    assert launcher_cli.main(["render", str(copy), "--out", str(REPO / "sbatch")]) == 2
    assert "nothing was written" in capsys.readouterr().err
    assert _digests(REPO / "sbatch") == before


def test_render_check_of_the_repository_recipes_still_reads_sbatch() -> None:
    assert launcher_cli.main(["render", "--check"]) == 0


def test_a_job_folder_never_leaves_its_runs_folder(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "tiny").symlink_to(outside)
    loaded = load_recipe(TINY, overrides=[f"job.runs_dir={runs}"])
    with pytest.raises(UserError, match="outside"):
        jobs.new_job_dir(REPO, loaded)
    assert not any(outside.iterdir()), "nothing was made through the link"
    (runs / "tiny").unlink()
    made = jobs.new_job_dir(REPO, loaded)
    assert made.parent == runs / "tiny" and (made / "logs").is_dir()


def test_a_runs_folder_that_is_the_repository_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError, match=r"job.runs_dir .* is the repository itself"):  # at load, before any folder
        load_recipe(TINY, overrides=["job.runs_dir=."])


def test_output_place_resolves_links_and_refuses_root_and_home(tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real")
    assert output_place(link, "--x") == (tmp_path / "real").resolve()
    root_link = tmp_path / "root"
    root_link.symlink_to("/")
    for bad in (Path("/"), root_link, Path.home()):
        with pytest.raises(UserError, match="nothing is written"):
            output_place(bad, "--x")
    with pytest.raises(UserError, match="outside"):
        output_place(link, "--x", within=tmp_path / "elsewhere")


def test_two_resolves_into_one_folder_at_once_keep_one_recipe(tmp_path: Path) -> None:
    """Two ``resolve`` with different recipes into one folder: one writes, the other is refused (they
    both wrote, one after the other, before the folder's lock)."""
    job_dir = tmp_path / "job"
    command = [sys.executable, "-m", "launcher", "resolve", "tiny", "--job-dir", str(job_dir), "--set"]
    runs = [subprocess.Popen([*command, f"trainer.seed={seed}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in (1, 2)]  # fmt: skip
    results = [
        (p.wait(timeout=120), p.stdout.read() if p.stdout else "", p.stderr.read() if p.stderr else "") for p in runs
    ]
    assert sorted(code for code, _, _ in results) == [0, 2], results
    written = json.loads((job_dir / "recipe.resolved.json").read_text())["digest"]
    (winner,) = [out for code, out, _ in results if code == 0]
    assert written[:12] in winner


def test_a_refused_credential_leaves_nothing_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """resolve with a password in a URL: refused before the job folder exists, the password in no output."""
    password = "pw" + "x7" * 8
    job_dir = tmp_path / "job"
    code = launcher_cli.main(
        ["resolve", "tiny", "--job-dir", str(job_dir), "--set", f"capture.target_revision=https://bob:{password}@h/r"]
    )
    captured = capsys.readouterr()
    assert code == 2 and not job_dir.exists()
    assert password not in captured.out + captured.err and "capture.target_revision" in captured.err


def test_an_empty_home_never_turns_a_tilde_into_the_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With HOME set but empty, ``~/x`` expands to ``/x``: refused for a tool's output and a recipe's folder."""
    monkeypatch.setenv("HOME", "")
    with pytest.raises(UserError, match="HOME is empty"):
        output_place(Path("~/dspark_r"), "--out")
    with pytest.raises(UserError, match=r"job.runs_dir .*HOME is empty"):
        load_recipe(TINY, overrides=["job.runs_dir=~/dspark_r"])
    assert not Path("/dspark_r").exists()


def test_two_recipes_of_recipes_never_render_into_one_script(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second recipe with the first one's job.name would write sbatch/<name>.sbatch over the other's."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "tiny.yaml").write_text(TINY.read_text())
    (recipes / "evil_tiny.yaml").write_text(TINY.read_text().replace("time_limit_min: 30", "time_limit_min: 31"))
    monkeypatch.setattr(launcher_cli, "RECIPES_DIR", recipes)
    before = _digests(REPO / "sbatch")
    for argv in (["render", "evil_tiny"], ["render"]):
        assert launcher_cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "both have job.name 'tiny'" in err and "nothing was written" in err, err
    assert _digests(REPO / "sbatch") == before
