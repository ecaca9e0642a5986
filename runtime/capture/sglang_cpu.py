"""Serving the tiny target with the real patched SGLang server on a CPU machine (tests, CI, laptops).

``tools/bootstrap_sglang`` builds the capture venv; :func:`cpu_server_overrides` are the recipe
settings (``--set`` items) that turn ``recipes/tiny.yaml`` into ``capture.engine: sglang`` served on
the CPU by that venv. The flags are the ones measured to start SGLang 0.5.23 without a GPU
(``../shared/MEASURED.md``): CPU device, torch-native attention, no CUDA graphs, no warmup, and the
stub ``libcuda.so.1`` on the server's library path only.
"""

from __future__ import annotations

from pathlib import Path

CAPTURE_VENV = ".cache/sgl-venv"
"""The capture venv, relative to the repository (``tools/bootstrap_sglang``)."""
CAPTURE_VENV_PYTHON = f"{CAPTURE_VENV}/bin/python"
CPU_DRIVER_STUB_DIR = f"{CAPTURE_VENV}/cuda-stub"
"""Holds the stub ``libcuda.so.1`` (tools/sglang_cpu/libcuda_stub.c); CPU servers only."""
VENV_MARKER = ".dspark-sglang-env"


def capture_venv_ready(repo_root: Path) -> bool:
    """Whether ``tools/bootstrap_sglang`` finished building the capture venv under ``repo_root``."""
    return (repo_root / CAPTURE_VENV / VENV_MARKER).is_file() and (repo_root / CAPTURE_VENV_PYTHON).exists()


def cpu_server_overrides(port: int, *, dtype: str = "float32", health_timeout_s: float = 900.0) -> list[str]:
    """``--set`` items serving the recipe's target with the capture venv's SGLang on the CPU.

    ``dtype`` is the server's compute dtype (``--dtype``); float32 matches the tiny recipe's
    embedded engine (``capture.compute_dtype: float32``), so both engines compute the same thing.
    """
    return [
        "capture.engine=sglang",
        "capture.sglang.device=cpu",
        f"capture.sglang.python={CAPTURE_VENV_PYTHON}",
        f"capture.sglang.library_dirs=[{CPU_DRIVER_STUB_DIR}]",
        "capture.sglang.server_env.SGLANG_USE_CPU_ENGINE=1",
        f"capture.sglang.port={port}",
        "capture.sglang.tp_size=1",
        "capture.sglang.attention_backend=torch_native",
        "capture.sglang.moe_runner_backend=auto",
        "capture.sglang.mamba_radix_cache_strategy=auto",
        "capture.sglang.context_length=512",
        "capture.sglang.max_total_tokens=4096",
        f"capture.sglang.health_timeout_s={health_timeout_s:g}",
        "capture.sglang.health_poll_interval_s=1",
        "capture.sglang.request_timeout_s=300",
        "capture.sglang.retry_backoff_s=1",
        "capture.sglang.shutdown_timeout_s=20",
        f"capture.sglang.extra_args=[--dtype, {dtype}, --skip-server-warmup]",
    ]
