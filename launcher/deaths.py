"""Which task died first, and how to say it: the cause of a failed job is the first component task that
ended badly; the failures of the others that follow it (connection resets, a rank's abort, an idle
time-out) are its consequences and are reported as such, after it.

The ``--local`` supervisor sees every task and orders their deaths by when it saw them; Slurm's
workers each see one task, on different nodes, and agree through :func:`claim_first_death`: the
first to record its death in the shared job folder is the cause.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

from runtime.shared.lifecycle import exit_text

FIRST_DEATH_FILENAME = "first_death.json"
"""In the job folder: the first component task that died (written once, by whoever saw it first)."""
LAST_WORDS_BYTES = 64 * 1024
"""How much of a task's log end is searched for its last error line."""
LAST_WORDS_CHARS = 1000
"""The longest last words kept (a longer line is cut with `` ...``, so a cut never reads as complete)."""
_LOG_PREFIX = re.compile(r"^(\[\w+\] )?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ERROR \[[\w.]+\] ")
"""A logged line's time, level and logger: dropped from the last words."""
_ERROR_LINE = re.compile(r"( ERROR \[|^\w*(Error|Exception)\b|^\[\w+\] \w*(Error|Exception)\b|^\[[^\]]+\] error: )")


@dataclass(frozen=True)
class Death:
    """One component task that ended badly."""

    component: str
    rank: int
    code: int
    seen_order: int = 0
    """The supervisor's poll round in which it was first seen dead (smaller is earlier)."""
    last_words: str = ""
    """The last error line of its log, when there is one."""

    def says_how_to_resume(self) -> bool:
        """Its last words already give the resume command (the capture's master watch does)."""
        return "resume with `" in self.last_words

    def describe(self) -> str:
        """``trainer rank 1 killed by SIGKILL (-9)`` with its last error line when it has one."""
        said = f": {self.last_words}" if self.last_words else ""
        return f"{self.component} rank {self.rank} {exit_text(self.code)}{said}"

    def refused(self) -> bool:
        """Its last words are its own one-line refusal (``[trainer rank 0] error: ... Fix: ...``), which the
        console has shown already: the supervisor points at it instead of saying it again."""
        return self.last_words.startswith(f"[{self.component} rank {self.rank}] error:")

    def reason(self) -> str:
        """Its last words without the task's own ``[component rank N]`` prefix (equal among peers that
        refused for the same reason)."""
        return self.last_words.removeprefix(f"[{self.component} rank {self.rank}] ")

    def cause(self) -> str:
        """What happened, for the closing line: ``trainer rank 0 exited with code 1: disk full at ...`` (its
        last words without the task's prefix, the fix and the traceback pointer, which its error line has)."""
        said = self.reason().removeprefix("error: ").split(" Fix: ")[0].split(" (traceback: ")[0].rstrip(". ")
        return f"{self.component} rank {self.rank} {exit_text(self.code)}" + (f": {said}" if said else "")

    def pointed(self) -> str:
        """:meth:`describe` for a console that has shown a refusal already: the refusal is pointed at. The
        console echoes rank 0's log only: another rank's refusal is said here instead."""
        if self.refused() and self.rank == 0:
            return (
                f"{self.component} rank {self.rank} {exit_text(self.code)}; its error line above says why and the fix"
            )
        return self.describe()


def _signal_rank(death: Death) -> int:
    # Within one poll round a task killed by a signal is taken as the cause: the ones that exit with
    # a code or abort (SIGABRT) in the same round are the usual reactions of its peers.
    if death.code == -signal.SIGKILL:
        return 0
    if death.code < 0 and death.code != -signal.SIGABRT:
        return 1
    return 2


def order_deaths(deaths: list[Death]) -> list[Death]:
    """Deaths, cause first: by the round they were seen in, then a kill before an exit, then by name."""
    return sorted(deaths, key=lambda d: (d.seen_order, _signal_rank(d), d.component != "capture", d.rank))


def first_cause(ordered: list[Death]) -> Death:
    """The cause to name, from deaths ordered by :func:`order_deaths`: the first, or, when other ranks of
    its component refused with its very words (every rank refuses a corrupt checkpoint together, and
    which exit is seen first is a race), the lowest of them: rank 0's refusal is the one the console
    shows."""
    first = ordered[0]
    if not first.refused():
        return first
    same = [d for d in ordered if d.component == first.component and d.refused() and same_reason(d, first)]
    return min(same, key=lambda d: d.rank)


def same_reason(a: Death, b: Death) -> bool:
    """Whether two tasks refused for the same reason: their words equal but for the numbers in them (every
    rank's disk-full line names its own free bytes)."""
    return re.sub(r"\d+", "N", a.reason()) == re.sub(r"\d+", "N", b.reason())


def last_words(log_path: Path) -> str:
    """The last error line in the end of a task's log (a logged ERROR or an exception's last line)."""
    try:
        with log_path.open("rb") as handle:
            handle.seek(max(0, log_path.stat().st_size - LAST_WORDS_BYTES))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    found = [line.strip() for line in text.splitlines() if _ERROR_LINE.search(line.strip())]
    if not found:
        return ""
    line = _LOG_PREFIX.sub("", found[-1])
    return line if len(line) <= LAST_WORDS_CHARS else line[: LAST_WORDS_CHARS - 4] + " ..."


def claim_first_death(job_dir: Path, death: Death) -> Death:
    """Record ``death`` as the job's first unless one is recorded already; returns the first (ours or
    the earlier one). Creating the file is exclusive, so of several tasks only one can win."""
    path = job_dir / FIRST_DEATH_FILENAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return read_first_death(job_dir) or death
    except OSError:
        return death  # a full or read-only job folder: this task cannot tell, it names itself
    with os.fdopen(fd, "w") as handle, contextlib.suppress(OSError):
        handle.write(json.dumps(asdict(death)) + "\n")
    return death


def read_first_death(job_dir: Path) -> Death | None:
    """The recorded first death of a job, if any (None while the record is being written)."""
    try:
        return Death(**json.loads((job_dir / FIRST_DEATH_FILENAME).read_text()))
    except (OSError, ValueError, TypeError):
        return None
