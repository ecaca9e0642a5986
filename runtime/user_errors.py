"""One error path for every command an operator types (the launcher and the tools).

A refusal the product expects (a bad recipe, a missing file, a job that cannot be resumed) is raised
as a :class:`UserError` whose message names the file or the field, what is wrong and the fix. The
command's entry point runs under :func:`run_command`, which renders it once as ``error: ...`` on
stderr and returns exit code 2. Operating-system mistakes (a folder where a file is expected, no
permission, a full disk), Ctrl-C and a reader that went away (``... | head``) get the same one-line
treatment. Anything else is a bug and keeps its traceback.

Standard library only: the login-node launcher imports it.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable

EXIT_BAD_INPUT = 2
"""Exit code of a refused command (argparse uses the same for a bad flag)."""
EXIT_INTERRUPTED = 130
"""What a shell reports for a program stopped by Ctrl-C (128 + SIGINT)."""
EXIT_BROKEN_PIPE = 141
"""What a shell reports for a program whose reader went away (128 + SIGPIPE)."""


class UserError(Exception):
    """A refusal an operator can act on; its message names the file or field, the problem and the fix.

    Subclasses keep their own names (``RecipeError``, ``DataFileError``, ...) so code can catch one
    kind; every one of them is rendered by :func:`run_command` the same way."""


_OS_FIXES: dict[int, str] = {
    errno.ENOENT: "no such file or folder; fix: check the path (relative paths start at the current folder)",
    errno.EISDIR: "is a folder, where a file is expected; fix: give a file's path",
    errno.ENOTDIR: "a part of this path is a file, where a folder is expected; fix: check the path",
    errno.EACCES: "permission denied; fix: check its permissions (`ls -l`) or use a path you own",
    errno.EPERM: "operation not permitted; fix: check its permissions (`ls -l`) or use a path you own",
    errno.ENOSPC: "no space left on the device; fix: free space there or write somewhere else",
    errno.EDQUOT: "disk quota exceeded; fix: free space in your quota or write somewhere else",
    errno.EROFS: "read-only file system; fix: write somewhere else",
    errno.ENAMETOOLONG: "the name is too long for the file system; fix: use a shorter name",
    errno.EEXIST: "already exists (a file where a folder is wanted?); fix: check the path",
}


def describe_os_error(exc: OSError) -> str:
    """One line for an operating-system error: the path it concerns, what happened, the fix."""
    if type(exc).__str__ is not OSError.__str__:
        return str(exc)  # a subclass that words its own message (runtime.files.DiskFullError)
    # A rename's error names the temporary file first and the target second: the target is the one
    # an operator knows.
    where = exc.filename2 or exc.filename
    what = _OS_FIXES.get(exc.errno or -1) or f"{exc.strerror or exc}"
    return f"{where}: {what}" if where else what


def run_command(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a command's ``main`` and turn the expected failures into one line and an exit code."""
    try:
        code = main(argv)
        sys.stdout.flush()  # here, not at exit, so a reader that left is caught below
        return code
    except UserError as exc:
        _say(f"error: {exc}")
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        # Nothing more to say, and no traceback. Point stdout at /dev/null so the interpreter's final
        # flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        _say(f"error: {describe_os_error(exc)}")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _say("interrupted (Ctrl-C); files are written whole or not at all, so nothing is half-written")
        return EXIT_INTERRUPTED


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
