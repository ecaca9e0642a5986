"""Every command the code names works as printed: ``python3 -m MODULE`` (not ``python``, which a
cluster's login node may not have) of a module that exists, ``python3 -m launcher SUB`` with a
subcommand the launcher has (or a recipe, or a placeholder such as ``RECIPE``), and ``tools/NAME``
of a tool that exists. Scans launcher/, runtime/ and tools/ (string literals, docstrings) and the
READMEs and RUNBOOK.md."""

from __future__ import annotations

import re
from pathlib import Path

from launcher.cli import SUBCOMMANDS

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("launcher", "runtime", "tools")
MODULE_COMMAND = re.compile(r"\b(python3?) -m ([A-Za-z_][\w.]*)(?: +([A-Za-z_{][\w{}.-]*))?")
TOOL_PATH = re.compile(r"(?<![\w./-])tools/([a-z_]+(?:\.[a-z]+)?)\b")
OURS = ("launcher", "runtime", "tools")
"""Top-level packages of this repository; other modules (sglang, torch.distributed) are external."""


def sources() -> list[Path]:
    """The Python files whose text is scanned, and the documents a user follows (README.md,
    RUNBOOK.md and the package READMEs)."""
    code = [p for top in SCANNED for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts]
    docs = [REPO / "README.md", REPO / "RUNBOOK.md", *(p for top in SCANNED for p in (REPO / top).rglob("README.md"))]
    return sorted(code + docs)


def module_exists(dotted: str) -> bool:
    """Whether ``python3 -m dotted`` finds a module of this repository (a file or a package with
    ``__main__.py``)."""
    path = REPO.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


def launcher_target_ok(word: str) -> bool:
    """A launcher subcommand, a recipe name, an option, or a placeholder (RECIPE, JOB, {name})."""
    recipes = {p.stem for p in (REPO / "recipes").glob("*.yaml")}
    return word in SUBCOMMANDS or word in recipes or word.startswith(("-", "{")) or word.isupper()


def test_the_scanner_finds_what_it_checks() -> None:
    """The patterns match the forms the code uses (else the checks below pass vacuously)."""
    text = "run `python3 -m launcher cancel JOB` or python -m tools.room_walk, then tools/compare_runs A B"
    assert [m.groups() for m in MODULE_COMMAND.finditer(text)] == [
        ("python3", "launcher", "cancel"),
        ("python", "tools.room_walk", None),
    ]
    assert TOOL_PATH.findall(text) == ["compare_runs"]
    assert not launcher_target_ok("cancle") and launcher_target_ok("cancel") and launcher_target_ok("tiny")


def test_every_printed_command_names_an_existing_module_subcommand_and_tool() -> None:
    problems, seen = [], 0
    for path in sources():
        text = path.read_text()
        where = path.relative_to(REPO)
        for match in MODULE_COMMAND.finditer(text):
            python, module, word = match.groups()
            line = text.count("\n", 0, match.start()) + 1
            if module.split(".")[0] not in OURS:
                continue
            seen += 1
            if python != "python3":
                problems.append(f"{where}:{line}: {match.group(0)!r} says `python`, write `python3`")
            if not module_exists(module):
                problems.append(f"{where}:{line}: {match.group(0)!r}: no module {module} in the repository")
            elif module == "launcher" and word and not launcher_target_ok(word):
                problems.append(f"{where}:{line}: {match.group(0)!r}: the launcher has no subcommand {word!r}")
        for match in TOOL_PATH.finditer(text):
            seen += 1
            if not (REPO / "tools" / match.group(1)).exists():
                line = text.count("\n", 0, match.start()) + 1
                problems.append(f"{where}:{line}: tools/{match.group(1)} does not exist")
    assert seen > 50, f"only {seen} commands found: the scan is broken"
    assert not problems, "\n".join(problems)
