"""Command line of ``tools/slurm_local``: ``up``, ``down``, ``status``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from tools.slurm_local_impl.cluster import ClusterStatus, down, require_root, stale_pid_files, status, up
from tools.slurm_local_impl.lock import exclusive
from tools.slurm_local_impl.settings import STATE_DIR_ENV, ClusterSettings, resolve_state_dir

EXIT_RUNNING = 0
EXIT_PARTIAL = 1
EXIT_STOPPED = 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tools/slurm_local",
        description="A real two-node Slurm cluster (8 fake GPUs per node, sacct through slurmdbd) on this machine, as root.",
    )
    parser.add_argument(
        "--state-dir",
        help=f"folder holding all of the cluster's files (default: ${STATE_DIR_ENV}, else the running cluster's, "
        "else /var/tmp/dspark-slurm-local)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("up", help="install missing packages, start every daemon, wait for idle nodes (idempotent)")
    down_parser = commands.add_parser("down", help="cancel jobs, stop every daemon, remove all state (idempotent)")
    down_parser.add_argument("--keep-state", action="store_true", help="keep the state folder (logs, database)")
    status_parser = commands.add_parser(
        "status",
        help="report daemons, nodes and jobs (run as root to see the daemons); exit 0 running, 3 stopped, 1 partly running",
    )
    status_parser.add_argument("--json", action="store_true", help="print the status as one JSON object")
    return parser


def _print_status(report: ClusterStatus, stale: list[str]) -> None:
    verdict = "running" if report.running else "stopped" if report.stopped else "partly running"
    print(f"cluster: {verdict}   state folder: {report.state_dir}")
    for name, pid in report.daemons.items():
        note = " (stale pid file)" if name in stale else ""
        print(f"  {name:<14} {'pid ' + str(pid) if pid else 'not running'}{note}")
    for node in report.nodes:
        print(
            f"  node {node.name}: {node.state} gres={node.gres} cpus={node.cpus} mem={node.memory_mib}MiB {node.reason}".rstrip()
        )
    print(
        f"  /etc/hosts line: {'present' if report.hosts_line else 'absent'};"
        f" /etc/slurm/slurm.conf link: {'present' if report.slurm_conf_linked else 'absent'}"
    )
    if report.queue:
        print("  jobs (id|name|state|nodes|reason):")
        for line in report.queue:
            print(f"    {line}")


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the process exit code."""
    args = _parser().parse_args(argv)
    settings = ClusterSettings(state_dir=resolve_state_dir(args.state_dir))
    if args.command == "up":
        require_root()
        with exclusive(settings.state_dir):
            up(settings)
        return EXIT_RUNNING
    if args.command == "down":
        require_root()
        with exclusive(settings.state_dir, remove_after=True):
            down(settings, keep_state=args.keep_state)
        return EXIT_RUNNING
    report = status(settings)
    if args.json:
        print(json.dumps(dataclasses.asdict(report) | {"running": report.running, "stopped": report.stopped}))
    else:
        _print_status(report, stale_pid_files(settings))
    return EXIT_RUNNING if report.running else EXIT_STOPPED if report.stopped else EXIT_PARTIAL


if __name__ == "__main__":
    sys.exit(main())
