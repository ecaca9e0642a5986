"""Build a recipe's missing inputs before a submission (``data.prepare_commands``).

A new user's first command is ``python3 -m launcher tiny --local``: the tiny target and its data
do not exist yet on a fresh clone, and the recipe names the commands that make them. They run here,
on the submitting machine, with their progress lines on this terminal, and only while an input is
missing (the commands are idempotent, but importing torch alone costs seconds on a login node).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from launcher.component import ChildStopped, run_attached
from runtime.recipe import Recipe
from runtime.recipe.loader import resolve_recipe_path
from runtime.user_errors import UserError


class InputPreparationError(UserError):
    """A ``data.prepare_commands`` command failed; the message names it and its exit code."""


def missing_inputs(recipe: Recipe, repo_root: Path) -> list[Path]:
    """The recipe's input paths (target checkpoint, training data) that do not exist."""
    paths = [
        resolve_recipe_path(recipe.capture.target_path, repo_root),
        resolve_recipe_path(recipe.data.train_path, repo_root),
    ]
    return [p for p in paths if not p.exists()]


def prepare_missing_inputs(recipe: Recipe, repo_root: Path, source: str, log: Callable[..., None] = print) -> bool:
    """Run ``data.prepare_commands`` when an input is missing; returns whether anything ran.

    Nothing runs when every input exists or the recipe names no commands (the preflight checks then
    report what is missing, with its fix).
    """
    missing = missing_inputs(recipe, repo_root)
    commands = recipe.data.prepare_commands
    if not missing or not commands:
        return False
    names = ", ".join(_display(p, repo_root) for p in missing)
    log(f"[prepare] {names} missing: running the {len(commands)} data.prepare_commands of {source}", flush=True)
    for command in commands:
        started = time.monotonic()
        log(f"[prepare] $ {command}", flush=True)
        # Output goes straight to this terminal: the commands print their own progress lines.
        # The tools/* wrappers run under this interpreter (the venv the launcher runs in).
        env = {**os.environ, "DSPARK_PYTHON": sys.executable}
        try:  # the command (and what it starts) lives no longer than the launcher
            done = run_attached(["bash", "-c", command], cwd=repo_root, env=env)
        except ChildStopped as exc:
            log(
                f"[prepare] stopped ({signal.Signals(exc.signum).name}) during `{command}`; it stopped with the "
                "launcher, and the next submission builds what is still missing",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(128 + exc.signum)
        if done.returncode != 0:
            raise InputPreparationError(
                f"data.prepare_commands of {source}: `{command}` failed with exit code {done.returncode}; "
                "fix: run it by hand from the repository root to see why, then submit again"
            )
        log(f"[prepare] done in {time.monotonic() - started:.0f} s: {command}", flush=True)
    return True


def _display(path: Path, repo_root: Path) -> str:
    try:
        return str(path.resolve().relative_to(repo_root.resolve()))
    except ValueError:
        return str(path)
