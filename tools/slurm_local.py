"""``python3 -m tools.slurm_local up|down|status``: the real local Slurm cluster used by the tests."""

from __future__ import annotations

import sys

from tools.slurm_local_impl.cli import main

if __name__ == "__main__":
    sys.exit(main())
