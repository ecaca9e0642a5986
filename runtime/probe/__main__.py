"""``python3 -m runtime.probe --recipe RESOLVED --component NAME``: check the environment contract.

A probe job has the shape of the real job but runs this instead of the runtime. Each task records
what it received into ``{job_dir}/probe/{component}_{rank}.json``, and the probe exercises the
contract for real:
- trainer ranks form a gloo process group from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT and
  all-reduce their ranks;
- the capture task listens on its bind address at the Mooncake master RPC port, and trainer rank 0
  dials the endpoint it was handed (``DSPARK_MOONCAKE_MASTER``), proving it routes;
- rank 0 of each component measures the site facts the plan rests on (``runtime/probe/measure.py``)
  and writes them to ``{job_dir}/site_facts/facts_{component}.json``, saying what it skipped and why:
  each node's host memory, the most ``--mem`` Slurm and the node allow and its GPUs; the capture
  node's aggregate pinned host-to-device rate with all GPUs copying at once, and a Mooncake put/get
  over loopback (before it listens: the trainer's end stops it); the trainer node's
  feature-cache disk's cold read rate and the link: after the
  route check the capture serves a few objects from a master at the recipe's ports, and trainer rank
  0 reads them across the two nodes (``runtime/probe/link.py``).
  ``python3 -m launcher RECIPE --plan --site-facts {job_dir}/site_facts`` puts them in place of the
  recipe's assumptions. ``DSPARK_PROBE_MEASURE_BYTES`` sets the bytes copied, read and put;
  ``DSPARK_PROBE_MEASURE=0`` skips the measurements (the test suite does, but for the tests of them).

Set ``DSPARK_PROBE_FAIL=<component>`` (through the recipe's ``job.env``) to make that component exit
with code 3 after recording, which is how tests check that a failed component is reported. Set
``DSPARK_PROBE_STOP_DELAY_S=N`` to make a task take N seconds to leave after SIGTERM (it records
when the signal came and when it left, under ``probe/stops/``), or
``DSPARK_PROBE_HOLD_S=N`` to keep every task alive N seconds after recording on a job's first run
(not after a requeue), which is how tests signal, cancel or requeue a running job.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.user_errors import UserError, exit_without_package, run_command

try:  # a stock python3 instead of the venv's: one line, not a traceback
    from runtime.files import atomic_write_text
    from runtime.native_log import route_native_output
    from runtime.probe import link as probe_link
    from runtime.probe import measure as probe_measure
    from runtime.recipe import load_resolved
    from runtime.recipe.fit.slurm_request import probe_measure_bytes
    from runtime.recipe.site_facts import SITE_FACTS_DIRNAME
    from runtime.shared import contracts
    from runtime.transport.settings import TransportSettings
except ModuleNotFoundError as _missing:
    exit_without_package(_missing, "runtime.probe")

CONTRACT_VARIABLES = (
    *contracts.CONTRACT_ENV_NAMES,
    *contracts.TRAINER_ENV_NAMES,
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "SLURMD_NODENAME",
    "SLURM_JOB_NODELIST_HET_GROUP_0",
    "SLURM_JOB_NODELIST_HET_GROUP_1",
    "CUDA_VISIBLE_DEVICES",
    contracts.ENV_REQUEUE_COUNT,
    "SLURM_RESTART_COUNT",
)
CONNECT_TIMEOUT_S = 120.0
FAIL_EXIT_CODE = 3


def _record(job_dir: Path, component: str, rank: int, extra: dict[str, Any]) -> Path:
    out_dir = job_dir / "probe"
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "component": component,
        "rank": rank,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "env": {name: os.environ[name] for name in CONTRACT_VARIABLES if name in os.environ},
        **extra,
    }
    target = out_dir / f"{component}_{rank}.json"
    atomic_write_text(target, json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return target


def _capture_listen(bind_address: str, port: int, timeout_s: float) -> str:
    """Accept one connection from trainer rank 0 and return what it sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((bind_address, port))
        server.listen(1)
        server.settimeout(timeout_s)
        print(f"[probe capture] listening on {bind_address}:{port} for trainer rank 0", flush=True)
        connection, peer = server.accept()
        with connection:
            connection.settimeout(timeout_s)
            message = connection.recv(1024).decode()
            connection.sendall(b"capture-ok")
            # Trainer rank 0 closes first, so the port is free at once for the link measurement's
            # master (the side that closes first holds the connection in TIME_WAIT).
            connection.recv(1)
        print(f"[probe capture] trainer rank 0 reached us from {peer[0]}: {message!r}", flush=True)
        return message


def _trainer_dial(endpoint: str, timeout_s: float) -> str:
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=5) as connection:
                connection.sendall(b"trainer-ok")
                return connection.recv(1024).decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _trainer_all_reduce() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=120))
    try:
        value = torch.tensor([dist.get_rank()], dtype=torch.int64)
        dist.all_reduce(value)
        return {"all_reduce_sum": int(value.item()), "dist_rank": dist.get_rank(), "dist_world": dist.get_world_size()}
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class ProbeSetup:
    """What the probe takes from the resolved recipe, read once by :func:`probe_setup`."""

    job_dir: Path
    transport: TransportSettings
    measure_bytes: int
    """Bytes each measurement moves."""
    cache_dir: Path | None
    """The trainer's feature-cache folder when the cache is on (its disk is measured), its ``${VAR}``
    expanded from this node's environment."""
    cache_dir_unset: str
    """Why the cache folder cannot be measured although the cache is on (a variable this node lacks);
    empty otherwise."""


def probe_setup(resolved: Any) -> ProbeSetup:
    """The probe's settings from the resolved recipe (``DSPARK_JOB_DIR`` and
    ``DSPARK_PROBE_MEASURE_BYTES`` win over it)."""
    recipe = resolved.recipe
    cache = recipe.trainer.feature_cache
    cache_dir = resolved.resolve_path(cache.dir) if cache.enabled and cache.dir else None
    unset = ""
    if cache_dir is not None and "$" in str(cache_dir):  # never a folder literally named ${K3_...}
        unset = (
            f"trainer.feature_cache.dir {cache.dir!r} names an environment variable this node does not have; "
            "export it before submitting (the launcher refuses a probe without it)"
        )
        cache_dir = None
    return ProbeSetup(
        job_dir=Path(os.environ.get(contracts.ENV_JOB_DIR, resolved.job_dir)),
        transport=TransportSettings.from_recipe(recipe),
        # probe_measure_bytes, unless DSPARK_PROBE_MEASURE_BYTES says otherwise
        measure_bytes=int(os.environ.get("DSPARK_PROBE_MEASURE_BYTES", probe_measure_bytes(recipe))),
        cache_dir=cache_dir,
        cache_dir_unset=unset,
    )


def _measure_site_facts(component: str, setup: ProbeSetup) -> Path:
    """Measure this node's site facts and write ``site_facts/facts_{component}.json``; returns its path."""
    size, job_dir = setup.measure_bytes, setup.job_dir
    measured: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}

    def attempt(name: str, measure: Any) -> None:
        try:
            value, how = measure()
        except probe_measure.Skipped as exc:
            skipped[name] = str(exc)
        except Exception as exc:  # a measurement that breaks must not fail the probe: say so
            skipped[name] = f"failed: {type(exc).__name__}: {exc}"
        else:
            measured[name] = {"value": value, "how": how}

    attempt(f"{component}_host_memory_available_bytes", probe_measure.host_memory_available_bytes)
    attempt(f"{component}_node_mem_cap_gib", probe_measure.node_memory_cap_gib)
    attempt(f"{component}_gpus_per_node", probe_measure.gpus_per_node)
    if component == "capture":
        attempt("h2d_gbps_per_gpu", lambda: probe_measure.h2d_gbps_per_gpu(size))
        attempt("store_put_gbps", lambda: _put_rate(size, job_dir / "logs"))
    else:
        cache_dir = setup.cache_dir
        if cache_dir is not None:
            attempt("cache_read_gbps", lambda: probe_measure.cold_read_gbps(cache_dir, size))
        elif setup.cache_dir_unset:
            skipped["cache_read_gbps"] = setup.cache_dir_unset
        else:
            skipped["cache_read_gbps"] = "trainer.feature_cache is off: measured the job folder's disk instead"
            attempt("job_dir_read_gbps", lambda: probe_measure.cold_read_gbps(job_dir / SITE_FACTS_DIRNAME, size))
        attempt(
            "link_get_gbps",
            lambda: probe_link.link_get_gbps(setup.transport, os.environ, size, CONNECT_TIMEOUT_S),
        )
    payload = {
        "component": component,
        "host": socket.gethostname(),
        "time": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "measured": measured,
        "skipped": skipped,
    }
    target = job_dir / SITE_FACTS_DIRNAME / f"facts_{component}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, json.dumps(payload, indent=2, sort_keys=True) + "\n")
    for name, fact in measured.items():
        print(f"[probe {component}/0] measured {name}: {fact['how']}", flush=True)
    for name, why in skipped.items():
        print(f"[probe {component}/0] skipped {name}: {why}", flush=True)
    return target


def _serve_link(setup: ProbeSetup, bind_address: str) -> str:
    """Capture rank 0's side of the link measurement (trainer rank 0 reads); never fails the probe."""
    try:
        served = probe_link.serve_link_objects(
            setup.transport, bind_address, setup.measure_bytes, setup.job_dir / "logs", CONNECT_TIMEOUT_S
        )
    except Exception as exc:  # the trainer's facts then say the link measurement failed
        served = f"failed: {type(exc).__name__}: {exc}"
    print(f"[probe capture/0] link measurement: {served}", flush=True)
    return served


def _put_rate(size: int, log_dir: Path) -> tuple[float, str]:
    put_gbps, _, how = probe_measure.store_put_get_gbps(size, log_dir)
    return put_gbps, how


def _leave_completed(signum: int, frame: object) -> None:
    """SIGTERM after the capture recorded its probe: leave with 0 (``with`` blocks close, the link
    measurement's master is stopped on the way out)."""
    print(f"[probe capture] {signal.Signals(signum).name} after the probe was recorded: done", flush=True)
    raise SystemExit(0)


def _stop_slowly(job_dir: Path, component: str, rank: int, delay_s: float) -> None:
    stops = job_dir / "probe" / "stops"
    stops.mkdir(parents=True, exist_ok=True)
    (stops / f"{component}_{rank}.term").write_text(f"{time.time()}\n")
    time.sleep(delay_s)
    (stops / f"{component}_{rank}.exit").write_text(f"{time.time()}\n")
    os._exit(143)


def main(argv: list[str] | None = None) -> int:
    """Run the probe for one task; returns the exit code (bad input: one ``error:`` line, exit 2)."""
    return run_command(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m runtime.probe", description=__doc__)
    parser.add_argument("--recipe", required=True, type=Path)
    parser.add_argument("--component", required=True, choices=("capture", "trainer"))
    args = parser.parse_args(argv)
    missing = [name for name in (contracts.ENV_JOB_DIR, contracts.ENV_BIND_ADDRESS) if name not in os.environ]
    if args.component == "trainer":
        missing += [name for name in contracts.TRAINER_ENV_NAMES if name not in os.environ]
    if missing:
        raise UserError(
            f"the probe's {args.component} task lacks the job's environment ({', '.join(missing)} not set): it runs "
            "inside a probe job. Fix: start it through the launcher, `python3 -m launcher RECIPE --probe [--local]`"
        )
    route_native_output()  # the probe's Mooncake client logs through glog onto fd 2: into logs/native_*
    setup = probe_setup(load_resolved(args.recipe))
    job_dir = setup.job_dir
    rank = int(os.environ.get(contracts.ENV_TASK_RANK, "0"))
    extra: dict[str, Any] = {}
    facts: Path | None = None
    measure = os.environ.get("DSPARK_PROBE_MEASURE", "1") != "0"
    if args.component == "trainer":
        extra.update(_trainer_all_reduce())
        if rank == 0:
            extra["capture_reply"] = _trainer_dial(os.environ[contracts.ENV_MOONCAKE_MASTER], CONNECT_TIMEOUT_S)
            facts = _measure_site_facts("trainer", setup) if measure else None
    elif rank == 0:
        facts = _measure_site_facts("capture", setup) if measure else None
        bind_address = os.environ[contracts.ENV_BIND_ADDRESS]
        extra["trainer_message"] = _capture_listen(bind_address, setup.transport.ports.rpc_port, CONNECT_TIMEOUT_S)
    path = _record(job_dir, args.component, rank, extra)
    print(f"[probe {args.component}/{rank}] recorded {path}", flush=True)
    if args.component == "capture" and os.environ.get("DSPARK_PROBE_FAIL") != "capture":
        # Its share of the contract is recorded: a stop from here on (the trainer has ended) is the
        # capture's normal end, as the runtime's capture finishes on SIGTERM and exits 0.
        signal.signal(signal.SIGTERM, _leave_completed)
    if args.component == "capture" and rank == 0 and measure:
        # Recorded first: the job stops the capture once the trainer, which reads last, is done.
        _serve_link(setup, bind_address)
    if facts is not None:
        print(
            f"[probe {args.component}/{rank}] site facts in {facts}; the plan with them: python3 -m launcher "
            f"RECIPE --plan --site-facts {facts.parent}",
            flush=True,
        )
    if os.environ.get("DSPARK_PROBE_FAIL") == args.component:
        print(f"[probe {args.component}/{rank}] DSPARK_PROBE_FAIL asks this component to fail", flush=True)
        return FAIL_EXIT_CODE
    stop_delay_s = float(os.environ.get("DSPARK_PROBE_STOP_DELAY_S", "0"))
    if stop_delay_s:  # behave like a trainer finishing its step: record the SIGTERM, leave a bit later
        signal.signal(signal.SIGTERM, lambda *_: _stop_slowly(job_dir, args.component, rank, stop_delay_s))
    hold_s = float(os.environ.get("DSPARK_PROBE_HOLD_S", "0"))
    if hold_s and os.environ.get(contracts.ENV_REQUEUE_COUNT, "0") == "0":
        print(f"[probe {args.component}/{rank}] holding {hold_s:.0f} s (DSPARK_PROBE_HOLD_S)", flush=True)
        time.sleep(hold_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
