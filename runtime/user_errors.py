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
import re
import shlex
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

EXIT_BAD_INPUT = 2
"""Exit code of a refused command (argparse uses the same for a bad flag)."""
EXIT_INTERRUPTED = 130
"""What a shell reports for a program stopped by Ctrl-C (128 + SIGINT)."""
EXIT_BROKEN_PIPE = 141
"""What a shell reports for a program whose reader went away (128 + SIGPIPE)."""


SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
"""Environment names that hold credentials (WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...)."""

# A credential-looking variable given a literal value (``export WANDB_API_KEY=abc...``,
# ``HF_TOKEN="..."``, ``KEY+=abc``, ``--export=ALL,HF_TOKEN=...``) or a credential flag with one
# (``--api-key abc``, ``["--api-key", "abc"]``); a reference to the environment (``$HF_TOKEN``,
# ``${HF_TOKEN}``) is fine: it is resolved where the job runs, not written down. ``$'...'`` and ``$"..."``
# are quoted literals, not references.
_REFERENCE = r"(?![\"']?\$(?![\"']))"
"""A value that is not a reference to the environment (``$NAME``, ``${NAME}``)."""
_ASSIGNED = re.compile(
    r"(?:^|[\s;&|(,'\"])(?:export\s+|declare\s+(?:-\w+\s+)*|local\s+|readonly\s+)?([A-Za-z_][A-Za-z0-9_]*)\+?="
    r"(?![\s;,]|$)" + _REFERENCE + r"([^\s;,&|]*)"
)
# ``${NAME:=value}`` / ``${NAME:-value}`` (and without the colon): a default written down.
_DEFAULTED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*):?[-=]" + _REFERENCE + r"([^}]+)\}")
_FLAG = re.compile(
    r"--((?:[a-z0-9]+-)*(?:key|token|secret|password|passwd|pass)"
    r"(?:-(?!(?:env|file|stdin|cmd|command|path|name|id)\b)[a-z0-9]+)*)(?![a-z0-9-])"
    r"(?:=|\s+|[\"']?\s*,\s*)(?![\"']?\$(?![\"']))[\"']?([^\s\]\"',]+)",
    re.IGNORECASE,
)
"""A credential flag given a value: ``--api-key X``, ``--api-key=X``, ``["--api-key", "X"]`` (never a flag
that names where the key is: ``--api-key-env NAME``, ``--password-stdin``, ``--token-file PATH``)."""
# A short password flag given a value (``docker login -p X``, ``sshpass -p X``, ``mysql -pX``): only after
# the commands that read it so (``mkdir -p`` is no password).
_SHORT_PASSWORD = re.compile(
    r"\b(?:sshpass|mysql|mariadb|mysqldump|mysqladmin|(?:docker|podman|buildah|skopeo|nerdctl)\s+login"
    r"|(?:apptainer|singularity)\s+remote\s+login|helm\s+registry\s+login)\b[^;&|\n]*?\s(-p)(?:\s+|(?=[^\s-]))"
    + _REFERENCE
    + r"(\S+)"
)
# ``wandb login KEY`` / ``huggingface-cli login KEY`` and the like: a login command given a key.
_LOGIN_KEY = re.compile(
    r"\b((?:wandb|huggingface-cli|hf|comet|neptune)\s+login)(?:\s+--?[A-Za-z-]+(?:=\S+)?)*\s+"
    + _REFERENCE
    + r"([^\s;&|-]\S*)"
)
# An HTTP credential header (``Authorization: Bearer X``, ``Authorization: Basic X``, ``X-Api-Key: X``).
_AUTH_HEADER = re.compile(
    r"\b(Authorization|Proxy-Authorization|X-Api-Key|Api-Key|X-Auth-Token|Cookie)\s*:\s*"
    r"(?:(?:Bearer|Basic|Token|Digest)\s+)?" + _REFERENCE + r"([^\s\"']+)",
    re.IGNORECASE,
)
# Values shaped like the tokens of well-known services, wherever they appear (a description, a path).
_TOKEN_SHAPES = re.compile(
    r"(?<![A-Za-z0-9])(?:sk-[A-Za-z0-9_-]{20,}|[sr]k_(?:live|test)_[A-Za-z0-9]{8,}|hf_[A-Za-z0-9]{20,}"
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|AKIA[0-9A-Z]{16}|ASIA[0-9A-Z]{16}"
    r"|xox[abpr]-[A-Za-z0-9-]{10,}|glpat-[A-Za-z0-9_-]{20,}|AIza[0-9A-Za-z_-]{16,}|ya29\.[0-9A-Za-z_-]{20,}"
    r"|npm_[A-Za-z0-9]{20,}|pypi-[A-Za-z0-9_-]{20,}|eyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*)"
)
# A password in a URL: scheme://user:password@host (the password may hold any character but a space or a
# slash, an @ and a quote included: the last @ of the authority ends it).
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@'\"]*):([^/\s]+)@")
# curl/wget style ``-u user:password`` / ``--user=user:password``.
_USER_FLAG = re.compile(
    r"(?:^|\s)(-u|--user|--proxy-user)(?:=|\s+)" + _REFERENCE + r"([^\s:'\"]+:" + _REFERENCE + r"[^\s'\"]+)"
)
# A netrc entry (``machine api.wandb.ai login me password abc``, or ``password abc`` on a line of its own).
_NETRC_PASSWORD = re.compile(
    r"(?:\blogin\s+\S+\s+|(?:^|\n)\s*)(password|passwd)\s+" + _REFERENCE + r"(\S+)", re.IGNORECASE
)
# ``printf -v HF_TOKEN ...`` / ``read HF_TOKEN <<<`` assign a credential variable without ``=``.
_PRINTF_V = re.compile(r"\b(?:printf\s+-v|read(?:\s+-[a-z]+)*)\s+([A-Za-z_][A-Za-z0-9_]*)")
# A credential-named key of a mapping given a value (``{HF_TOKEN: abc}``, ``'HF_TOKEN': 'abc'``).
_MAPPED = re.compile(
    r"(?:^|[\s{,'\"])([A-Za-z_][A-Za-z0-9_-]*)['\"]?\s*:\s+['\"]?(?!\$|(?:Bearer|Basic|Token|Digest)\b|<redacted>)"
    r"([^\s,}'\"]+)"
)
# Writing a credential file (``printf KEY > ~/.wandb_key``, ``cat > ~/.netrc <<EOF``).
_CREDENTIAL_FILE = re.compile(r">>?\s*(\S*(?:netrc|[._-]key\b|token|credential|secret|passw)\S*)", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """Whether a variable or key name holds a credential (HF_TOKEN, WANDB_API_KEY). A lower-case name
    whose only credential word is ``token`` is a count or id of the model (``max_new_tokens``,
    ``stop_token_ids``), never a secret."""
    if not SECRET_NAME.search(name):
        return False
    return not (name.islower() and not SECRET_NAME.search(name.replace("token", "")))


def credentials_in(text: str) -> list[str]:
    """What in ``text`` writes a credential down: ``NAME`` of a credential variable given a literal value
    (``NAME=...``, ``NAME+=``, ``${NAME:=...}``, ``printf -v NAME``), ``--flag`` of a credential flag given
    one (in a command line or a list), a short password flag (``-p X``, ``-pX``), a login command's key, an
    HTTP credential header, a password in a URL, ``-u user:password``, a netrc password, a credential file
    written, or a value shaped like a token (JWT, ``sk-``, ``sk_live_``, ``AIza``, ``hf_``, ``ghp_``, ...).
    The one rule both the recipe's refusal and :func:`redact` follow."""
    found = [m.group(1) for m in _ASSIGNED.finditer(text) if is_secret_name(m.group(1))]
    found += [m.group(1) for m in _DEFAULTED.finditer(text) if is_secret_name(m.group(1))]
    found += [m.group(1) for m in _PRINTF_V.finditer(text) if is_secret_name(m.group(1))]
    found += [f"--{m.group(1)}" for m in _FLAG.finditer(text)]
    found += [f"a password flag ({m.group(1)})" for m in _SHORT_PASSWORD.finditer(text)]
    found += [f"a key given to `{' '.join(m.group(1).split())}`" for m in _LOGIN_KEY.finditer(text)]
    found += [f"an {m.group(1)} header" for m in _AUTH_HEADER.finditer(text)]
    found += ["a password in a URL (user:password@)" for _ in _URL_PASSWORD.finditer(text)]
    found += [f"{m.group(1)} user:password" for m in _USER_FLAG.finditer(text)]
    found += ["a netrc password" for _ in _NETRC_PASSWORD.finditer(text)]
    found += [f"a credential file ({m.group(1)})" for m in _CREDENTIAL_FILE.finditer(text)]
    found += [f"a token shaped like {m.group(0)[:3]}..." for m in _TOKEN_SHAPES.finditer(text)]
    return found


def shell_word(value: str) -> str:
    """``value`` as one shell word that expands to itself: the one quoting function for every value
    the launcher writes into a batch script and every command a message prints (plain words stay
    as they are).

    A control character cannot be made safe on one script line (a newline starts a new command or
    ``#SBATCH`` line): the recipe schema refuses those at load time, and this refuses them again."""
    if re.search(r"[\x00-\x08\x0a-\x1f\x7f\x85\u2028\u2029\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]", value):
        raise ValueError(f"{value!r} holds a control character; it cannot go into a batch script line")
    return shlex.quote(value)


REDACTED = "<redacted>"


def redact(text: str) -> str:
    """``text`` with every credential it writes down replaced by ``<redacted>``: the one redaction of
    every message and every file the launcher and the tools write (names stay, values go). It follows
    :func:`credentials_in`'s rule."""

    def value_of(group: int) -> Callable[[re.Match[str]], str]:
        def hide(m: re.Match[str]) -> str:
            if not m.group(group):
                return m.group(0)
            return m.group(0)[: m.start(group) - m.start(0)] + REDACTED + m.group(0)[m.end(group) - m.start(0) :]

        return hide

    def secret_value(m: re.Match[str]) -> str:
        return value_of(2)(m) if is_secret_name(m.group(1)) else m.group(0)

    text = _URL_PASSWORD.sub(lambda m: f"{m.group(1)}:{REDACTED}@", text)
    text = _TOKEN_SHAPES.sub(REDACTED, text)
    text = _USER_FLAG.sub(value_of(2), text)
    text = _NETRC_PASSWORD.sub(value_of(2), text)
    text = _AUTH_HEADER.sub(value_of(2), text)
    text = _SHORT_PASSWORD.sub(value_of(2), text)
    text = _LOGIN_KEY.sub(value_of(2), text)
    text = _DEFAULTED.sub(secret_value, text)
    text = _ASSIGNED.sub(secret_value, text)
    text = _MAPPED.sub(secret_value, text)
    return _FLAG.sub(value_of(2), text)


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


def file_kind_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as a file, without opening it (a FIFO would block an ``open`` for
    ever): None for a regular file (or a link to one) and for a path that does not exist (the caller's
    own message says what is missing); else a short phrase: a folder, a FIFO, a device, a socket, a
    symbolic-link loop or a link to nothing."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a symbolic link to nothing" if os.path.islink(path) else None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic-link loop"
        raise
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def require_regular_file(path: Path, what: str, fix: str) -> Path:
    """``path`` when it is a regular file (or does not exist: the caller reports that); otherwise a
    :class:`UserError` naming ``what`` (``"recipe file"``), the kind found and ``fix``. Call it before
    opening anything a user names: reading a FIFO waits for a writer for ever."""
    kind = file_kind_problem(path)
    if kind is not None:
        raise UserError(f"{what} {path} is {kind}, not a regular file; fix: {fix}")
    return path


CHECKOUT = Path(__file__).resolve().parent.parent
"""The repository checkout this code runs from."""
CHECKED_IN_FOLDERS = (".ci", ".git", "launcher", "patches", "recipes", "runtime", "sbatch", "tests", "tools")
"""Folders of the checkout that hold only what is checked in: no run, tool or test output goes there
(``render`` alone writes ``sbatch/``, by its own path)."""


def _checked_in_file(path: Path) -> bool:
    """Whether ``path`` (inside the checkout, outside its checked-in folders) is a checked-in file: any
    file directly in the checkout's root is (README.md, RUNBOOK.md, pyproject.toml, .gitignore); what
    runs write lives in folders of their own (runs/, .cache/)."""
    return path.parent == CHECKOUT


def write_place_problem(path: Path, *, within: Path | None = None) -> str | None:
    """Why nothing may be written at ``path`` (a folder or file a command was given or made), or None: the
    filesystem root or a home folder itself; ``~`` where HOME is empty (it would mean the root); the
    checkout itself, its checked-in folders (:data:`CHECKED_IN_FOLDERS`) or a checked-in file; with
    ``within``, outside ``within``. Symbolic links are resolved first."""
    if str(path).startswith("~") and os.environ.get("HOME", None) == "":
        return "starts with ~, but HOME is empty here, so it would mean the filesystem root"
    resolved = path.expanduser().resolve()
    link = f" ({path} is a symbolic link to it)" if resolved != path.expanduser().absolute() else ""
    if resolved == Path(resolved.anchor):
        return f"is the filesystem root{link}"
    home = os.path.expanduser("~")  # with HOME set but empty this is "", not a folder: compare no cwd to it
    if (home not in ("", "~") and resolved == Path(home).resolve()) or (
        resolved.parent.name == "home" and resolved.parent.parent == Path("/")
    ):
        return f"is a home folder itself{link}"
    if resolved == CHECKOUT:
        return f"is the repository itself{link}"
    if CHECKOUT in resolved.parents:
        top = resolved.relative_to(CHECKOUT).parts[0]
        if top in CHECKED_IN_FOLDERS:
            return f"is in the checkout's checked-in folder {top}/{link}"
        if resolved.exists() and not resolved.is_dir() and _checked_in_file(resolved):
            return f"is a checked-in file of the repository{link}"
    if within is not None:
        place = within.expanduser().resolve()
        if resolved != place and place not in resolved.parents:
            return f"resolves to {resolved}{link}, outside {place} where it belongs"
    return None


def output_place(path: Path, what: str, *, within: Path | None = None, fix: str = "give another path") -> Path:
    """The one rule for where a command may write (:func:`write_place_problem`), applied before the first
    byte: refused with one line naming ``what``, the path and ``fix``. Returns the resolved path, which the
    caller then writes to."""
    problem = write_place_problem(path, within=within)
    if problem:
        raise UserError(f"{what} {path} {problem}: nothing is written there; fix: {fix}")
    return path.expanduser().resolve()


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
    for stream in (sys.stdout, sys.stderr):  # a terminal that cannot show a character gets it escaped
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    try:
        code = main(argv)
        sys.stdout.flush()  # here, not at exit, so a reader that left is caught below
        return code
    except UserError as exc:
        _say(f"error: {redact(str(exc))}")
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        # Nothing more to say, and no traceback. Point stdout at /dev/null so the interpreter's final
        # flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        _say(f"error: {redact(describe_os_error(exc))}")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _say("interrupted (Ctrl-C); files are written whole or not at all, so nothing is half-written")
        return EXIT_INTERRUPTED


def exit_without_package(exc: ModuleNotFoundError, command: str) -> NoReturn:
    """A ``python3 -m`` entry run by an interpreter without the project's packages (a stock python3
    instead of the venv's): one line naming the interpreter, the package and the fix, exit 2. A missing
    module of this repository is a real error and is raised as it is."""
    package = (exc.name or "").split(".")[0]
    if not package or package in ("launcher", "runtime", "tools", "tests"):
        raise exc
    print(
        f"error: {sys.executable} lacks the package {package!r} that `python3 -m {command}` needs: run it with the "
        f"project venv's python (`.venv/bin/python3 -m {command} ...`, or `source .venv/bin/activate` first); "
        "`tools/bootstrap` makes the venv",
        file=sys.stderr,
    )
    raise SystemExit(2)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
