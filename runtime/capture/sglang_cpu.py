"""Serving the tiny target with the real patched SGLang server on a CPU machine (tests, CI, laptops).

``tools/bootstrap_sglang`` builds the capture venv; :func:`cpu_server_overrides` are the recipe
settings (``--set`` items) that turn ``recipes/tiny.yaml`` into ``capture.engine: sglang`` served on
the CPU by that venv. The flags are the ones measured to start SGLang 0.5.23 without a GPU
(found by starting it on a 2-core CPU machine): CPU device, torch-native attention, no CUDA graphs, no warmup, and the
stub ``libcuda.so.1`` on the server's library path only.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from runtime.capture.engine_sglang import SGLangEngine
from runtime.capture.setup import sglang_server_settings
from runtime.recipe.loader import ResolvedRecipe
from runtime.transport.endpoints import Endpoints
from runtime.transport.producer import Producer

CAPTURE_VENV = ".cache/sgl-venv"
"""The capture venv, relative to the repository (``tools/bootstrap_sglang``)."""
CAPTURE_VENV_PYTHON = f"{CAPTURE_VENV}/bin/python"
CPU_DRIVER_STUB_DIR = f"{CAPTURE_VENV}/cuda-stub"
"""Holds the stub ``libcuda.so.1`` (tools/sglang_cpu/libcuda_stub.c); CPU servers only."""
VENV_MARKER = ".dspark-sglang-env"


def capture_venv_ready(repo_root: Path) -> bool:
    """Whether ``tools/bootstrap_sglang`` finished building the capture venv under ``repo_root``."""
    return (repo_root / CAPTURE_VENV / VENV_MARKER).is_file() and (repo_root / CAPTURE_VENV_PYTHON).exists()


def tiny_asset_overrides(assets_dir: Path) -> list[str]:
    """``--set`` items pointing the tiny recipe at a tiny target + data folder (``.cache/tiny`` layout:
    ``target/``, ``data/train.jsonl``, ``data/chat.jsonl``) other than its default."""
    return [
        f"capture.target_path={assets_dir / 'target'}",
        f"data.train_path={assets_dir / 'data' / 'train.jsonl'}",
        f"data.chat_path={assets_dir / 'data' / 'chat.jsonl'}",
    ]


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
        # On the CPU the "device memory" is the host's: weights + a 4096-token KV pool are a few MB.
        "capture.sglang.mem_fraction_static=0.95",
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


@dataclass
class CpuServer:
    """A running CPU server with its store: what :func:`serve_on_cpu` yields."""

    resolved: ResolvedRecipe
    engine: SGLangEngine
    endpoints: Endpoints
    producer: Producer
    """The capture side's producer: it mounts the global segment the server's sink writes into."""
    env: dict[str, str]
    """The component environment the server was started with (Mooncake endpoints on loopback)."""
    start_s: float
    """Seconds from launching the server to healthy (and the sink check passed)."""


@contextlib.contextmanager
def serve_on_cpu(
    job_dir: Path,
    ports: tuple[int, int, int],
    server_port: int,
    overrides: list[str] | None = None,
    recipe_path: Path | None = None,
) -> Iterator[CpuServer]:
    """The tiny recipe (or ``recipe_path``) served by the real patched server on the CPU: a
    ``mooncake_master`` on loopback (``ports``: RPC, metadata, metrics), the producer mounting the
    segment, and the server launched by :class:`SGLangEngine` exactly as the capture component
    launches it. Everything is stopped on exit."""
    from runtime.capture.sglang_sink import close_sinks
    from runtime.transport.dataplane import open_producer
    from runtime.transport.loopback import (
        loopback_endpoints,
        loopback_env,
        loopback_master,
        loopback_recipe,
        transport_of,
    )

    resolved = loopback_recipe(job_dir, ports, [*cpu_server_overrides(server_port), *(overrides or [])], recipe_path)
    env = {**os.environ, **loopback_env(resolved)}
    mooncake_env = {k: v for k, v in env.items() if k.startswith("MC_")}
    saved = {k: os.environ.get(k) for k in mooncake_env}
    os.environ.update(mooncake_env)  # this process's Mooncake clients bind to loopback too
    endpoints = loopback_endpoints(resolved)
    try:
        with (
            loopback_master(resolved),
            open_producer(transport_of(resolved), resolved.job_dir, endpoints=endpoints, start_cursor=0) as producer,
        ):
            engine = SGLangEngine(sglang_server_settings(resolved), env=env)
            started = time.monotonic()
            try:
                engine.start()
                yield CpuServer(resolved, engine, endpoints, producer, env, time.monotonic() - started)
            finally:
                engine.close()
    finally:
        close_sinks()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
