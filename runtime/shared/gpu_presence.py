"""Whether this machine shows a process an NVIDIA GPU, without loading torch (the launcher checks a
``--local`` run of a GPU recipe before it builds or starts anything)."""

from __future__ import annotations

import os
from pathlib import Path

from runtime.user_errors import UserError

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
"""One folder per GPU the NVIDIA driver drives."""


DEVICE_NODES = Path("/dev")
"""Where a container that does not show the driver's /proc folder still has ``nvidiaN`` device nodes."""


def visible_gpu_count() -> int:
    """GPUs the driver has, less those ``CUDA_VISIBLE_DEVICES`` hides (an empty value hides all)."""
    try:
        present = sum(1 for _ in NVIDIA_GPUS.iterdir())
    except OSError:
        present = sum(1 for node in DEVICE_NODES.glob("nvidia*") if node.name.removeprefix("nvidia").isdigit())
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return present
    chosen = [item for item in listed.split(",") if item.strip() and not item.strip().startswith("-")]
    return min(present, len(chosen))


def require_gpu(what: str) -> None:
    """Refuse, in one line, to run ``what`` on a machine that shows no NVIDIA GPU."""
    if visible_gpu_count() > 0:
        return
    hidden = " (CUDA_VISIBLE_DEVICES hides every GPU)" if os.environ.get("CUDA_VISIBLE_DEVICES") is not None else ""
    raise UserError(
        f"{what} needs one NVIDIA GPU, and this machine shows none{hidden}. Fix: run it on a machine with a CUDA GPU "
        "(a Slurm GPU node, or --local there), or run the CPU demo: python3 -m launcher tiny --local"
    )
