"""Installs the Debian packages the local cluster needs, when any of their programs is missing."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from tools.slurm_local_impl.progress import say
from tools.slurm_local_impl.settings import MARKER

# program -> Debian package providing it (Debian 12 / Ubuntu; Slurm 22.05 on bookworm).
REQUIRED_PROGRAMS: dict[str, str] = {
    "munged": "munge",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "slurmdbd": "slurmdbd",
    "sbatch": "slurm-client",
    "sacct": "slurm-client",
    "mariadbd": "mariadb-server",
    "mariadb-install-db": "mariadb-server",
    "mariadb": "mariadb-client",
}

SBIN_DIRS = ("/usr/sbin", "/sbin", "/usr/local/sbin")


def find_program(name: str) -> str | None:
    """Path of ``name`` on PATH or in the sbin folders (often not on a non-login root PATH)."""
    found = shutil.which(name)
    if found:
        return found
    for folder in SBIN_DIRS:
        candidate = Path(folder) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def missing_packages() -> list[str]:
    """Debian packages whose programs are not installed, in a stable order."""
    missing = {package for program, package in REQUIRED_PROGRAMS.items() if find_program(program) is None}
    return sorted(missing)


def _apt_env() -> dict[str, str]:
    env = dict(os.environ)
    env["DEBIAN_FRONTEND"] = "noninteractive"
    return env


def _apt_lists_present() -> bool:
    lists = Path("/var/lib/apt/lists")
    return lists.is_dir() and any(path.name.endswith("_Packages") for path in lists.iterdir())


POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
POLICY_DENY_ALL = "#!/bin/sh\n# Written by {marker} during apt-get install; removed right after.\nexit 101\n"


@contextlib.contextmanager
def _services_not_started() -> Iterator[None]:
    """While installing, keep the packages' postinst scripts from starting the system munge, mariadb,
    slurmctld, slurmd and slurmdbd services (Debian's policy-rc.d; exit 101 means "not allowed"): we
    run our own daemons, a system mariadb or munged would be a leftover, and slurmctld's postinst fails
    the install where its init script cannot start without a slurm.conf. Docker images already ship
    such a file; an existing one is left alone."""
    if POLICY_RC_D.exists():
        yield
        return
    POLICY_RC_D.write_text(POLICY_DENY_ALL.format(marker=MARKER))
    os.chmod(POLICY_RC_D, 0o755)
    try:
        yield
    finally:
        POLICY_RC_D.unlink(missing_ok=True)


def _apt_get(log: IO[str], *argv: str) -> int:
    return subprocess.run(
        ["apt-get", *argv], stdout=log, stderr=subprocess.STDOUT, env=_apt_env(), check=False
    ).returncode


def ensure_packages(log_path: Path) -> None:
    """apt-get installs whatever is missing (no recommends, no prompts, no services started), running
    ``apt-get update`` first on a machine without package lists, or once more if the install fails."""
    packages = missing_packages()
    if not packages:
        return
    if find_program("apt-get") is None:
        raise SystemExit(
            f"slurm_local: missing Debian packages {', '.join(packages)} and no apt-get on this machine; "
            "install them with the system package manager and rerun `tools/slurm_local up`."
        )
    started = time.monotonic()
    say(f"installing Debian packages: {' '.join(packages)} (log: {log_path})")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    install = ["install", "-y", "-q", "--no-install-recommends", *packages]
    with log_path.open("a") as log, _services_not_started():
        if not _apt_lists_present():
            _apt_get(log, "update", "-q")
        returncode = _apt_get(log, *install)
        if returncode != 0:
            _apt_get(log, "update", "-q")
            returncode = _apt_get(log, *install)
    still_missing = missing_packages()
    if returncode != 0 or still_missing:
        raise SystemExit(
            f"slurm_local: apt-get install {' '.join(packages)} failed (exit {returncode}); "
            f"still missing: {', '.join(still_missing) or 'none'}. See {log_path}."
        )
    say(f"installed {' '.join(packages)} in {time.monotonic() - started:.1f} s")
