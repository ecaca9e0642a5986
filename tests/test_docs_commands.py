"""The commands README.md and RUNBOOK.md give in their ```bash blocks hold as written: every file of
this repository they name exists (tools/..., sbatch/..., recipes/...), and every ``python3 -m launcher``
line parses with the launcher's own argument parser (parsed only, never run). And the documents and
code stand alone: no "issue N" (a tracker the repository does not carry) and no commit id of this
repository ("main at 1ce6afc") in README.md, RUNBOOK.md, launcher/, runtime/, tools/, recipes/, sbatch/
or patches/. Pinned commits of other projects (SGLang, SpecForge) are citations and stay."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from launcher.cli import command_parser

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", "RUNBOOK.md")
STANDALONE = ("README.md", "RUNBOOK.md", "launcher", "runtime", "tools", "recipes", "sbatch", "patches")
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.DOTALL | re.MULTILINE)
REPO_PATH = re.compile(r"^(?:\./)?((?:tools|sbatch|recipes|patches|launcher|runtime)/[\w./-]*[\w/])$")
ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
OWN_COMMIT = re.compile(r"\bmain(?:'s)?(?: at| commit)? [0-9a-f]{7,40}\b")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sbatch", ".sh", ".txt", ".c", ".patch", ""}


def command_lines(document: str) -> list[tuple[str, int, str]]:
    """(document, line number, command) for every command of the document's ```bash blocks, with
    backslash continuations joined and comments left in (shlex drops them)."""
    text = (REPO / document).read_text()
    found: list[tuple[str, int, str]] = []
    for block in BASH_BLOCK.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        pending, start = "", first
        for offset, line in enumerate(block.group(1).splitlines()):
            if not pending:
                start = first + offset
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            command = (pending + line).strip()
            pending = ""
            if command and not command.startswith("#"):
                found.append((document, start, command))
    return found


def words(command: str) -> list[str]:
    """The command's words (comments dropped); placeholders such as ``<stamp>`` stay as written."""
    return shlex.split(command, comments=True)


def is_synopsis(argv: list[str]) -> bool:
    """A usage line (``[--plan]``, ``A | B``, ``...``), not a command to run."""
    return any(word.startswith("[") or word in ("|", "...") or word.endswith("]") for word in argv)


def launcher_arguments(argv: list[str]) -> list[str] | None:
    """The arguments after ``python3 -m launcher`` (any python: .venv/bin/python3 too), or None."""
    for index in range(len(argv) - 2):
        if argv[index].endswith(("python3", "python")) and argv[index + 1 : index + 3] == ["-m", "launcher"]:
            return argv[index + 3 :]
    return None


def all_commands() -> list[tuple[str, int, str]]:
    return [entry for document in DOCUMENTS for entry in command_lines(document)]


def test_the_extraction_finds_the_commands_it_checks() -> None:
    """The checks below see the documents' real commands (else they would pass vacuously)."""
    commands = [command for _, _, command in all_commands()]
    assert "tools/bootstrap && .venv/bin/python3 -m launcher tiny --local" in commands
    assert any(c.startswith("tools/prepare_data --input chats.jsonl") and "--output" in c for c in commands)
    parsed = [launcher_arguments(words(c)) for c in commands]
    assert sum(1 for a in parsed if a is not None and not is_synopsis(a)) >= 20
    assert is_synopsis(words("python3 -m launcher RECIPE [--plan] [--dry-run]"))


def test_every_repository_file_a_documented_command_names_exists() -> None:
    missing = []
    for document, line, command in all_commands():
        for word in words(command):
            value = word.split("=", 1)[1] if re.match(r"^[A-Z_][A-Z0-9_]*=", word) else word
            match = REPO_PATH.match(value)
            if not match or re.search(r"[<>$*]|[A-Z]{3,}", value):
                continue  # not a path of ours, or a placeholder (runs/<stamp>, sbatch/NAME.sbatch)
            if not (REPO / match.group(1)).exists():
                missing.append(f"{document}:{line}: {match.group(1)} (in `{command}`)")
    assert not missing, "documented commands name files the repository lacks:\n" + "\n".join(missing)


def test_every_documented_launcher_command_parses() -> None:
    refused = []
    for document, line, command in all_commands():
        argv = launcher_arguments(words(command))
        if argv is None or is_synopsis(argv):
            continue
        parser, rest = command_parser(argv)
        try:
            parser.parse_args(rest)
        except SystemExit:
            refused.append(f"{document}:{line}: `{command}`")
    assert not refused, "the launcher's parser refuses these documented commands:\n" + "\n".join(refused)


def standalone_files() -> list[Path]:
    files = []
    for name in STANDALONE:
        path = REPO / name
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        files += [p for p in candidates if p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts]
    return files


@pytest.mark.parametrize("pattern", [ISSUE, OWN_COMMIT], ids=["issue-N", "own-commit-id"])
def test_documents_and_code_cite_no_tracker_issue_and_no_commit_of_this_repository(pattern: re.Pattern[str]) -> None:
    assert pattern.search("the patch (issue 12, item 4)" if pattern is ISSUE else "baseline: main at 1ce6afc")
    hits = []
    for path in standalone_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for match in pattern.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            hits.append(f"{path.relative_to(REPO)}:{line}: {match.group(0)!r}")
    assert not hits, "say what is meant in the repository's own words:\n" + "\n".join(hits)
