"""``python3 -m runtime.evaluate --recipe RESOLVED [--checkpoint latest] [--eval-set NAME] [--set eval.k=v]``

Evaluates a draft of the job whose resolved recipe is given (``python3 -m launcher eval JOB`` runs
this). Writes ``<job>/eval/<draft>/results.json``, ``summary.txt`` and plots, and prints the summary.
The eval settings are the resolved recipe's ``eval:`` section, or, for a job resolved without one,
that of ``--eval-recipe`` (the job's recipe file as it is now), with ``--set`` applied.

Exit codes: 0 done; 2 bad input (one line naming the file, the field and the fix); 1 failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from pathlib import Path

from runtime.evaluate.eval_sets import EvalSetError
from runtime.evaluate.setup import eval_setup
from runtime.evaluate.sglang_route import SGLangRouteError
from runtime.evaluate.target import TargetLoadError
from runtime.files import atomic_write_text
from runtime.recipe import RecipeError, load_resolved
from runtime.recipe.eval_settings import check_eval_set_names, eval_settings
from runtime.shared.checkpoint_folders import DraftSourceError, refuse_another_runs_draft, resolve_draft_source
from runtime.shared.checkpoint_integrity import CheckpointIntegrityError, verify_whole
from runtime.shared.draft_provenance import refuse_another_runs_record, verify_export_whole
from runtime.shared.lifecycle import stop_signals_deferred
from runtime.trainer.checkpoints import CheckpointError
from runtime.user_errors import UserError, redact

RESULTS_FILE = "results.json"
SUMMARY_FILE = "summary.txt"


def main(argv: list[str] | None = None) -> int:
    """Run one evaluation; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python3 -m runtime.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True, help="the job's resolved recipe (recipe.resolved.json)")
    parser.add_argument("--checkpoint", default="latest", help="latest, step_N, untrained, or a draft folder")
    parser.add_argument(
        "--eval-set", dest="sets", action="append", default=None, help="only this eval set (repeatable)"
    )
    parser.add_argument("--eval-recipe", help="recipe file whose eval: section to use when the job has none")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="eval.KEY=VALUE")
    parser.add_argument("--out", type=Path, help="results folder (default: <job>/eval/<draft>)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s [%(name)s] %(message)s", stream=sys.stdout
    )
    try:
        resolved = load_resolved(args.recipe)
        settings = eval_settings(
            resolved.recipe.eval,
            args.eval_recipe,
            args.overrides,
            str(resolved.path),
            resolved.recipe.capture.vocab_size,
        )
        check_eval_set_names(settings, args.sets, str(resolved.path))
        setup = eval_setup(resolved, settings, args.sets)
        source = resolve_draft_source(args.checkpoint, setup.checkpoint_dir)
        refuse_another_runs_draft(source, setup.checkpoint_dir, str(setup.job_dir), args.out is not None)
        refuse_another_runs_record(source, setup.job_dir, args.out is not None, note=print)  # copied in
        if source.kind == "checkpoint" and source.path is not None:  # trusted only whole
            verify_whole(source.path, "eval", note=print)
        elif source.kind == "export" and source.path is not None:
            verify_export_whole(source.path, note=print)
        from runtime.evaluate.runner import evaluate, evaluate_with_sglang

        out_dir = args.out or setup.job_dir / "eval" / source.label
        if setup.eval.route == "sglang":
            out_dir.mkdir(parents=True, exist_ok=True)
            results, decodes = evaluate_with_sglang(setup, source, out_dir)
        else:
            results, decodes = evaluate(setup, source)
    except (
        RecipeError,
        DraftSourceError,
        EvalSetError,
        TargetLoadError,
        CheckpointError,
        FileNotFoundError,
        SGLangRouteError,
        CheckpointIntegrityError,
        UserError,
    ) as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C): no results were written", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        return 1
    with stop_signals_deferred():  # a stop now comes after every file: the results are whole, or none is new
        _write_results(results, decodes, out_dir, setup.job_dir / "eval" if args.out is None else out_dir)
    return 0


def _write_results(results: dict, decodes: list[dict], out_dir: Path, eval_root: Path) -> None:
    """decodes.jsonl, results.json, summary.txt and the plots of one evaluation."""
    from runtime.evaluate.decodes import write_decodes
    from runtime.evaluate.report import results_table

    out_dir.mkdir(parents=True, exist_ok=True)
    write_decodes(decodes, out_dir)
    atomic_write_text(out_dir / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    summary = results_table(results)
    atomic_write_text(out_dir / SUMMARY_FILE, summary + "\n")
    print(summary)
    print(f"\nresults: {out_dir / RESULTS_FILE}; every decode, replayable: {out_dir / 'decodes.jsonl'}")
    from runtime.evaluate.plots import draw_eval_plots

    # A results folder of the operator's choosing keeps every plot inside it (the job folder is not touched).
    for line in draw_eval_plots(out_dir, eval_root):
        print(line)


if __name__ == "__main__":
    sys.exit(main())
