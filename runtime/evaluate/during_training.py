"""``python3 -m runtime.evaluate.during_training --recipe RESOLVED``: the greedy acceptance length of every
checkpoint of a run while it trains (``eval.checkpoint_prompts``), for the acceptance-over-steps plot.

One low-priority process beside a ``--local`` run: it loads the target and the first eval set once,
decodes the untrained draft first (step 0, while the trainer starts), then each complete checkpoint
the trainer writes, and appends one line per draft to ``<job>/eval/during_training.jsonl``
(:mod:`runtime.evaluate.checkpoint_acceptance`). The trainer never waits for it: a checkpoint that
``keep_last`` removes before it is read is skipped with a line. SIGTERM (the run has ended) makes it
decode the checkpoints already written, then exit.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from runtime.evaluate.checkpoint_acceptance import RunEnded, checkpoint_acceptance
from runtime.evaluate.eval_sets import EvalSetError
from runtime.evaluate.setup import eval_setup
from runtime.evaluate.target import TargetLoadError
from runtime.recipe import RecipeError, load_resolved
from runtime.shared.lifecycle import die_with_parent


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; exit 0 after SIGTERM, 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="python3 -m runtime.evaluate.during_training", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--recipe", required=True, help="the job's resolved recipe (recipe.resolved.json)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the launcher) ends")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    RunEnded.install()
    die_with_parent(signal.SIGKILL, args.parent_pid)
    os.nice(10)  # the trainer comes first on a shared machine
    try:
        resolved = load_resolved(args.recipe)
        if resolved.recipe.eval is None or resolved.recipe.eval.checkpoint_prompts == 0:
            print(
                "error: eval.checkpoint_prompts is 0 or the recipe has no eval: section; nothing to do", file=sys.stderr
            )
            return 2
        setup = eval_setup(resolved, resolved.recipe.eval)
        checkpoint_acceptance(setup, setup.eval.checkpoint_prompts)
    except (RecipeError, EvalSetError, TargetLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
