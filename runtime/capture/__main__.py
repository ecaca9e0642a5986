"""``python3 -m runtime.capture --recipe RESOLVED``: the capture component (see runtime/capture/producer.py)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from runtime.user_errors import exit_without_package

try:  # a stock python3 instead of the venv's: one line, not a traceback
    from runtime.files import DiskFullError
    from runtime.native_log import route_native_output
    from runtime.recipe.loader import load_resolved
    from runtime.shared.contracts import ENV_PARENT_PID, ENV_RECIPE, ENV_TASK_RANK
    from runtime.shared.lifecycle import exit_when_orphaned
    from runtime.shared.refusal import report_refusal
except ModuleNotFoundError as _missing:
    exit_without_package(_missing, "runtime.capture")


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, read the resolved recipe, run the capture loop."""
    parser = argparse.ArgumentParser(prog="python3 -m runtime.capture", description=__doc__)
    parser.add_argument(
        "--recipe",
        default=os.environ.get(ENV_RECIPE),
        help="resolved recipe JSON written by the launcher (default: $DSPARK_RECIPE)",
    )
    from runtime.moe.selection import add_moe_exchange_argument, chosen_exchange

    add_moe_exchange_argument(parser)
    args = parser.parse_args(argv)
    if not args.recipe:
        parser.error("no resolved recipe: pass --recipe PATH or set DSPARK_RECIPE")
    route_native_output()
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s [%(name)s] %(message)s",
        stream=sys.stderr,
    )
    from runtime.capture.producer import run_capture
    from runtime.capture.setup import capture_setup

    resolved = load_resolved(args.recipe)
    exit_when_orphaned(int(os.environ.get(ENV_PARENT_PID) or 0), resolved.recipe.job.stop_grace_s)
    override = chosen_exchange(args, resolved.recipe.capture.moe_exchange) if args.k3_moe_exchange else None
    try:
        return run_capture(capture_setup(resolved), moe_exchange=override)
    except DiskFullError as exc:
        # what, where, how much and the fix, in one line: no traceback around it
        logging.getLogger("dspark.capture").error("the capture stops: %s", exc)
        return 1
    except expected_refusals() as exc:
        # Its message names the file or port and the fix: one line for the operator; the traceback
        # goes to a file beside the logs.
        return report_refusal(exc, resolved.job_dir, "capture", int(os.environ.get(ENV_TASK_RANK, "0")))


def expected_refusals() -> tuple[type[Exception], ...]:
    """The errors the capture raises on purpose, each with the reason and the fix in its message: a
    recipe or data file that is not what the recipe says, a row it cannot use, a master that cannot
    start (a taken port, no binary), a store it cannot join, an engine or SGLang patch it cannot use.
    Anything else is a bug and keeps its traceback on the console."""
    from runtime.capture.embedded_settings import EngineError
    from runtime.capture.engine_sglang import SGLangPatchError
    from runtime.capture.producer import DataError
    from runtime.recipe import RecipeError
    from runtime.recipe.streaming_budget import StreamingBudgetError
    from runtime.shared.chat_tokenize import ChatFormatError
    from runtime.shared.data_files import DataFileError
    from runtime.shared.sglang_patch_manifest import PatchError
    from runtime.transport.errors import MasterStartError, StoreSetupError

    return (
        RecipeError,
        DataFileError,
        DataError,
        ChatFormatError,
        MasterStartError,
        StoreSetupError,
        EngineError,
        SGLangPatchError,
        PatchError,
        StreamingBudgetError,
    )


if __name__ == "__main__":
    raise SystemExit(main())
