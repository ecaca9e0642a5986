"""``python3 -m runtime.trainer --recipe RESOLVED``: one DSpark trainer rank.

Reads only the resolved recipe and the launcher's environment contract (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, DSPARK_JOB_DIR), once, in :func:`runtime.trainer.setup.trainer_setup`.

Exit codes: 0 done; 143 stopped by SIGTERM after checkpointing at a step boundary; 1 failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from runtime.user_errors import exit_without_package

try:  # a stock python3 instead of the venv's: one line, not a traceback
    from runtime.files import DiskFullError
    from runtime.native_log import route_native_output
    from runtime.recipe import RecipeError, load_resolved
    from runtime.shared.contracts import ENV_PARENT_PID
    from runtime.shared.data_files import DataFileError
    from runtime.shared.lifecycle import exit_when_orphaned
    from runtime.shared.refusal import report_refusal
    from runtime.trainer.settings import TrainerSetupError
    from runtime.trainer.setup import trainer_setup
except ModuleNotFoundError as _missing:
    exit_without_package(_missing, "runtime.trainer")


def main(argv: list[str] | None = None) -> int:
    """Run one trainer rank; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python3 -m runtime.trainer", description=__doc__)
    parser.add_argument("--recipe", required=True, help="resolved recipe JSON written by the launcher")
    args = parser.parse_args(argv)
    route_native_output()
    resolved = load_resolved(args.recipe)
    exit_when_orphaned(int(os.environ.get(ENV_PARENT_PID) or 0), resolved.recipe.job.stop_grace_s)
    try:
        setup = trainer_setup(resolved)
    except TrainerSetupError as exc:
        return report_refusal(exc, resolved.job_dir, "trainer", int(os.environ.get("RANK", "0")))
    settings = setup.run
    # Our own loggers at INFO (the consumer's "waiting for sample g" lines, the producer's heartbeat
    # age); other libraries stay at WARNING.
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s %(levelname)s [rank {settings.rank} %(name)s] %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("dspark").setLevel(logging.INFO)

    from runtime.trainer.checkpoints import CheckpointError
    from runtime.trainer.frozen_vocab import TargetTensorError
    from runtime.trainer.loop import Trainer
    from runtime.trainer.metrics import MetricsSetupError

    trainer = Trainer(setup)
    try:
        return trainer.run()
    except DiskFullError as exc:
        # One line (what, where, how much, the fix); no traceback file: there is no room for one.
        print(f"[trainer rank {settings.rank}] error: {exc}", file=sys.stderr, flush=True)
        return 1
    except (
        CheckpointError,
        TargetTensorError,
        MetricsSetupError,
        TrainerSetupError,
        RecipeError,
        DataFileError,
    ) as exc:
        # A refusal the trainer expects (a corrupt or incompatible checkpoint, a missing target tensor,
        # a bad setting): its message names the file and the fix. The operator sees it once, as one
        # line; the traceback goes to a file beside the logs, for whoever debugs the trainer itself.
        return report_refusal(exc, settings.job_dir, "trainer", settings.rank)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    from runtime.trainer.distributed import exit_without_finalization

    # Everything is written and the process group is destroyed; failures took the normal path,
    # traceback included.
    exit_without_finalization(code)
