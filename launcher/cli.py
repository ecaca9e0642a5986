"""Command line of the launcher.

    python3 -m launcher RECIPE [--dry-run] [--plan] [--local] [--smoke] [--probe] [--resume JOB | --fork JOB] [--set k=v ...]
    python3 -m launcher --resume JOB [--local] [--set k=v ...]   (the same run, with the job's own recipe)
    python3 -m launcher status JOB
    python3 -m launcher logs JOB [--component capture|trainer] [--rank N] [--follow]
    python3 -m launcher cancel JOB
    python3 -m launcher gate JOB              (the smoke gate's table for a --smoke job)
    python3 -m launcher plots JOB             (plots/ of a job's metrics: losses, per-slot accuracy, tau, ...)
    python3 -m launcher eval JOB [--checkpoint latest|step_N|untrained|DIR] [--local] [--eval-set NAME] [--set eval.k=v]
    python3 -m launcher render [RECIPE ...] [--check]
    python3 -m launcher resolve RECIPE --job-dir DIR [--slurm-job-id ID] [--smoke] [--set k=v ...]

RECIPE is a name in recipes/ (``tiny``) or a path. JOB is a job id, a job folder, or ``latest``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

from launcher import after_training, control, eval_job, gate, jobs
from launcher.environment import COMPONENTS
from launcher.inputs import prepare_missing_inputs
from launcher.plan import make_plan
from launcher.plots import plot_metrics
from launcher.render import (
    RenderOptions,
    environment_references,
    job_time_limit_min,
    render_script,
    sbatch_path,
    shell_word,
)
from launcher.resume_point import RESUME_FROM, choose_resume_point
from launcher.slurm_state import SLURM_FIX
from runtime.files import atomic_write_text, exclusive_lock
from runtime.recipe import LoadedRecipe, RecipeError, continuity, load_recipe, load_resolved, write_resolved
from runtime.recipe.loader import (
    RESOLVED_FILENAME,
    ResolvedRecipe,
    find_recipe_file,
    load_document,
    refuse_repeated_sets,
)
from runtime.recipe.site_facts import read_site_facts
from runtime.shared.contracts import probe_again_command, resume_command
from runtime.user_errors import UserError, output_place, redact, run_command

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPES_DIR = REPO_ROOT / "recipes"
SUBCOMMANDS = ("status", "logs", "cancel", "gate", "plots", "eval", "render", "resolve")


ACTIVE_JOB_STATES = {"PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "SUSPENDED", "RESIZING", "ORPHANED"}
"""States of a job that is still going (or whose tasks still run): it is not continued while in one."""


class LaunchError(UserError):
    """A refusal to submit, with the reason and the fix in its message."""


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def load(recipe: str, overrides: list[str], smoke: bool) -> LoadedRecipe:
    """Find and load a recipe by name or path."""
    path = find_recipe_file(recipe, RECIPES_DIR)
    return load_recipe(path, overrides=overrides, smoke=smoke, display_name=_display_path(path))


def _add_recipe_arguments(parser: argparse.ArgumentParser, optional: bool = False) -> None:
    parser.add_argument(
        "recipe",
        nargs="?" if optional else None,
        help="recipe name in recipes/ (e.g. tiny) or a path to a YAML file"
        + (" (with --resume JOB or --fork JOB: the job's own recipe when left out)" if optional else ""),
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any recipe field, e.g. --set trainer.optimizer.lr=1e-4 (repeatable)",
    )
    parser.add_argument("--smoke", action="store_true", help="apply the recipe's smoke overlay")


def _submit_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m launcher",
        description="Submit a DSpark recipe as one heterogeneous Slurm job (capture + trainer).",
        epilog="Other commands: status JOB | logs JOB | cancel JOB | gate JOB | plots JOB | eval JOB | render [RECIPE...] | "
        "resolve RECIPE",
    )
    _add_recipe_arguments(parser, optional=True)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the exact script and command; submit nothing")
    mode.add_argument("--plan", action="store_true", help="print the resource and throughput plan and exit")
    parser.add_argument(
        "--site-facts",
        type=Path,
        metavar="FILE",
        help="with --plan: the site facts a --probe job measured (its site_facts/ folder or a facts_*.json) in place "
        "of the recipe's assumptions",
    )
    mode.add_argument("--local", action="store_true", help="run both components on this machine, loopback only")
    parser.add_argument(
        "--probe",
        action="store_true",
        help="run the environment-contract probe in each component instead of the runtime",
    )
    parser.add_argument("--allow-blockers", action="store_true", help="submit even though the plan reports blockers")
    parser.add_argument(
        "--resume",
        metavar="JOB",
        help="continue that job (id, folder, or 'latest') as the same run from its newest checkpoint, with its own "
        "recipe; a RECIPE or --set may change only what does not change results (RUNBOOK section 8)",
    )
    parser.add_argument(
        "--fork",
        metavar="JOB",
        help="continue from that job's newest checkpoint as a NEW run, with changes allowed (the new job records "
        "JOB as its parent)",
    )
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="with --smoke on Slurm: submit and return; `gate JOB` prints the gate later",
    )
    return parser


ENVIRONMENT_FIX = "export each with its site path (see RUNBOOK.md, 'Site settings') and submit again"


def _environment_gaps(loaded: LoadedRecipe, probe: bool = False) -> list[str]:
    """One line per ``${NAME}`` the recipe reads that is unset or empty here (an empty one turns
    ``${K3_DATA_DIR}/rows.jsonl`` into ``/rows.jsonl``), naming the fields that use it; for a probe
    job only those of the fields it reads (:data:`launcher.render.PROBE_READS`)."""
    references = environment_references(loaded.recipe, probe)
    unset = {name: fields for name, fields in references.items() if name not in os.environ}
    empty = {name: fields for name, fields in references.items() if os.environ.get(name) == ""}
    return [
        f"${{{name}}} is {'not set' if name in unset else 'set but empty'} (used by {', '.join(sorted(set(fields)))})"
        for name, fields in sorted({**unset, **empty}.items())
    ]


def _environment_heading(loaded: LoadedRecipe) -> str:
    return f"recipe {loaded.source} reads environment variables that have no value here:"


def _check_environment_references(loaded: LoadedRecipe, probe: bool = False) -> None:
    """Every ``${NAME}`` the recipe reads (a probe: those it needs) is set, and not empty: refuse to
    submit otherwise."""
    gaps = _environment_gaps(loaded, probe)
    if gaps:
        raise LaunchError(
            _environment_heading(loaded) + "".join(f"\n  - {gap}" for gap in gaps) + f"\n  fix: {ENVIRONMENT_FIX}"
        )


def _refuse_on_preflight_failure(loaded: LoadedRecipe, allow_blockers: bool) -> None:
    """A normal submission runs the gate's first three checks and refuses on a failure."""
    for check in gate.preflight_checks(loaded, REPO_ROOT, allow_blockers):
        if check.status == gate.FAIL:
            raise LaunchError(f"{check.name} check failed for {loaded.source}: {check.detail}\n  fix: {check.fix}")


def _runs_dir(loaded: LoadedRecipe) -> Path:
    return jobs.runs_root(REPO_ROOT, loaded.recipe.job.runs_dir)


def _record_for(
    loaded: LoadedRecipe, job_dir: Path, job_id: str, mode: str, probe: bool, parent: dict[str, str] | None = None
) -> jobs.JobRecord:
    return jobs.JobRecord(
        job_id=job_id,
        mode=mode,
        name=loaded.recipe.job.name,
        job_dir=str(job_dir),
        recipe_source=loaded.source,
        recipe_digest=loaded.digest,
        smoke=loaded.smoke,
        probe=probe,
        components=jobs.components_of(loaded),
        one_node=loaded.recipe.job.layout == "one_node",
        parent=parent,
    )


def _job_runs_dir(args: argparse.Namespace) -> Path:
    """The runs folder to look the ``--resume``/``--fork`` job up in: the recipe's (with --set), or without a
    recipe the ``--set job.runs_dir=`` given, else ``runs/``."""
    if args.recipe:
        return _runs_dir(load(args.recipe, args.overrides, args.smoke))
    runs_dir = "runs"
    for item in args.overrides:
        key, _, value = item.partition("=")
        if key.strip() == "job.runs_dir":
            runs_dir = value.strip()
    return jobs.runs_root(REPO_ROOT, runs_dir)


def _overrides_without(overrides: list[str], keys: set[str]) -> list[str]:
    """``--set`` items whose key is not in ``keys``."""
    return [o for o in overrides if o.split("=", 1)[0].strip() not in keys]


def _override_value(overrides: list[str], key: str) -> str | None:
    """The value the last ``--set KEY=...`` gives, or None."""
    found = None
    for item in overrides:
        name, _, value = item.partition("=")
        if name.strip() == key:
            found = value.strip()
    return found


def _edited_recipe_note(previous: ResolvedRecipe, record: jobs.JobRecord) -> str:
    """For ``--resume JOB``/``--fork JOB`` without a recipe: the fields in which the job's recipe file, as it
    reads now (with the job's own --set), differs from what the job ran with; '' when none or unreadable."""
    try:
        path = find_recipe_file(previous.source, RECIPES_DIR)
        kept = _overrides_without(previous.overrides, set(continuity.SET_BY_THE_LAUNCHER))
        now = load_recipe(path, overrides=kept, smoke=previous.smoke, display_name=_display_path(path))
    except (OSError, UserError, ValueError):
        return ""
    changed = continuity.changes(previous.recipe, now.recipe)
    if not changed:
        return ""
    return (
        f"note: {previous.source} has changed since job {record.job_id} ran ({'; '.join(c.describe() for c in changed)}); "
        "this continues with the job's own recipe, as it ran. To take the file's changes: `python3 -m launcher "
        f"{shell_word(previous.source)} --resume {record.command_ref}` (refused where they change the results) or "
        f"`... --fork {record.command_ref}` (a new run)"
    )


def continue_job(args: argparse.Namespace) -> tuple[LoadedRecipe, dict[str, str]]:
    """``--resume JOB`` (the same run, continued) or ``--fork JOB`` (a new run from its checkpoint).

    The job's own resolved recipe (its --set overrides included) is the base. A recipe named now is
    read with the job's --set overrides first (its ports, its length) and the new ones after them; it and
    any --set may, for a resume, change only what :mod:`runtime.recipe.continuity` lists as safe (and
    the run's length where the schedule's past does not depend on it); anything else is refused before
    anything starts, listing each field ``old -> new``. A fork takes any change. The checkpoint is
    chosen and checked whole here (:mod:`launcher.resume_point`): ``--set trainer.checkpoint.resume_from``
    is honoured, a damaged newest one is skipped. Returns the recipe to run and the new job's ``parent``
    record."""
    fork = bool(args.fork)
    job = args.fork or args.resume
    flag = "--fork" if fork else "--resume"
    record = jobs.find_record(job, _job_runs_dir(args), runs_dir_hint="--set job.runs_dir=FOLDER")
    job_dir = Path(record.job_dir)
    if record.probe:
        again = probe_again_command(job_dir, record.recipe_source, local=record.mode == "local")
        raise LaunchError(
            f"job {record.job_id} ({_display_path(job_dir)}) was a --probe job: it measured the site and trained "
            f"nothing, so there is no run to {flag.removeprefix('--')}. Fix: run the probe again, `{again}`"
        )
    report = control.job_report(record)
    state = report.state
    # A job sacct no longer lists (purged from its records, another cluster's) reads PENDING: not running.
    if state in ACTIVE_JOB_STATES and not report.unlisted:  # its keep_last rotation may delete our checkpoint
        raise LaunchError(
            f"job {record.job_id} ({_display_path(job_dir)}) is still {state}: a {flag.removeprefix('--')} now would "
            "start from a checkpoint its own rotation (trainer.checkpoint.keep_last) may delete, and a resume would "
            f"run the same steps twice. Nothing was started. Fix: wait for it (`python3 -m launcher status "
            f"{record.command_ref}`) or stop it (`python3 -m launcher cancel {record.command_ref}`), then again"
        )
    previous = load_resolved(job_dir / RESOLVED_FILENAME)
    chosen = _override_value(args.overrides, RESUME_FROM)
    if _override_value(args.overrides, "trainer.checkpoint.init_from") not in (None, "null"):
        raise LaunchError(
            f"{flag} continues from a checkpoint of job {record.job_id}; trainer.checkpoint.init_from (a weights-only "
            "warm start) starts a new run instead. Fix: `python3 -m launcher RECIPE --set "
            "trainer.checkpoint.init_from=PATH` for a new run, or leave it out"
        )
    requested = _overrides_without(args.overrides, set(continuity.SET_BY_THE_LAUNCHER))
    kept = _overrides_without(previous.overrides, set(continuity.SET_BY_THE_LAUNCHER))
    # The job's own --set first, the new ones after: a resume that names the recipe keeps the run's ports and
    # length. A fork that names a recipe is a new run of that recipe with the --set given now.
    given_now = {o.split("=", 1)[0].strip() for o in requested}
    base = _overrides_without(kept, given_now) + requested
    if args.recipe:
        named = requested if fork else base
        candidate = load(args.recipe, named, args.smoke)
        source, overrides, smoke = candidate.source, named, candidate.smoke
    else:
        candidate = load_document(
            previous.recipe.model_dump(mode="json"),
            f"job {record.job_id}'s recipe ({_display_path(previous.path)})",
            requested,
        )
        source, overrides, smoke = previous.source, base, previous.smoke
        note = _edited_recipe_note(previous, record)
        if note:
            print(note)
    if not fork:
        refused, why = continuity.refused_changes(previous.recipe, candidate.recipe)
        if refused:
            raise LaunchError(
                f"cannot resume job {record.job_id} ({_display_path(job_dir)}) as the same run: {candidate.source} "
                f"changes what its results depend on: {'; '.join(c.describe() for c in refused)}"
                + (f" (the run's length may change only where the past steps stay the same: {why})" if why else "")
                + f". Fix: `{resume_command(job_dir, local=record.mode == 'local')}` continues with the job's own recipe "
                "(changes to where and how long it runs are allowed: RUNBOOK section 8); to change the rest, continue "
                f"as a new run from its checkpoint: `python3 -m launcher RECIPE --fork {record.command_ref} --set ...`"
            )
    started = previous.recipe.trainer.checkpoint
    point = choose_resume_point(previous.checkpoint_dir(job_dir), started, chosen, f"job {record.job_id}")
    checkpoint = point.checkpoint
    if checkpoint is None and fork:
        raise LaunchError(
            f"job {record.job_id} ({record.job_dir}) has no complete checkpoint to {flag.removeprefix('--')} from; "
            "fix: fork a job that reached trainer.checkpoint.every_steps, or start afresh with the recipe"
        )
    for line in point.notes:
        print(f"note: {line}")
    for line in point.skipped:
        print(f"skipped {line}")
    changed = continuity.changes(previous.recipe, candidate.recipe)
    if checkpoint is None:  # the same run, from its own start: nothing of it was kept
        start = started.resume_from or started.init_from
        print(
            f"job {record.job_id} has no complete checkpoint: running the same run again from its start "
            f"({f'the checkpoint it started from, {start}' if start else 'step 0'})"
        )
    else:
        verb = "forking a new run from" if fork else "resuming from"
        how = (
            " (checked whole; named by --set trainer.checkpoint.resume_from)"
            if point.chosen_by_operator
            else (" (checked whole)")
        )
        print(f"{verb} {_display_path(checkpoint)} (job {record.job_id}){how}")
    if changed:
        print(f"  changed from job {record.job_id}: {'; '.join(c.describe() for c in changed)}")
    at_checkpoint = (
        [
            f"trainer.checkpoint.resume_from={started.resume_from or 'null'}",
            f"trainer.checkpoint.init_from={started.init_from or 'null'}",
        ]
        if checkpoint is None
        else [f"trainer.checkpoint.resume_from={checkpoint}", "trainer.checkpoint.init_from=null"]
    )
    loaded = load_document(candidate.recipe.model_dump(mode="json"), candidate.source, at_checkpoint, smoke=False)
    loaded.source, loaded.overrides, loaded.smoke = source, overrides + at_checkpoint, smoke
    parent = {
        "kind": "fork" if fork else "resume",
        "job_id": record.job_id,
        "job_dir": str(job_dir),
        "checkpoint": str(checkpoint) if checkpoint else "none (the run again from its start)",
    }
    return loaded, parent


def submit(args: argparse.Namespace) -> int:
    """Default command: plan, dry-run, smoke gate, local run or Slurm submission of a recipe."""
    if args.resume is not None and not args.resume.strip():
        raise LaunchError("--resume is empty; fix: give a job id, a job folder or latest (--resume latest)")
    refuse_repeated_sets(args.overrides, args.recipe or "the command line")
    parent: dict[str, str] | None = None
    if args.resume and args.fork:
        raise LaunchError(
            "--resume and --fork exclude each other: --resume JOB continues that run, --fork JOB starts a "
            "new run from its checkpoint; fix: give one of them"
        )
    if args.resume or args.fork:
        loaded, parent = continue_job(args)
    elif not args.recipe:
        raise LaunchError(
            "no recipe given; fix: python3 -m launcher RECIPE [...] (a name in recipes/ or a YAML path), "
            "or python3 -m launcher --resume JOB to continue a job"
        )
    else:
        loaded = load(args.recipe, args.overrides, args.smoke)
    if args.no_wait and not loaded.smoke:
        raise LaunchError("--no-wait goes with --smoke on Slurm (the other submissions never wait); fix: leave it out")
    if args.site_facts and not args.plan:
        raise LaunchError("--site-facts goes with --plan: python3 -m launcher RECIPE --plan --site-facts FILE")
    if args.plan:
        facts = read_site_facts(args.site_facts) if args.site_facts else None
        if facts is not None and args.recipe and not parent:  # measured facts in place of the recipe's assumptions
            try:  # the operator's own --set lines come after the facts and win
                loaded = load(args.recipe, facts.overrides() + args.overrides, args.smoke)
            except RecipeError as exc:
                raise LaunchError(
                    f"{exc}\n  (the --set plan.* values named above are the probe's measurements, from "
                    f"{', '.join(facts.sources)})"
                ) from None
        print(make_plan(loaded.recipe, facts).render())
        return 0
    if args.dry_run:
        planned = jobs.runs_root(REPO_ROOT, loaded.recipe.job.runs_dir) / loaded.recipe.job.name / "<stamp>"
        options = RenderOptions(
            recipe_file=loaded.source,
            job_dir=str(planned),
            smoke=loaded.smoke,
            probe=args.probe,
            repo_dir=str(REPO_ROOT),
        )
        print(render_script(loaded.recipe, options), end="")
        print(f"# command: sbatch {shell_word(str(planned / 'submission.sh'))}   (dry run: nothing was submitted)")
        settings = loaded.recipe.eval
        if settings is not None and settings.after_training and not args.probe and not loaded.smoke:
            print(f"# ---- eval.after_training: the eval job, submitted with the training job ({planned}/eval/) ----")
            print(eval_job.render_eval_script(loaded.recipe, loaded.source), end="")
            eval_script = planned / "eval" / f"{loaded.recipe.job.name}{eval_job.EVAL_SCRIPT_SUFFIX}"
            print(
                "# command: sbatch --dependency=afterok:<training job id> "
                f"{shell_word(f'--export=ALL,DSPARK_JOB_DIR={planned}')} {shell_word(str(eval_script))}"
                "   (dry run: nothing was submitted)"
            )
        for finding in [] if args.probe else make_plan(loaded.recipe).blockers:  # the probe plans nothing
            print(f"# plan blocker: {finding.message}")
        gaps = _environment_gaps(loaded, args.probe)
        if gaps:  # a real submission refuses on these: the dry run says so too
            print(f"# not submittable here: {_environment_heading(loaded)}")
            for gap in gaps:
                print(f"#   - {gap}")
            print(f"#   fix: {ENVIRONMENT_FIX}")
        return 0
    _check_environment_references(loaded, args.probe)
    if args.local:
        if not args.probe:
            _refuse_a_gpu_recipe_without_a_gpu(loaded)
        loaded = _ports_from_the_range(loaded)
        _refuse_taken_local_ports(loaded)
    if not args.probe:  # the probe reads neither the target nor the data: their checks are the smoke gate's
        prepare_missing_inputs(loaded.recipe, REPO_ROOT, loaded.source)
    if loaded.smoke:
        return run_smoke_gate(loaded, args, parent)
    if not args.probe:
        _refuse_on_preflight_failure(loaded, args.allow_blockers)
    job_dir = jobs.new_job_dir(REPO_ROOT, loaded)
    if args.local:
        return run_local(loaded, job_dir, args.probe, parent)
    submit_slurm(loaded, job_dir, args.probe, parent)
    return 0


def run_smoke_gate(loaded: LoadedRecipe, args: argparse.Namespace, parent: dict[str, str] | None = None) -> int:
    """``--smoke``: checks 1-3 here, then the smoke job (local, or Slurm and wait), then checks 4-8."""
    job_dir = jobs.new_job_dir(REPO_ROOT, loaded)
    preflight = gate.preflight_checks(loaded, REPO_ROOT, args.allow_blockers)
    failed = any(c.status == gate.FAIL for c in preflight)
    rows = gate.settle(preflight, pending=not failed)
    gate.write_gate(job_dir, rows, None, loaded.source, loaded.digest)
    print(f"smoke gate for {loaded.source}: folder {_display_path(job_dir)}", flush=True)
    if failed:
        print(gate.render(rows))
        return 1
    if args.local:
        run_local(loaded, job_dir, args.probe, parent)
        record = jobs.find_record(str(job_dir), _runs_dir(loaded))
    else:
        record = submit_slurm(loaded, job_dir, args.probe, parent)
        if args.no_wait:
            print(f"not waiting: python3 -m launcher gate {record.command_ref} prints the gate once the job ended")
            return 0
        _wait_for_job(record)
    return _finish_gate(record)


def _wait_for_job(record: jobs.JobRecord, report_every_s: float = 30.0, poll_s: float = 5.0) -> str:
    """Wait until the Slurm job ends, with a progress line every ``report_every_s``."""
    started = time.monotonic()
    last_report = 0.0
    while True:
        report = control.job_report(record)
        if report.state in control.TERMINAL_JOB_STATES:
            return report.state
        now = time.monotonic()
        if now - last_report >= report_every_s:
            states = ", ".join(c.describe() for c in report.components)
            print(
                f"[gate] waiting for job {record.job_id} ({states}); {now - started:.0f} s so far; Ctrl-C stops "
                f"waiting (the job keeps running: python3 -m launcher gate {record.command_ref})",
                flush=True,
            )
            last_report = now
        time.sleep(poll_s)


def _finish_gate(record: jobs.JobRecord) -> int:
    job_dir = Path(record.job_dir)
    running = control.job_report(record).state not in control.TERMINAL_JOB_STATES
    rows = gate.settle(gate.read_preflight(job_dir) + gate.job_checks(job_dir), pending=running)
    path = gate.write_gate(job_dir, rows, record.job_id, record.recipe_source, record.recipe_digest)
    print(gate.render(rows))
    print(f"  gate record: {_display_path(path)}")
    return 0 if gate.passed(rows) else 1


def _refuse_running_local_jobs(loaded: LoadedRecipe) -> None:
    """A ``--local`` job still running on this machine with a port of this recipe: refuse, naming it.

    Its ports are not all bound at every moment (the Mooncake master binds a few seconds after the
    start, the trainer's rendezvous port later still), so the bind check alone lets a second run in
    during the first one's start, and the two then fight over the ports: the second's failure took
    the first one's trainer down."""
    from runtime.recipe.checks import job_ports

    mine = job_ports(loaded.recipe)
    for record in control.running_local_jobs(_runs_dir(loaded)):
        try:
            theirs = job_ports(load_resolved(Path(record.job_dir) / RESOLVED_FILENAME).recipe)
        except (OSError, ValueError, RecipeError):
            theirs = mine  # its recipe cannot be read: assume the worst
        shared = sorted(f"{field} {port}" for field, port in mine.items() if port in theirs.values())
        if shared:
            raise LaunchError(
                f"job {record.job_id} ({_display_path(Path(record.job_dir))}) is running on this machine with "
                f"port(s) this run needs: {', '.join(shared)}. Nothing was started. Wait for it "
                f"(`python3 -m launcher status {record.command_ref}`), stop it (`python3 -m launcher cancel "
                f"{record.command_ref}`), or give this run other ports, e.g. --set "
                + " --set ".join(f"{item.split()[0]}=PORT" for item in shared)
            )


def _refuse_a_gpu_recipe_without_a_gpu(loaded: LoadedRecipe) -> None:
    """A ``--local`` run whose recipe puts a component on ``cuda`` needs a GPU on this machine: one line
    before anything is built or started (its target build would otherwise fail minutes in)."""
    from runtime.shared.gpu_presence import require_gpu

    recipe = loaded.recipe
    on_cuda = [
        field
        for field, device in (
            ("capture.device", recipe.capture.device),
            ("trainer.device", recipe.trainer.device),
            ("eval.device", recipe.eval.device if recipe.eval is not None else None),
        )
        if device == "cuda"
    ]
    if on_cuda:
        require_gpu(f"{loaded.source} --local ({', '.join(on_cuda)}: cuda)")


def _ports_from_the_range(loaded: LoadedRecipe) -> LoadedRecipe:
    """``--local`` with ``DSPARK_PORT_RANGE=LOW-HIGH`` set: every port of the job that no ``--set`` names
    comes from that range, free when taken (recorded as ``--set`` in the job's recipe, so a resume keeps
    them). Two users' runs, or two test suites, each with its own range, never share a port."""
    from runtime.recipe.checks import job_ports
    from runtime.transport.loopback import ENV_PORT_RANGE, free_port

    if not os.environ.get(ENV_PORT_RANGE):
        return loaded
    given = {item.split("=", 1)[0].strip() for item in loaded.overrides}
    moved = [f"{field}={free_port()}" for field in job_ports(loaded.recipe) if field not in given]
    if not moved:
        return loaded
    again = load_document(loaded.recipe.model_dump(mode="json"), loaded.source, moved, smoke=False)
    again.source, again.overrides, again.smoke = loaded.source, [*loaded.overrides, *moved], loaded.smoke
    print(f"[local] ports from {ENV_PORT_RANGE}={os.environ[ENV_PORT_RANGE]}: {', '.join(moved)}", flush=True)
    return again


def _refuse_taken_local_ports(loaded: LoadedRecipe) -> None:
    """With --local every port of the job is bound on this machine: refuse before anything starts (no
    job folder, no process) when one is taken, instead of failing inside the running job."""
    import socket

    from runtime.recipe.checks import job_ports

    _refuse_running_local_jobs(loaded)
    taken = []
    for field, port in job_ports(loaded.recipe).items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # A listener holds the port; a closed connection's TIME_WAIT (the previous run's) does not.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError as exc:
                taken.append(f"{field} {port} ({exc.strerror or exc})")
    if taken:
        raise LaunchError(
            f"{loaded.source}: port(s) in use on this machine: {'; '.join(taken)}. Nothing was started. Another "
            "--local job may hold them (`python3 -m launcher status latest`; `python3 -m launcher cancel JOB` stops "
            "it); or give this run free ports, e.g. --set " + " --set ".join(f"{t.split()[0]}=PORT" for t in taken)
        )


def run_local(loaded: LoadedRecipe, job_dir: Path, probe: bool, parent: dict[str, str] | None = None) -> int:
    """Run both components on this machine and print where the results are."""
    from launcher.local import LocalRun
    from runtime.recipe import load_resolved

    resolved_path = write_resolved(loaded, job_dir, REPO_ROOT)
    job_id = f"local-{job_dir.name}"
    record = _record_for(loaded, job_dir, job_id, "local", probe, parent)
    record.supervisor_pid = os.getpid()
    # Checked again, and the record written, under one lock: two runs started in the same second
    # both passed the first check (before either had a record); the second to get here is refused.
    with exclusive_lock(_runs_dir(loaded) / jobs.INDEX_DIRNAME / ".local-start.lock"):
        try:
            _refuse_running_local_jobs(loaded)
        except LaunchError:
            shutil.rmtree(job_dir, ignore_errors=True)  # made a moment ago; nothing ran in it
            raise
        jobs.write_record(record, _runs_dir(loaded))
    print(f"[local] job {job_id}: folder {_display_path(job_dir)}", flush=True)
    resolved = load_resolved(resolved_path)
    settings = None if probe else resolved.recipe.eval
    watch = after_training.start_checkpoint_watch(resolved, job_dir, REPO_ROOT) if settings else None
    try:
        with exclusive_lock(job_dir / control.SUPERVISOR_LOCK):  # names this folder's supervisor (cancel)
            code = LocalRun(resolved, record, probe).run()
    finally:
        after_training.finish_checkpoint_watch(watch, job_dir / "logs" / after_training.WATCH_LOG)
    report = control.job_report(record)
    print(report.render())
    _plot_metrics(job_dir)
    _print_outputs(job_dir)
    if code == 0 and report.state == "COMPLETED" and settings is not None and settings.after_training:
        code = _evaluate_after_training(loaded, job_dir)
    return code


def _evaluate_after_training(loaded: LoadedRecipe, job_dir: Path) -> int:
    """``eval.after_training`` of a completed ``--local`` run: evaluate the final draft, end with its table."""
    code = after_training.evaluate_after_training(job_dir, loaded.source, REPO_ROOT)
    results_path = after_training.newest_results(job_dir)
    results = after_training.read_results(results_path) if results_path and code == 0 else None
    if results is None:
        print(
            f"[local] the evaluation after training failed (exit {code}); the run itself completed. Log: "
            f"{_display_path(job_dir / 'logs' / after_training.AFTER_TRAINING_LOG)}; again: python3 -m launcher eval "
            f"{_display_path(job_dir)} --local"
        )
        return code or 1
    assert results_path is not None
    print("\n".join(after_training.headline(results, results_path, _display_path)))
    return 0


def _plot_metrics(job_dir: Path) -> None:
    """Plots of the run's metrics into ``plots/`` (tools/compare_runs with one run)."""
    ok, message = plot_metrics(job_dir, REPO_ROOT)
    if not ok and (job_dir / "metrics.jsonl").exists():
        print(f"  ({message})")


def _print_outputs(job_dir: Path) -> None:
    outputs = [
        ("checkpoints", job_dir / "checkpoints"),
        ("metrics", job_dir / "metrics.jsonl"),
        ("plots", job_dir / "plots"),
        ("logs", job_dir / "logs"),
    ]
    for label, path in outputs:
        if path.exists():
            print(f"  {label:<12} {_display_path(path)}")


def submit_slurm(
    loaded: LoadedRecipe, job_dir: Path, probe: bool, parent: dict[str, str] | None = None
) -> jobs.JobRecord:
    """Submit the hetjob through submitit and record it."""
    from launcher.hetjob import ComponentJob, HetJobExecutor

    write_resolved(loaded, job_dir, REPO_ROOT)
    options = RenderOptions(
        recipe_file=loaded.source, job_dir=str(job_dir), smoke=loaded.smoke, probe=probe, repo_dir=str(REPO_ROOT)
    )
    script = render_script(loaded.recipe, options)
    components = jobs.components_of(loaded)
    executor = HetJobExecutor(
        job_dir,
        script,
        trainer_world_size=components["trainer"],
        capture_tasks=components["capture"],
        time_limit_min=job_time_limit_min(loaded.recipe, probe),
        max_requeues=loaded.recipe.job.max_requeues,
    )
    job = executor.submit(ComponentJob(str(job_dir), probe=probe))
    atomic_write_text(job_dir / "submission.sh", script)
    record = _record_for(loaded, job_dir, str(job.job_id), "slurm", probe, parent)
    jobs.write_record(record, _runs_dir(loaded))
    shape = "one node" if loaded.recipe.job.layout == "one_node" else "hetjob"
    print(f"submitted job {job.job_id} ({loaded.recipe.job.name}): capture + trainer {shape}")
    settings = loaded.recipe.eval
    if settings is not None and settings.after_training and not probe and not loaded.smoke:
        record.eval_job_id = eval_job.submit_eval_job(
            loaded.recipe, loaded.source, job_dir, REPO_ROOT, after_job=str(job.job_id)
        )
        jobs.write_record(record, _runs_dir(loaded))
        print(
            f"submitted eval job {record.eval_job_id} (eval.after_training): it evaluates the final draft once job "
            f"{job.job_id} has completed (--dependency=afterok; Slurm cancels it if the training job fails)"
        )
    print(f"  folder  {_display_path(job_dir)}")
    print(f"  status  python3 -m launcher status {record.command_ref}")
    print(f"  logs    python3 -m launcher logs {record.command_ref} --follow")
    print(f"  cancel  python3 -m launcher cancel {record.command_ref}")
    return record


def _recorded_digest(path: Path) -> str:
    """The digest a job folder's ``recipe.resolved.json`` records (without loading the recipe in it)."""
    try:
        digest = json.loads(path.read_text())["digest"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LaunchError(
            f"{_display_path(path)} exists but is not a readable resolved recipe ({exc}); a job folder's recorded "
            "recipe is never rewritten; fix: give a new --job-dir"
        ) from None
    return str(digest)


def _resolve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m launcher resolve")
    _add_recipe_arguments(parser)
    parser.add_argument("--job-dir", required=True, type=Path)
    parser.add_argument("--slurm-job-id", help="inside a manual sbatch: also write the job payload and record")
    return parser


def resolve(argv: list[str]) -> int:
    """``resolve``: write the resolved recipe (and, inside a manual sbatch, the job payload)."""
    args = _resolve_parser().parse_args(argv)
    if args.slurm_job_id is not None and not re.fullmatch(r"[0-9]+(?:_[0-9]+)?", args.slurm_job_id):
        raise LaunchError(
            f"--slurm-job-id {args.slurm_job_id!r} is not a Slurm job id (digits, or 123_4 for an array task); "
            'nothing was written. Fix: pass --slurm-job-id "$SLURM_JOB_ID"'
        )
    refuse_repeated_sets(args.overrides, args.recipe)
    loaded = load(args.recipe, args.overrides, args.smoke)
    job_dir = output_place(args.job_dir, "--job-dir", fix="give the job's own folder, e.g. runs/NAME/STAMP")
    # One resolve at a time per folder: two at once both found no record and both wrote one.
    with exclusive_lock(job_dir / ".resolve.lock"):
        return _resolve_into(loaded, job_dir, args.slurm_job_id)


def _resolve_into(loaded: LoadedRecipe, job_dir: Path, slurm_job_id: str | None) -> int:
    """``resolve``'s work, under the folder's lock."""
    from launcher.hetjob import SUBMITIT_DIRNAME, TASK_LAYOUT_FILENAME, ComponentJob, write_submission

    path = job_dir / RESOLVED_FILENAME
    if path.exists():
        # A job folder's recorded recipe is what its runtime read: never rewrite it. The same recipe
        # again (a requeued manual sbatch job resolves at every start) keeps the file as it is.
        recorded = _recorded_digest(path)
        if recorded != loaded.digest:
            raise LaunchError(
                f"{_display_path(path)} already records a recipe (digest {recorded[:12]}), and {loaded.source} "
                f"with these overrides is another (digest {loaded.digest[:12]}): a job folder's recorded recipe is "
                "never rewritten; fix: give a new --job-dir"
            )
        print(f"resolved {loaded.source}: {_display_path(path)} already records it (digest {loaded.digest[:12]}), kept")
    else:
        path = write_resolved(loaded, job_dir, REPO_ROOT)
        print(f"resolved {loaded.source} -> {path} (digest {loaded.digest[:12]})")
    if slurm_job_id:
        components = jobs.components_of(loaded)
        (job_dir / SUBMITIT_DIRNAME).mkdir(parents=True, exist_ok=True)
        layout = f'{{"trainer_world_size": {components["trainer"]}, "capture_tasks": {components["capture"]}}}\n'
        atomic_write_text(job_dir / SUBMITIT_DIRNAME / TASK_LAYOUT_FILENAME, layout)
        write_submission(
            job_dir,
            slurm_job_id,
            ComponentJob(str(job_dir)),
            loaded.recipe.job.time_limit_min,
            loaded.recipe.job.max_requeues,
        )
        record = _record_for(loaded, job_dir, slurm_job_id, "slurm", probe=False)
        jobs.write_record(record, _runs_dir(loaded))
        if loaded.smoke:
            return _manual_smoke_preflight(loaded, job_dir, slurm_job_id)
    return 0


def _manual_smoke_preflight(loaded: LoadedRecipe, job_dir: Path, slurm_job_id: str) -> int:
    """A smoke job submitted by hand (``DSPARK_RESOLVE_ARGS="--smoke" sbatch ...``) runs the gate's
    checks 1-3 here, in the allocation, as ``--smoke`` runs them on the login node, and records them in
    ``gate.json`` (``launcher gate JOB`` reads them); a failure ends the job before its components start.
    A requeued job keeps the rows its first start recorded."""
    recorded = gate.read_preflight(job_dir)
    if recorded and all(c.status != gate.FAIL for c in recorded) and len(recorded) == len(gate.PREFLIGHT):
        return 0
    preflight = gate.preflight_checks(loaded, REPO_ROOT)
    failed = any(c.status == gate.FAIL for c in preflight)
    rows = gate.settle(preflight, pending=not failed)
    gate.write_gate(job_dir, rows, slurm_job_id, loaded.source, loaded.digest)
    print(gate.render(rows), flush=True)
    if failed:
        print(f"smoke gate: a check before the job failed; the components do not start (gate.json in {job_dir})")
        return 1
    return 0


def _render_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m launcher render")
    parser.add_argument("recipes", nargs="*", help="recipe names or paths (default: every recipe in recipes/)")
    parser.add_argument("--check", action="store_true", help="fail if a checked-in script differs")
    parser.add_argument("--stdout", action="store_true", help="print instead of writing")
    parser.add_argument(
        "--out",
        type=Path,
        help="folder to write the scripts into (default: sbatch/ for a recipe in recipes/, else the recipe's own "
        "folder)",
    )
    return parser


def render(argv: list[str]) -> int:
    """``render``: write (or with --check, compare) sbatch/<name>.sbatch for recipes."""
    args = _render_parser().parse_args(argv)
    if args.stdout and (args.check or args.out is not None):
        raise LaunchError("--stdout prints the scripts; it goes with neither --check nor --out. Fix: give one of them")
    names = args.recipes or sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    stale = []
    for name in names:
        loaded = load(name, [], False)
        _refuse_shared_script_name(find_recipe_file(name, RECIPES_DIR), loaded)
        scripts = [
            (
                sbatch_path(REPO_ROOT, loaded.recipe),
                render_script(loaded.recipe, RenderOptions(recipe_file=loaded.source)),
            )
        ]
        if loaded.recipe.eval is not None:
            scripts.append(
                (
                    eval_job.eval_sbatch_path(REPO_ROOT, loaded.recipe),
                    eval_job.render_eval_script(loaded.recipe, loaded.source),
                )
            )
        scripts = _render_targets(find_recipe_file(name, RECIPES_DIR), scripts, args.out)
        for target, text in scripts:
            if args.stdout:
                print(text, end="")
            elif args.check:
                if not target.exists() or target.read_text() != text:
                    stale.append(_display_path(target))
            else:
                target.parent.mkdir(exist_ok=True)
                atomic_write_text(target, text)
                print(f"wrote {_display_path(target)}")
    if stale:
        again = " ".join(["python3 -m launcher render", *(shell_word(n) for n in args.recipes)])
        if args.out is not None:
            again += f" --out {shell_word(str(args.out))}"
        print(f"out of date: {', '.join(stale)}; run `{again}`", file=sys.stderr)
        return 1
    return 0


def _refuse_shared_script_name(recipe_path: Path, loaded: LoadedRecipe) -> None:
    """A recipe of recipes/ renders to sbatch/<job.name>.sbatch: two recipes there with one job.name would
    write each other's scripts. Refused, naming both, before anything is written."""
    if recipe_path.resolve().parent != RECIPES_DIR.resolve():
        return
    for other in sorted(RECIPES_DIR.glob("*.yaml")):
        if other.resolve() == recipe_path.resolve():
            continue
        try:
            name = load(str(other), [], False).recipe.job.name
        except (UserError, OSError):
            continue  # a broken neighbour is its own render's refusal
        if name == loaded.recipe.job.name:
            raise LaunchError(
                f"{_display_path(recipe_path)} and {_display_path(other)} both have job.name {name!r}, so both would "
                f"render to sbatch/{name}.sbatch and overwrite each other's script; nothing was written. Fix: give "
                f"{_display_path(recipe_path)} a job.name of its own"
            )


def _render_targets(recipe_path: Path, scripts: list[tuple[Path, str]], out: Path | None) -> list[tuple[Path, str]]:
    """Where ``render`` writes a recipe's scripts: sbatch/ (the checked-in scripts) only for a recipe
    in recipes/; a recipe elsewhere gets them next to itself, named after its file
    (``my.yaml`` -> ``my.sbatch``, ``my.eval.sbatch``); ``--out DIR`` puts them in DIR."""
    in_repository = recipe_path.resolve().parent == RECIPES_DIR.resolve()
    if in_repository and out is None:
        return scripts
    folder = out.expanduser().resolve() if out is not None else recipe_path.resolve().parent
    if not in_repository and folder == (REPO_ROOT / "sbatch").resolve():
        raise LaunchError(
            f"{recipe_path} is not a recipe of {_display_path(RECIPES_DIR)}/, and sbatch/ holds the scripts of those "
            "only (a golden test keeps them equal); nothing was written. Fix: --out another folder, or copy the "
            "recipe into recipes/"
        )
    if out is not None:
        folder = output_place(out, "--out")
    stem = recipe_path.stem if not in_repository else None
    targets = []
    for target, text in scripts:
        suffix = eval_job.EVAL_SCRIPT_SUFFIX if target.name.endswith(eval_job.EVAL_SCRIPT_SUFFIX) else ".sbatch"
        base = stem or target.name[: -len(suffix)]
        targets.append((folder / f"{base}{suffix}", text))
    return targets


def _job_parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python3 -m launcher {command}")
    parser.add_argument("job", help="job id, job folder, or 'latest' (the most recent submission)")
    parser.add_argument(
        "--runs-dir",
        type=Path,
        default=jobs.DEFAULT_RUNS_DIR,
        help="runs folder holding jobs/<id> links (default: runs/ in the repository)",
    )
    if command == "logs":
        parser.add_argument("--component", choices=COMPONENTS)
        parser.add_argument("--rank", type=int)
        parser.add_argument("--follow", action="store_true", help="keep printing until the job ends")
    return parser


def job_command(command: str, argv: list[str]) -> int:
    """``status`` / ``logs`` / ``cancel`` / ``gate`` / ``plots``."""
    args = _job_parser(command).parse_args(argv)
    record = jobs.find_record(args.job, args.runs_dir)
    if command == "status":
        report = control.job_report(record)
        if report.slurm_unreachable:
            print(
                f"error: cannot tell the state of job {record.job_id}: {report.note}\n  {SLURM_FIX}",
                file=sys.stderr,
            )
            return 3
        print(report.render())
        return 1 if report.failed else 0
    if command == "cancel":
        try:
            print(control.cancel_job(record))
        except control.CancelError as exc:
            print(f"error: {redact(str(exc))}", file=sys.stderr)
            return 1
        return 0
    if command == "gate":
        if not record.smoke:
            # A healthy full run has no gate records; judging it would print a FAIL and write a
            # failed gate.json into its folder.
            raise LaunchError(
                f"job {record.job_id} ({_display_path(Path(record.job_dir))}) was not a --smoke job: the smoke "
                f"gate judges only those; nothing was written. Fix: use `python3 -m launcher status {record.command_ref}` "
                f"for this job, or run the gate with `python3 -m launcher {shell_word(record.recipe_source)} --smoke`"
            )
        return _finish_gate(record)
    if command == "plots":
        ok, message = plot_metrics(Path(record.job_dir), REPO_ROOT)
        print(message if ok else f"error: {message}", file=sys.stdout if ok else sys.stderr)
        if ok:
            for png in sorted((Path(record.job_dir) / "plots").glob("*.png")):
                print(f"  {_display_path(png)}")
        return 0 if ok else 1
    if not control.log_files(record, args.component, args.rank):
        tasks = ", ".join(f"{name} ranks 0..{count - 1}" for name, count in record.components.items())
        raise LaunchError(
            f"job {record.job_id} has no task {args.component or 'of any component'} rank {args.rank}: it has {tasks}; "
            "fix: pick one of those (--component capture|trainer, --rank N)"
        )
    control.print_logs(record, args.component, args.rank, args.follow)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for bad input, with one clear message: see runtime.user_errors)."""
    return run_command(_dispatch, argv)


def command_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser that reads ``python3 -m launcher ARGV``, and the arguments it reads (without the
    subcommand): for checking a documented command line without running it."""
    if argv and argv[0] in SUBCOMMANDS:
        command, rest = argv[0], argv[1:]
        named = {"render": _render_parser, "resolve": _resolve_parser, "eval": eval_job.argument_parser}
        return (named[command]() if command in named else _job_parser(command)), rest
    return _submit_parser(), argv


def _dispatch(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        command, rest = argv[0], argv[1:]
        if command == "render":
            return render(rest)
        if command == "resolve":
            return resolve(rest)
        if command == "eval":
            return eval_job.main(rest, REPO_ROOT)
        return job_command(command, rest)
    _refuse_misspelt_command(argv)
    return submit(_submit_parser().parse_args(argv))


def _refuse_misspelt_command(argv: list[str]) -> None:
    """``stauts latest``: a word close to a command that names no recipe is a typo of the command,
    not a recipe called ``stauts`` followed by a stray argument."""
    import difflib

    if not argv or argv[0].startswith("-"):
        return
    word = argv[0]
    close = difflib.get_close_matches(word, SUBCOMMANDS, n=1, cutoff=0.7)
    is_recipe = (RECIPES_DIR / f"{word}.yaml").is_file() or Path(word).is_file()
    if close and not is_recipe:
        raise LaunchError(
            f"'{word}' is neither a command nor a recipe in {_display_path(RECIPES_DIR)}/; fix: did you mean "
            f"`python3 -m launcher {close[0]} {' '.join(shell_word(a) for a in argv[1:])}`? Commands: {', '.join(SUBCOMMANDS)}"
        )
