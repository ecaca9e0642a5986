"""``python3 -m launcher eval JOB``: judge a job's trained draft under speculative decoding.

``--local`` runs ``python3 -m runtime.evaluate`` here (the target and draft on this machine's GPU or
CPU). Without it, a one-node Slurm job on a capture-class node (the recipe's ``job.capture``
resources, ``eval.time_limit_min``, ``--mem`` from the plan's host memory of the served target) runs
the same command; its batch script is rendered from the recipe like the training job's, and checked
in as ``sbatch/NAME.eval.sbatch`` for manual submission. Results land in ``<job>/eval/<draft>/`` either way.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from launcher import jobs
from launcher.component import ChildStopped, run_attached
from launcher.render import comment_text, container_args, resource_flags, sbatch_lines, shell_word
from launcher.slurm_args import checked_job_id, export_environment, output_pattern
from runtime.files import atomic_write_text
from runtime.recipe import Recipe, load_resolved
from runtime.recipe.eval_settings import check_eval_set_names, eval_settings
from runtime.recipe.fit.slurm_request import eval_memory_request
from runtime.recipe.loader import RESOLVED_FILENAME, refuse_repeated_sets
from runtime.shared.checkpoint_folders import refuse_another_runs_draft, resolve_draft_source
from runtime.shared.draft_provenance import refuse_another_runs_record
from runtime.shared.lifecycle import exit_text
from runtime.user_errors import UserError, output_place

EVAL_SCRIPT_SUFFIX = ".eval.sbatch"


class EvalLaunchError(UserError):
    """A refusal to start an evaluation, with the reason and the fix in its message."""


def eval_sbatch_path(repo_root: Path, recipe: Recipe) -> Path:
    """Where the checked-in eval batch script of ``recipe`` lives."""
    return repo_root / "sbatch" / f"{recipe.job.name}{EVAL_SCRIPT_SUFFIX}"


def render_eval_script(recipe: Recipe, recipe_file: str) -> str:
    """The one-node eval batch script of ``recipe`` (needs an ``eval:`` section)."""
    if recipe.eval is None:
        raise ValueError(f"{recipe_file} has no eval: section")
    job, resources = recipe.job, recipe.job.capture
    flags = resource_flags(
        recipe,
        resources,
        job_name=f"{job.name}-eval",
        time_limit_min=recipe.eval.time_limit_min,
        nodes=1,
        tasks_per_node=1,
        mem_gib=eval_memory_request(recipe).requested_gib,
    )
    flags += [("output", "slurm-%x-%j.out"), *sorted(resources.extra_sbatch.items())]
    python = shell_word(job.python)
    evaluate = [
        "srun",
        "--ntasks=1",
        "--unbuffered",
        *container_args(recipe),
        *[shell_word(a) for a in resources.srun_args],
        python,
        "-u",
        "-m",
        "runtime.evaluate",
        f'--recipe "$DSPARK_JOB_DIR/{RESOLVED_FILENAME}"',
        f"--eval-recipe {shell_word(recipe_file)}",
        '--checkpoint "$DSPARK_EVAL_CHECKPOINT"',
        "$DSPARK_EVAL_ARGS",
    ]
    lines = [
        "#!/bin/bash",
        f"# DSpark eval of job '{job.name}': speculative decoding of the target with a trained draft, one node",
        f"# of the capture kind. Rendered by `python3 -m launcher render` from {comment_text(recipe_file)}. Do not edit by hand:",
        "# change the recipe and render again (the golden test in tests/test_launcher_units.py keeps sbatch/ equal).",
        "#",
        "# `python3 -m launcher eval JOB` submits it for you. Manual submission, from the repository root:",
        f"#   DSPARK_JOB_DIR=runs/{job.name}/STAMP sbatch sbatch/{job.name}{EVAL_SCRIPT_SUFFIX}",
        "# Results: $DSPARK_JOB_DIR/eval/<checkpoint>/results.json, summary.txt and plots.",
        *sbatch_lines(flags),
        "",
        "set -uo pipefail",
        "",
        "# ---- site settings: edit here, or export them before sbatch ----",
        'DSPARK_REPO="${DSPARK_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"',
        ': "${DSPARK_JOB_DIR:?export DSPARK_JOB_DIR: the folder of the trained job (runs/NAME/STAMP)}"',
        'DSPARK_EVAL_CHECKPOINT="${DSPARK_EVAL_CHECKPOINT:-latest}"',
        'DSPARK_EVAL_ARGS="${DSPARK_EVAL_ARGS:-}"',
        "",
        'cd "$DSPARK_REPO" || { echo "cannot cd to DSPARK_REPO=$DSPARK_REPO" >&2; exit 1; }',
    ]
    if job.setup:
        lines.append("# ---- environment setup (job.setup) ----")
        lines += list(job.setup)
    lines += [
        'echo "[dspark] eval job $SLURM_JOB_ID of $DSPARK_JOB_DIR, draft $DSPARK_EVAL_CHECKPOINT"',
        " ".join(evaluate),
    ]
    return "\n".join(lines) + "\n"


def argument_parser() -> argparse.ArgumentParser:
    """The command line of `python3 -m launcher eval`."""
    parser = argparse.ArgumentParser(
        prog="python3 -m launcher eval",
        description="Judge a job's draft under speculative decoding: acceptance length against the target.",
    )
    parser.add_argument("job", help="job id, job folder, or 'latest' (the most recent submission)")
    parser.add_argument(
        "--checkpoint", default="latest", help="latest (default), step_N, untrained, or a draft folder (an export)"
    )
    parser.add_argument("--eval-set", dest="eval_sets", action="append", default=[], help="only this set (repeatable)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="eval.KEY=VALUE", help="override eval fields"
    )
    parser.add_argument("--local", action="store_true", help="run here instead of as a Slurm job")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: <job>/eval/<draft>)")
    parser.add_argument("--runs-dir", type=Path, default=None, help="runs folder holding jobs/<id> links")
    return parser


def local_eval_command(job_dir: Path, recipe_file: str, checkpoint: str, extra: list[str]) -> list[str]:
    """The ``runtime.evaluate`` command of a job's evaluation on this machine (unbuffered: its progress
    lines reach the console as they come)."""
    return [
        sys.executable,
        "-u",
        "-m",
        "runtime.evaluate",
        "--recipe",
        str(job_dir / RESOLVED_FILENAME),
        "--eval-recipe",
        recipe_file,
        "--checkpoint",
        checkpoint,
        *extra,
    ]


def eval_arguments(args: argparse.Namespace) -> list[str]:
    """The ``runtime.evaluate`` arguments after ``--checkpoint`` (eval sets, overrides)."""
    out: list[str] = []
    for name in args.eval_sets:
        out += ["--eval-set", name]
    for item in args.overrides:
        out += ["--set", item]
    if args.out is not None:
        out += ["--out", str(args.out.resolve())]
    return out


def main(argv: list[str], repo_root: Path) -> int:
    """Run or submit one evaluation; returns the exit code."""
    args = argument_parser().parse_args(argv)
    refuse_repeated_sets(args.overrides, "launcher eval")
    runs_dir = args.runs_dir or jobs.DEFAULT_RUNS_DIR
    record = jobs.find_record(args.job, runs_dir)
    job_dir = Path(record.job_dir)
    resolved = load_resolved(job_dir / RESOLVED_FILENAME)
    recipe_file = record.recipe_source
    if resolved.recipe.eval is None and not (repo_root / recipe_file).is_file():
        raise EvalLaunchError(
            f"job {record.job_id} was resolved without an eval: section and its recipe {recipe_file} is gone; fix: "
            "add an eval: section to the recipe (see recipes/tiny.yaml)"
        )
    # Everything the evaluation would refuse is refused here, before a process starts or a job is
    # submitted: the same checks, the same messages.
    settings = eval_settings(
        resolved.recipe.eval,
        str(repo_root / recipe_file),
        args.overrides,
        str(resolved.path),
        vocab_size=resolved.recipe.capture.vocab_size,
    )
    check_eval_set_names(settings, args.eval_sets, str(resolved.path))
    source = resolve_draft_source(args.checkpoint, resolved.checkpoint_dir())
    refuse_another_runs_draft(source, resolved.checkpoint_dir(), record.job_id, args.out is not None)
    refuse_another_runs_record(source, job_dir, args.out is not None)  # the evaluation notes a legacy draft
    if args.out is not None:
        output_place(args.out, "--out", fix="give a folder of its own for the results")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise EvalLaunchError(f"--out {args.out} is a file; the results go into a folder. Fix: give a folder's path")
    if args.local:
        command = local_eval_command(job_dir, recipe_file, args.checkpoint, eval_arguments(args))
        try:
            return run_attached(command, cwd=repo_root).returncode
        except ChildStopped as exc:
            print(
                f"[eval] stopped ({signal.Signals(exc.signum).name}): the evaluation child stopped with it "
                f"({exit_text(exc.returncode)}); its result files are written whole or not at all",
                file=sys.stderr,
                flush=True,
            )
            return 128 + exc.signum
    return _submit(resolved.recipe, recipe_file, job_dir, args, repo_root)


def _submit(recipe: Recipe, recipe_file: str, job_dir: Path, args: argparse.Namespace, repo_root: Path) -> int:
    extra = eval_arguments(args)
    slurm_id = submit_eval_job(recipe, recipe_file, job_dir, repo_root, args.checkpoint, extra)
    eval_dir = job_dir / "eval"
    print(f"submitted eval job {slurm_id} for {job_dir} (draft {args.checkpoint})")
    print(f"  follow: tail -f {shell_word(str(eval_dir / f'slurm-{slurm_id}.out'))}")
    print(f"  results: {eval_dir}/<draft>/results.json, summary.txt and decodes.jsonl (every decode)")
    return 0


def submit_eval_job(
    recipe: Recipe,
    recipe_file: str,
    job_dir: Path,
    repo_root: Path,
    checkpoint: str = "latest",
    extra_args: list[str] | None = None,
    after_job: str | None = None,
) -> str:
    """Submit the eval job of ``job_dir`` (its script written into ``<job>/eval/``); with ``after_job``
    it starts only once that job has completed (``--dependency=afterok``: a failed or cancelled
    training job cancels it). Returns its Slurm job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise EvalLaunchError(
            "sbatch is not on PATH, so no Slurm job can be submitted from here; fix: run this on a Slurm login node, "
            "or evaluate on this machine with --local"
        )
    extra = " ".join(extra_args or [])
    if recipe.eval is None:
        raise EvalLaunchError(
            f"job {job_dir} was resolved without an eval: section; the Slurm eval reads it from there. Fix: run with "
            "--local, or train again with a recipe that has one"
        )
    eval_dir = job_dir / "eval"
    eval_dir.mkdir(parents=True, exist_ok=True)
    script = eval_dir / f"{recipe.job.name}{EVAL_SCRIPT_SUFFIX}"
    atomic_write_text(script, render_eval_script(recipe, recipe_file))
    # The job's settings travel in sbatch's environment (--export=ALL), never inside --export=, which
    # splits at commas: a folder named "a,PATH=/x" must stay one value.
    exports = export_environment(
        {
            "DSPARK_REPO": str(repo_root),
            "DSPARK_JOB_DIR": str(job_dir),
            "DSPARK_EVAL_CHECKPOINT": checkpoint,
            "DSPARK_EVAL_ARGS": extra,
        }
    )
    command = [sbatch, "--parsable", "--export=ALL", f"--output={output_pattern(str(eval_dir))}/slurm-%j.out"]
    if after_job is not None:
        command.append(f"--dependency=afterok:{checked_job_id(after_job)}")
    command.append(str(script))
    done = subprocess.run(
        command, cwd=repo_root, capture_output=True, text=True, check=False, env={**os.environ, **exports}
    )
    if done.returncode != 0:
        raise EvalLaunchError(f"sbatch refused the eval job: {done.stderr.strip() or done.stdout.strip()}")
    # `--parsable` prints `ID` or `ID;CLUSTER`; some sites wrap sbatch and print "Submitted batch job ID".
    return done.stdout.strip().split(";")[0].split()[-1]
