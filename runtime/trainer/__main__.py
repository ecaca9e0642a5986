"""``python3 -m runtime.trainer --recipe RESOLVED``: one DSpark trainer rank.

Reads only the resolved recipe and the launcher's environment contract (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, DSPARK_JOB_DIR).

Exit codes: 0 done; 143 stopped by SIGTERM after checkpointing at a step boundary; 1 failed.
"""

from __future__ import annotations

import argparse
import os
import sys

from runtime.native_log import route_native_output
from runtime.recipe import load_resolved
from runtime.trainer.settings import derive_settings


def main(argv: list[str] | None = None) -> int:
    """Run one trainer rank; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python3 -m runtime.trainer", description=__doc__)
    parser.add_argument("--recipe", required=True, help="resolved recipe JSON written by the launcher")
    args = parser.parse_args(argv)
    route_native_output()
    resolved = load_resolved(args.recipe)
    settings = derive_settings(resolved)

    from runtime.trainer.loop import Trainer

    trainer = Trainer(resolved, settings)
    try:
        return trainer.run()
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    # Everything is written and the process group is destroyed. Leave without interpreter
    # finalization: gloo worker threads can still hold tensors whose late destruction aborts
    # the process (SIGABRT, "terminate called without an active exception"), which would turn a
    # finished rank into a failed task. Failures take the normal path, traceback included.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
