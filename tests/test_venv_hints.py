"""Every ``python3 -m`` entry the docs tell a user to run answers a python without the project's packages
(a stock ``python3`` instead of the venv's) with the same one line naming the fix, never a traceback
(``runtime.user_errors.exit_without_package``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "RUNBOOK.md", "runtime/transport/README.md")
"""The documents whose ``python3 -m`` commands a user is told to run."""
_ENTRY = re.compile(r"python3 (?:-\S+ )*-m ((?:launcher|runtime|tools)(?:\.\w+)*)")


def documented_entries() -> list[str]:
    """The ``python3 -m`` modules of this repository that :data:`DOCS` name (a command may wrap a line)."""
    found: set[str] = set()
    for name in DOCS:
        found.update(_ENTRY.findall(re.sub(r"\s+", " ", (REPO / name).read_text())))
    return sorted(found)


def _replay_folder(root: Path) -> list[str]:
    """Arguments that take ``tools.replay_decodes`` past its own checks to its replay (torch, transformers)."""
    folder, target = root / "eval", root / "target"
    folder.mkdir()
    target.mkdir()
    (folder / "results.json").write_text(json.dumps({"passes": [], "job_dir": str(root), "stop_token_ids": [2]}))
    (folder / "decodes.jsonl").write_text("")
    (target / "config.json").write_text("{}")
    return [str(folder), "--target", str(target)]


LAZY_ARGS = {
    "tools.replay_decodes": _replay_folder,  # imports torch and transformers only to replay
    "tools.room_walk": lambda root: ["--", "tiny", "--plan"],  # imports the launcher only to walk it
}
"""Entries whose ``--help`` needs no package: the arguments that reach their imports."""


def test_the_docs_name_the_entries_this_test_knows() -> None:
    entries = documented_entries()
    assert {"launcher", "runtime.transport", "tools.bench.feature_cache", "tools.replay_decodes"} <= set(entries)
    assert set(LAZY_ARGS) <= set(entries), "an entry of LAZY_ARGS is no longer documented"


@pytest.mark.parametrize("entry", documented_entries())
def test_a_stock_python_gets_one_line_naming_the_venv(entry: str, tmp_path: Path) -> None:
    """``python3 -S`` sees no site-packages: exactly the interpreter a user gets without the venv."""
    args = LAZY_ARGS[entry](tmp_path) if entry in LAZY_ARGS else ["--help"]
    done = subprocess.run(
        [sys.executable, "-S", "-m", entry, *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, (done.returncode, done.stderr)
    assert re.fullmatch(
        rf"error: \S+ lacks the package '\w+' that `python3 -m {re.escape(entry)}` needs: run it with the project "
        rf"venv's python \(`\.venv/bin/python3 -m {re.escape(entry)} \.\.\.`, or `source \.venv/bin/activate` "
        r"first\); `tools/bootstrap` makes the venv",
        lines[0],
    ), lines[0]
