"""Shared pytest fixtures and the GPU skip rule (GPU tests skip cleanly and are counted)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Parallel runs (pytest-xdist, ``-n N``): worker gwK hands out loopback ports from its own range, below
# the kernel's ephemeral ports, so two workers never pick the same port for their masters and groups.
# A run without xdist takes the kernel's ephemeral ports (32768-60999), outside every worker's range,
# so a serial run beside a parallel one (the Slurm tests in .ci/run) does not clash either.
WORKER_PORT_BASE = 20000
WORKER_PORT_SPAN = 1500


def pytest_configure(config: pytest.Config) -> None:
    """Give this xdist worker its own loopback port range (free_port reads DSPARK_PORT_RANGE); probe
    jobs skip their site measurements unless a test asks for them (DSPARK_PROBE_MEASURE)."""
    from runtime.transport.loopback import ENV_PORT_RANGE

    # The probe's site measurements (a private Mooncake master, a disk write and read) add about 5 s
    # to every probe job on 2 busy cores; the tests that check them set DSPARK_PROBE_MEASURE=1.
    os.environ.setdefault("DSPARK_PROBE_MEASURE", "0")

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        index = int(worker[2:])
        low, span = _worker_port_range(index, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "8")))
        os.environ[ENV_PORT_RANGE] = f"{low}-{low + span - 1}"


def _worker_port_range(index: int, workers: int) -> tuple[int, int]:
    """First port and count of xdist worker ``index``'s range: a share of the suite's own
    ``DSPARK_PORT_RANGE`` when the caller gave one (two suites on one machine, each in its range, never
    collide), else :data:`WORKER_PORT_SPAN` ports from :data:`WORKER_PORT_BASE` per worker."""
    from runtime.transport.loopback import ENV_PORT_RANGE, port_range

    given = port_range()
    if given is not None:
        span = (given[1] - given[0] + 1) // max(1, workers)
        if span < 100:
            raise pytest.UsageError(
                f"{ENV_PORT_RANGE}={given[0]}-{given[1]} gives {workers} xdist workers {span} ports each; "
                "a worker needs at least 100. Fix: widen the range or run fewer workers (-n)"
            )
        return given[0] + index * span, span
    low = WORKER_PORT_BASE + index * WORKER_PORT_SPAN
    if low + WORKER_PORT_SPAN > 32768:
        raise pytest.UsageError(f"worker gw{index}: too many xdist workers for the port ranges (at most 8)")
    return low, WORKER_PORT_SPAN


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests without CUDA, with a reason that shows in the summary. Every ``slurm``
    test is also ``slow``. The Slurm tests share the one local cluster (one hetjob at a time, and the
    session fixture brings it up and down), so they run in one process, never spread over xdist workers:
    ``.ci/run`` runs ``-m slurm`` serially beside the parallel run of the other slow tests."""
    if any(item.get_closest_marker("gpu") for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 device machine)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)
    for item in items:
        if item.get_closest_marker("slurm"):
            # Every Slurm test waits on the scheduler for seconds to minutes: none is in the developer loop.
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def repo_root() -> Path:
    """The repository root."""
    return REPO_ROOT


from runtime.transport.loopback import free_port  # noqa: E402


@pytest.fixture
def port_factory():
    """Returns a function giving a fresh free loopback port on each call."""
    return free_port


@dataclass(frozen=True)
class LocalSlurmCluster:
    """The running tools/slurm_local cluster, as its ``status --json`` reports it."""

    state_dir: Path
    cluster_name: str
    partition: str
    node_names: tuple[str, ...]
    started_by_this_session: bool


SLURM_LOCAL = REPO_ROOT / "tools" / "slurm_local"
SLURM_LOCAL_UP_TIMEOUT_S = 300


def slurm_local_status() -> dict:
    """``tools/slurm_local status --json`` as a dict (exit code 0 running, 3 stopped, 1 partly running)."""
    import json
    import subprocess

    result = subprocess.run([str(SLURM_LOCAL), "status", "--json"], capture_output=True, text=True, timeout=60)
    if result.returncode not in (0, 1, 3):
        raise RuntimeError(f"tools/slurm_local status failed (exit {result.returncode}): {result.stderr}")
    return json.loads(result.stdout)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[LocalSlurmCluster]:
    """The real local Slurm cluster (tools/slurm_local), brought up once per session. A cluster that
    was already up is used as is and left up; one this session started is torn down at the end,
    unless DSPARK_SLURM_LOCAL_KEEP=1 (useful while several sessions share it). Skips unless root."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (tools/slurm_local up starts slurmd and munged)")
    status = slurm_local_status()
    started = False
    if not status["running"]:
        result = subprocess.run(
            [str(SLURM_LOCAL), "up"], capture_output=True, text=True, timeout=SLURM_LOCAL_UP_TIMEOUT_S
        )
        if result.returncode != 0:
            pytest.fail(f"tools/slurm_local up failed (exit {result.returncode}):\n{result.stderr}\n{result.stdout}")
        started = status["stopped"]
        status = slurm_local_status()
    yield LocalSlurmCluster(
        state_dir=Path(status["state_dir"]),
        cluster_name=status["cluster_name"],
        partition=status["partition"],
        node_names=tuple(node["name"] for node in status["nodes"]),
        started_by_this_session=started,
    )
    if started and os.environ.get("DSPARK_SLURM_LOCAL_KEEP") != "1":
        subprocess.run([str(SLURM_LOCAL), "down"], capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="session")
def tiny_assets() -> Path:
    """The tiny target and its prepared data (tools/make_tiny_target + tools/prepare_data, cached by
    content hash, so this is instant after the first build)."""
    import subprocess

    for command in (["tools/make_tiny_target"], ["tools/prepare_data", "--recipe", "tiny"]):
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            pytest.fail(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return REPO_ROOT / ".cache" / "tiny"


@pytest.fixture(scope="session")
def tiny_reference_run(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job folder of the uninterrupted 32-step ``launcher tiny --local`` run that the end-to-end tests
    compare against, made once per pytest run and shared by its xdist workers (tests/support/tiny_runs.py).
    Tests read it and never write into it."""
    from tests.support.tiny_runs import reference_run

    return reference_run(tmp_path_factory)


@pytest.fixture(scope="session")
def sglang_tiny_assets(request: pytest.FixtureRequest) -> Path:
    """The tiny target and its data: ``tiny_assets`` (built and cached by tools/make_tiny_target),
    or a folder of the same layout named by DSPARK_TINY_ASSETS_DIR (a prebuilt copy, e.g. while
    another process holds the shared cache's build lock)."""
    prebuilt = os.environ.get("DSPARK_TINY_ASSETS_DIR")
    return Path(prebuilt) if prebuilt else request.getfixturevalue("tiny_assets")


def copy_repository(destination: Path, share_cache: bool) -> Path:
    """A copy of the checkout's sources (no .git, .venv, runs/), so that a test's jobs never write into
    the user's runs/. ``share_cache`` links its .cache to the checkout's (the built tiny target);
    without it the copy starts like a fresh clone."""
    import shutil

    ignored = shutil.ignore_patterns(".git", ".venv", ".cache", "runs", "__pycache__", "*.egg-info", ".*_cache")
    shutil.copytree(REPO_ROOT, destination, ignore=ignored, symlinks=True)
    if share_cache:
        (destination / ".cache").symlink_to(REPO_ROOT / ".cache")
    return destination
