"""A private MariaDB for slurmdbd: its own data folder, socket and loopback port inside the state folder.

Debian's Slurm 22.05 has no file-based accounting storage any more, so ``sacct`` (which the launcher's
``status`` reads) needs slurmdbd, and slurmdbd needs MySQL/MariaDB.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

from runtime.files import atomic_path
from tools.slurm_local_impl.packages import find_program
from tools.slurm_local_impl.processes import port_accepts, running_pid, start_foreground_daemon, tail
from tools.slurm_local_impl.progress import say, wait_until
from tools.slurm_local_impl.settings import ClusterSettings

DATABASE = "slurm_acct_db"
DB_USER = "slurm"

# slurmdbd logs an error below these (Slurm's accounting guide): a 128 MiB buffer pool (MariaDB's
# default, filled only as tables grow), a 64 MiB redo log, and a long lock wait so schema updates
# do not time out.
INNODB_ARGS = ("--innodb-buffer-pool-size=128M", "--innodb-log-file-size=64M", "--innodb-lock-wait-timeout=900")


def db_password(settings: ClusterSettings) -> str:
    """The database user's password: random per cluster, kept in the state folder with mode 600."""
    path = settings.layout.db_password_file
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    password = secrets.token_hex(16)
    with atomic_path(path) as temp:
        temp.write_text(password + "\n")
        os.chmod(temp, 0o600)
    return password


def _initialize_data_dir(settings: ClusterSettings) -> None:
    layout = settings.layout
    if (layout.mariadb_data / "mysql").is_dir():
        return
    install_db = find_program("mariadb-install-db")
    assert install_db is not None, "ensure_packages installs mariadb-server first"
    log = layout.log_file("mariadb-install-db")
    log.parent.mkdir(parents=True, exist_ok=True)
    say(f"initializing the accounting database in {layout.mariadb_data}")
    with log.open("ab") as handle:
        result = subprocess.run(
            [
                install_db,
                "--no-defaults",
                f"--datadir={layout.mariadb_data}",
                "--user=root",
                "--auth-root-authentication-method=socket",
                "--skip-test-db",
                *INNODB_ARGS,
            ],
            stdout=handle,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if result.returncode != 0:
        raise SystemExit(
            f"slurm_local: mariadb-install-db failed (exit {result.returncode}); last lines of {log}:\n{tail(log)}"
        )


def _mariadb_sql(settings: ClusterSettings, sql: str) -> None:
    client = find_program("mariadb")
    assert client is not None, "ensure_packages installs mariadb-client first"
    # The SQL carries the password, so it goes through stdin, never the command line.
    result = subprocess.run(
        [client, "--no-defaults", f"--socket={settings.layout.mariadb_socket}", "--user=root"],
        input=sql,
        text=True,
        capture_output=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"slurm_local: setting up the accounting database failed: {result.stderr.strip()}")


def ensure_mariadb(settings: ClusterSettings) -> None:
    """Initialize (once), start (unless running) and provision the database and its slurm user."""
    layout = settings.layout
    pid_file = layout.pid_file("mariadbd")
    if running_pid(pid_file, layout) is None:
        _initialize_data_dir(settings)
        server = find_program("mariadbd")
        assert server is not None, "ensure_packages installs mariadb-server first"
        log = layout.log_file("mariadbd")
        console = layout.console_log("mariadbd")
        say("starting mariadbd (accounting database)")
        start_foreground_daemon(
            [
                server,
                "--no-defaults",
                f"--datadir={layout.mariadb_data}",
                f"--socket={layout.mariadb_socket}",
                f"--port={settings.mariadb_port}",
                "--bind-address=127.0.0.1",
                "--user=root",
                f"--pid-file={layout.mariadb_dir / 'mariadbd.server.pid'}",
                f"--log-error={log}",
                "--skip-name-resolve",
                *INNODB_ARGS,
            ],
            name="mariadbd",
            layout=layout,
        )
        wait_until(
            lambda: port_accepts(settings.mariadb_port) and Path(layout.mariadb_socket).exists(),
            f"mariadbd on 127.0.0.1:{settings.mariadb_port}",
            timeout_s=60,
            on_timeout=lambda: f"Last lines of {log}:\n{tail(log)}\nand of {console}:\n{tail(console)}",
        )
    password = db_password(settings)
    _mariadb_sql(
        settings,
        f"CREATE DATABASE IF NOT EXISTS {DATABASE};\n"
        f"CREATE USER IF NOT EXISTS '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{password}';\n"
        f"ALTER USER '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{password}';\n"
        f"GRANT ALL ON {DATABASE}.* TO '{DB_USER}'@'127.0.0.1';\n",
    )
