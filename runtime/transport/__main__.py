"""``python3 -m runtime.transport``: run the master by hand, or look at a running data plane.

    python3 -m runtime.transport master --recipe RESOLVED [--host IP]
    python3 -m runtime.transport status --job JOB_DIR        # from the login node, or any machine
    python3 -m runtime.transport status --recipe RESOLVED    # inside a job, with its environment

``status`` prints the cursor, the producer's heartbeat and which samples of the window are
committed. Endpoints come from the launcher's environment contract (DSPARK_MOONCAKE_MASTER, ...)
when it is set (inside a job); elsewhere from the job folder, where the process that started the
master recorded them (``transport/endpoints.json``), and the client binds to this machine's address
on the route to the master.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from runtime.user_errors import UserError, exit_without_package, run_command

try:  # a stock python3 instead of the venv's: one line, not a traceback
    from runtime.recipe.loader import RESOLVED_FILENAME, load_resolved
    from runtime.shared.contracts import ENV_BIND_ADDRESS, ENV_CAPTURE_HOST, ENV_MOONCAKE_MASTER
    from runtime.transport.endpoints import (
        Endpoints,
        endpoints_of_job,
        endpoints_record,
        mark_endpoints_ended,
        record_endpoints,
    )
    from runtime.transport.settings import TransportSettings
except ModuleNotFoundError as _missing:
    exit_without_package(_missing, "runtime.transport")


@dataclass(frozen=True)
class CommandSetup:
    """What this command line takes from a resolved recipe, read once by :func:`transport_setup`."""

    settings: TransportSettings
    job_dir: Path
    feature_cache: bool
    """The trainer caches features (status then counts the samples ranks asked for)."""


def transport_setup(recipe_path: Path | str) -> CommandSetup:
    """The transport's settings and the job folder of a resolved recipe: the one place this command
    line reads the recipe."""
    resolved = load_resolved(recipe_path)
    recipe = resolved.recipe
    return CommandSetup(TransportSettings.from_recipe(recipe), resolved.job_dir, recipe.trainer.feature_cache.enabled)


def run_master(args: argparse.Namespace) -> int:
    """Start ``mooncake_master`` from the recipe and keep it until SIGTERM / SIGINT."""
    from runtime.transport.master import MasterProcess

    setup = transport_setup(args.recipe)
    settings, job_dir = setup.settings, setup.job_dir
    host = args.host or os.environ.get(ENV_BIND_ADDRESS) or settings.bind_address
    if not host:
        print(f"error: pass --host or set {ENV_BIND_ADDRESS} (transport.bind_address is 'auto')", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log_path = job_dir / "logs" / "mooncake_master.log"
    with MasterProcess(settings.master(host), log_path, die_with_parent=True) as master:
        record_endpoints(job_dir, Endpoints.on_host(settings.ports, host, host), recorder="master")
        print(f"mooncake_master ready (pid {master.pid}) on {host}; log {log_path}", flush=True)
        while not stop.wait(1.0):
            if master.process is not None and master.process.poll() is not None:
                print(f"mooncake_master exited with {master.process.returncode}; see {log_path}", file=sys.stderr)
                mark_endpoints_ended(job_dir)
                return 1
    mark_endpoints_ended(job_dir)
    return 0


def run_status(args: argparse.Namespace) -> int:
    """Print the cursor, every capture share's heartbeat, and what the window holds (and, with the
    feature cache, how much of it trainer ranks asked for)."""
    from runtime.shared.contracts import META_FIELD, cursor_key, sample_key, want_key
    from runtime.transport.errors import TransportError
    from runtime.transport.liveness import stored_heartbeat
    from runtime.transport.records import Cursor
    from runtime.transport.store import StoreClient

    setup = transport_setup(args.recipe or Path(args.job) / RESOLVED_FILENAME)
    settings = setup.settings
    job_dir = Path(args.job) if args.job else setup.job_dir
    record = endpoints_record(job_dir)
    if record is not None and record.get("ended_at"):
        print(
            f"job {job_dir}: its capture stopped the data plane at {_clock(record['ended_at'])} "
            f"({job_dir / 'transport' / 'endpoints.json'}): the job has ended; `python3 -m launcher status {job_dir}` "
            "says how"
        )
        return 1
    try:
        endpoints = status_endpoints(settings, job_dir)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    refused = _master_refuses(endpoints.master_host, endpoints.master_rpc_port)
    if refused:
        print(
            f"job {job_dir}: no mooncake_master answers at {endpoints.master_address} ({refused}): the job has ended "
            f"or its master died; `python3 -m launcher status {job_dir}` says which"
        )
        return 1
    try:
        # stderr is the operator's console: a healthy client start's native lines stay off it
        client = StoreClient(settings.client(endpoints, 0), name="status").connect(quiet=True)
    except TransportError as exc:
        print(
            f"error: cannot join the store at {endpoints.master_address}: {str(exc).splitlines()[0]}", file=sys.stderr
        )
        return 1
    with client:
        store_id = settings.store_id
        other = _another_jobs_store(client, store_id, record)
        if other:
            print(f"job {job_dir}: {other}")
            return 1
        raw = client.get_bytes(cursor_key(store_id))
        cursor = Cursor.decode(raw) if raw else None
        print(
            f"store {store_id}: "
            + (f"cursor {cursor.value} (step {cursor.step}, by {cursor.publisher})" if cursor else "no cursor")
        )
        shares = settings.capture_shares
        for share in range(shares):
            beat = stored_heartbeat(client, store_id, share)
            where = f"capture share {share} of {shares}: " if shares > 1 else ""
            print(where + (beat.summary() if beat else "no producer heartbeat"))
        if cursor is not None:
            high = settings.producer.window.high_samples
            window = range(cursor.value, cursor.value + high)
            present = client.exist([sample_key(store_id, g, META_FIELD) for g in window])
            committed = [g for g, ok in zip(window, present, strict=True) if ok]
            print(
                f"window [{window.start}, {window.stop}): {len(committed)} committed"
                + (
                    f", first missing g={next(g for g, ok in zip(window, present, strict=True) if not ok)}"
                    if len(committed) < high
                    else ""
                )
            )
            if setup.feature_cache:
                asks = client.exist([want_key(store_id, g) for g in window])
                print(f"feature cache: {sum(asks)} sample(s) of the window asked for by trainer ranks")
    return 0


def _clock(epoch_s: object) -> str:
    """A recorded wall-clock time as local ``YYYY-MM-DD HH:MM:SS``."""
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(epoch_s)))  # type: ignore[arg-type]


def _master_refuses(host: str, port: int, timeout_s: float = 1.0) -> str:
    """Why nothing answers at the master's RPC port within ``timeout_s`` (a refused connection, no route,
    a time-out), or '' when it answers: a look at an ended job must not wait for the store client's timeout."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return ""
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def _another_jobs_store(client: object, store_id: str, record: dict[str, object] | None) -> str:
    """'' when the store's producer is the one this job folder recorded (or it cannot be told); else a
    line saying the store belongs to another job on the same ports (the asked job's capture ended)."""
    from runtime.transport.liveness import stored_heartbeat

    if record is None or record.get("recorder") != "capture":
        return ""
    beat = stored_heartbeat(client, store_id, 0)  # type: ignore[arg-type]
    if beat is None or (beat.pid, beat.host) == (record.get("pid"), record.get("host")):
        return ""
    return (
        f"the store at {record['master_address']} is not this job's: its producer is pid {beat.pid} on {beat.host}, "
        f"this job's capture was pid {record.get('pid')} on {record.get('host')}. This job has ended and another job "
        "uses the same ports and store name; give that job's folder to look at it"
    )


def status_endpoints(settings: TransportSettings, job_dir: Path) -> Endpoints:
    """Inside a job (the launcher's variables set): the job's environment. Elsewhere (the login node):
    what the job's master recorded in ``job_dir``, bound to ``DSPARK_BIND_ADDRESS``, the recipe's
    ``transport.bind_address``, or this machine's address on the route to the master."""
    if os.environ.get(ENV_MOONCAKE_MASTER) or os.environ.get(ENV_CAPTURE_HOST):
        return settings.endpoints_from_env()
    return endpoints_of_job(job_dir, os.environ.get(ENV_BIND_ADDRESS) or settings.bind_address)


def main(argv: list[str] | None = None) -> int:
    """Entry point (bad input: one ``error:`` line, exit 2)."""
    return run_command(_main, argv)


def _main(argv: list[str] | None) -> int:
    from runtime.recipe import RecipeError
    from runtime.transport.errors import MasterStartError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="python3 -m runtime.transport", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    master = sub.add_parser("master", help="run mooncake_master from the recipe")
    master.add_argument("--recipe", required=True)
    master.add_argument("--host", default=None, help="address to bind (default: DSPARK_BIND_ADDRESS)")
    status = sub.add_parser("status", help="cursor, heartbeat and window of a running data plane")
    which = status.add_mutually_exclusive_group(required=True)
    which.add_argument("--job", help="the job folder (runs/NAME/STAMP): its recipe and its master's endpoints")
    which.add_argument("--recipe", help="a resolved recipe; endpoints from the job's environment, else its job folder")
    args = parser.parse_args(argv)
    given = Path(args.recipe) if args.recipe else None
    if given is not None and given.suffix in (".yaml", ".yml"):
        raise UserError(
            f"--recipe {given} is a recipe file; this command reads a job's resolved recipe. Fix: --recipe "
            f"runs/NAME/STAMP/{RESOLVED_FILENAME}, or --job runs/NAME/STAMP"
        )
    try:
        return run_master(args) if args.command == "master" else run_status(args)
    except (RecipeError, MasterStartError) as exc:
        raise UserError(str(exc)) from None


if __name__ == "__main__":
    sys.exit(main())
