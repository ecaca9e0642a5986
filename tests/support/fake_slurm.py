"""Fake Slurm commands at the process boundary, for unit tests that run anywhere (no root, no cluster).

``FakeSlurm(folder)`` writes small executables named ``sbatch``, ``sacct``, ``scontrol`` and ``scancel``
into ``folder/bin``; a test puts that folder first on ``PATH`` (``fake.environ()``) and the launcher's
own code runs them with ``subprocess`` exactly as it runs the real ones. Each call is appended to
``calls.jsonl`` (argv, and for ``sbatch`` the submitted script's text); what ``sacct`` prints, and the
exit codes and error text of every command, are set per test. The real local cluster
(``tools/slurm_local``) stays the integration test; this is what submitit's own test suite does.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# srun too: submitit refuses to build a Slurm executor where `srun` is not on PATH (a machine without Slurm).
COMMANDS = ("sbatch", "sacct", "scontrol", "scancel", "srun")

_SCRIPT = """#!{python}
import json, os, sys
from pathlib import Path

state = Path({state!r})
name = Path(sys.argv[0]).name
call = {{"command": name, "argv": sys.argv[1:], "env": {{k: v for k, v in os.environ.items() if k.startswith("DSPARK_")}}}}
if name == "sbatch":
    script = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    call["script"] = Path(script).read_text() if script else sys.stdin.read()
with open(state / "calls.jsonl", "a") as log:
    log.write(json.dumps(call) + "\\n")
behaviour = json.loads((state / "behaviour.json").read_text()).get(name, {{}})
sys.stdout.write(behaviour.get("stdout", ""))
sys.stderr.write(behaviour.get("stderr", ""))
sys.exit(int(behaviour.get("exit_code", 0)))
"""


class FakeSlurm:
    """A folder of fake Slurm commands whose answers a test sets and whose calls it reads back."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.bin = folder / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        self._behaviour: dict[str, dict[str, object]] = {}
        self._save()
        for name in COMMANDS:
            path = self.bin / name
            path.write_text(_SCRIPT.format(python=sys.executable, state=str(folder)))
            path.chmod(0o755)

    def _save(self) -> None:
        (self.folder / "behaviour.json").write_text(json.dumps(self._behaviour))

    def answer(self, command: str, stdout: str = "", stderr: str = "", exit_code: int = 0) -> None:
        """What ``command`` prints and returns from now on."""
        self._behaviour[command] = {"stdout": stdout, "stderr": stderr, "exit_code": exit_code}
        self._save()

    def calls(self, command: str | None = None) -> list[dict[str, object]]:
        """Every call so far (of ``command`` only, when given), oldest first."""
        path = self.folder / "calls.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [row for row in rows if command is None or row["command"] == command]

    def environ(self) -> dict[str, str]:
        """``os.environ`` with the fake commands first on ``PATH``."""
        return {**os.environ, "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"}
