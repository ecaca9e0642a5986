"""How often a launcher command's call path crosses between rooms of the repository.

    python3 -m tools.room_walk [--rooms launcher,runtime.recipe,runtime.shared] [--edges] -- kimi_k3_v1c --plan

Runs ``launcher.cli.main`` on the arguments after ``--`` (its output is discarded) with a profile
hook, and counts every call of a Python function whose nearest repository caller sits in another
room. A room is the longest of ``--rooms`` that prefixes a function's module; functions outside
every room (third-party code, the standard library, other repository modules) are stepped over, so
``launcher.plan`` -> pydantic -> ``runtime.recipe.schema`` is one crossing. Code that runs while a
module is imported (module and class bodies, and whatever they call) is not counted: it is the cost
of an import, not of the walk.

The result is four numbers: cross-room calls (every call counted; each returns, so the walk
changes room twice as often), distinct cross-room function edges (caller function -> callee
function), distinct cross-room module edges (caller module -> callee module), and the most room
changes on one call stack (``launcher`` -> ``runtime.shared`` -> ``runtime.recipe`` is 2: a call
path that bounces). ``--edges`` lists the module edges and the function edges in the order they
were first taken.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from runtime.user_errors import exit_without_package

DEFAULT_ROOMS = ("launcher", "runtime.recipe", "runtime.shared")
CO_OPTIMIZED = 0x1
"""Set on the code of functions; unset on module and class bodies (import-time code)."""


@dataclass
class RoomWalk:
    """The cross-room calls seen while the profile hook was installed."""

    rooms: tuple[str, ...]
    edges: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(caller ``module:function``, callee ``module:function``) -> calls, in first-seen order."""
    deepest_stack_changes: int = 0
    """The most room changes seen on one call stack (repository frames in a room, innermost first)."""

    @property
    def crossings(self) -> int:
        """Every cross-room call."""
        return sum(self.edges.values())

    @property
    def module_edges(self) -> Counter[tuple[str, str]]:
        """(caller module, callee module) -> calls, in first-seen order."""
        modules: Counter[tuple[str, str]] = Counter()
        for (caller, callee), count in self.edges.items():
            modules[(caller.split(":")[0], callee.split(":")[0])] += count
        return modules

    def room_of(self, module: str) -> str | None:
        """The longest room that prefixes ``module``; None outside every room."""
        matches = [r for r in self.rooms if module == r or module.startswith(r + ".")]
        return max(matches, key=len) if matches else None

    def _frame_room(self, frame: FrameType) -> str | None:
        return self.room_of(str(frame.f_globals.get("__name__", "")))

    def profile(self, frame: FrameType, event: str, _arg: Any) -> None:
        """The ``sys.setprofile`` hook."""
        if event != "call" or not _is_function(frame.f_code):
            return
        callee_room = self._frame_room(frame)
        if callee_room is None:
            return
        caller = frame.f_back
        while caller is not None and self._frame_room(caller) is None:
            caller = caller.f_back
        if caller is None or not _is_function(caller.f_code):
            return
        caller_room = self._frame_room(caller)
        if caller_room != callee_room:
            self.edges[(_qualified(caller), _qualified(frame))] += 1
            self.deepest_stack_changes = max(self.deepest_stack_changes, self._stack_changes(frame))

    def _stack_changes(self, frame: FrameType) -> int:
        rooms = []
        at: FrameType | None = frame
        while at is not None:
            room = self._frame_room(at)
            if room is not None and (not rooms or rooms[-1] != room):
                rooms.append(room)
            at = at.f_back
        return len(rooms) - 1

    def render(self, list_edges: bool) -> str:
        """The summary line, and with ``list_edges`` one line per edge."""
        lines = [
            f"{self.crossings} cross-room calls, {len(self.edges)} distinct function edges, "
            f"{len(self.module_edges)} distinct module edges, at most {self.deepest_stack_changes} room changes on "
            f"one call stack (rooms: {', '.join(self.rooms)})"
        ]
        if list_edges:
            lines += [f"  module {a} -> {b}  x{count}" for (a, b), count in self.module_edges.items()]
            lines += [f"  {a} -> {b}  x{count}" for (a, b), count in self.edges.items()]
        return "\n".join(lines)


def _is_function(code: CodeType) -> bool:
    return bool(code.co_flags & CO_OPTIMIZED)


def _qualified(frame: FrameType) -> str:
    return f"{frame.f_globals.get('__name__', '?')}:{frame.f_code.co_qualname}"


def walk_launcher(argv: list[str], rooms: tuple[str, ...] = DEFAULT_ROOMS) -> tuple[RoomWalk, int, str]:
    """Run ``launcher.cli.main(argv)`` under the hook; returns the walk, the launcher's exit code and what
    it printed."""
    try:  # a stock python3 instead of the venv's: one line, not a traceback
        from launcher.cli import main
    except ModuleNotFoundError as missing:
        exit_without_package(missing, "tools.room_walk")

    walk = RoomWalk(rooms)
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        sys.setprofile(walk.profile)
        try:
            code = main(argv)
        finally:
            sys.setprofile(None)
    return walk, code, sink.getvalue()


WALK_DIR_ENV = "DSPARK_RECIPE_WALK_DIR"
"""Set (with ``tools/room_walk_site`` on PYTHONPATH) to record the recipe's walk in every process."""
STAYS_SUFFIX = ".recipe-walk.jsonl"


@dataclass(frozen=True)
class Stay:
    """One call of a repository function that received the whole recipe."""

    module: str
    """The room: the called function's module."""
    function: str
    above: tuple[str, ...]
    """The rooms of the stays on the call stack above this one, outermost first."""


def whole_recipe_types() -> tuple[type, ...]:
    """What counts as the whole recipe: the resolved and loaded recipe, its root, its top-level sections."""
    from runtime.recipe.loader import LoadedRecipe, ResolvedRecipe
    from runtime.recipe.schema import Recipe, top_level_sections

    return (ResolvedRecipe, LoadedRecipe, Recipe, *top_level_sections())


class RecipeFollower:
    """A profile hook that records every call of a ``runtime`` function (outside ``runtime.recipe``,
    whose own methods carry the recipe as ``self``) with the whole recipe among its arguments.

    Each stay is appended to ``sink`` as one JSON line at once: a process may leave by ``os._exit``."""

    def __init__(self, sink: io.TextIOBase | Any, main_module: str = "__main__") -> None:
        self.sink = sink
        self.main_module = main_module
        """The module ``python3 -m`` runs as ``__main__`` (the entry: a room too)."""
        self.types = whole_recipe_types()
        self.open_stays: dict[int, str] = {}
        """id(frame) -> room, for the stays still on a stack."""

    def profile(self, frame: FrameType, event: str, _arg: Any) -> None:
        """The ``sys.setprofile`` / ``threading.setprofile`` hook."""
        if event == "return":
            self.open_stays.pop(id(frame), None)
            return
        if event != "call" or not _is_function(frame.f_code):
            return
        module = str(frame.f_globals.get("__name__", ""))
        module = self.main_module if module == "__main__" else module
        if not module.startswith("runtime.") or module.startswith("runtime.recipe"):
            return
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        arguments = frame.f_locals  # a snapshot on this Python: take it once
        if not any(isinstance(arguments.get(name), self.types) for name in names):
            return
        above = []
        at = frame.f_back
        while at is not None:
            if id(at) in self.open_stays:
                above.append(self.open_stays[id(at)])
            at = at.f_back
        self.open_stays[id(frame)] = module
        line = {"module": module, "function": code.co_qualname, "above": above[::-1]}
        self.sink.write(json.dumps(line) + "\n")
        self.sink.flush()


def follow_recipe_in_this_process(walk_dir: Path) -> None:
    """Record this process's recipe walk into ``walk_dir/<pid>.recipe-walk.jsonl`` (every thread)."""
    walk_dir.mkdir(parents=True, exist_ok=True)
    argv = list(sys.orig_argv)
    entry = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else " ".join(argv[1:2])
    sink = (walk_dir / f"{os.getpid()}{STAYS_SUFFIX}").open("w")
    sink.write(json.dumps({"process": f"{entry} (pid {os.getpid()})", "argv": argv}) + "\n")
    sink.flush()
    follower = RecipeFollower(sink, main_module=entry)
    threading.setprofile(follower.profile)
    sys.setprofile(follower.profile)


@dataclass(frozen=True)
class RecipeWalk:
    """The recipe's walk through one process: its stays in the order taken."""

    process: str
    stays: tuple[Stay, ...]

    @property
    def rooms(self) -> list[str]:
        """The rooms entered, in first-entered order."""
        return list(dict.fromkeys(stay.module for stay in self.stays))

    @property
    def climbs_back_up(self) -> int:
        """Stays in a room that already holds the recipe higher on the same call stack (a part
        handing the recipe back up to a room that had handed it down)."""
        return sum(
            1 for stay in self.stays if stay.above and stay.module != stay.above[-1] and stay.module in stay.above
        )

    @property
    def returns(self) -> int:
        """Stays in a room the recipe had been in and left before."""
        seen: set[str] = set()
        count, previous = 0, None
        for stay in self.stays:
            if stay.module != previous and stay.module in seen:
                count += 1
            seen.add(stay.module)
            previous = stay.module
        return count

    def render(self) -> str:
        """One summary line, then the rooms in order."""
        return "\n".join(
            [
                f"{self.process}: {len(self.stays)} stays in {len(self.rooms)} rooms, "
                f"{self.climbs_back_up} climbs back up, {self.returns} returns to a room it had left",
                *(f"  {room}" for room in self.rooms),
            ]
        )


def read_recipe_walks(walk_dir: Path) -> list[RecipeWalk]:
    """The walks recorded in ``walk_dir`` by processes that received the recipe, by process."""
    walks = []
    for path in sorted(walk_dir.glob(f"*{STAYS_SUFFIX}")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if len(lines) > 1:
            stays = tuple(Stay(d["module"], d["function"], tuple(d["above"])) for d in lines[1:])
            walks.append(RecipeWalk(lines[0]["process"], stays))
    return walks


def main(argv: list[str] | None = None) -> int:
    """Command line: print the walk of one launcher command, or the recorded recipe walks."""
    parser = argparse.ArgumentParser(prog="python3 -m tools.room_walk", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rooms", default=",".join(DEFAULT_ROOMS), help="comma-separated module prefixes")
    parser.add_argument("--edges", action="store_true", help="list every distinct cross-room edge")
    parser.add_argument(
        "--recipe-walks",
        type=Path,
        metavar="DIR",
        help=f"print the recipe walks recorded in DIR (a run with {WALK_DIR_ENV}=DIR and "
        "PYTHONPATH=tools/room_walk_site) instead of walking a launcher command",
    )
    parser.add_argument("launcher_args", nargs=argparse.REMAINDER, help="-- then the launcher's arguments")
    args = parser.parse_args(argv)
    if args.recipe_walks is not None:
        walks = read_recipe_walks(args.recipe_walks)
        print("\n".join(walk.render() for walk in walks) or f"no recipe walk recorded in {args.recipe_walks}")
        return 0 if walks else 1
    launcher_args = args.launcher_args[1:] if args.launcher_args[:1] == ["--"] else args.launcher_args
    rooms = tuple(r for r in args.rooms.split(",") if r)
    unknown = [room for room in rooms if not _is_module(room)]
    if unknown:
        print(
            f"error: --rooms names no module of this repository: {', '.join(unknown)}; fix: give module prefixes such "
            f"as {','.join(DEFAULT_ROOMS)}",
            file=sys.stderr,
        )
        return 2
    walk, code, said = walk_launcher(launcher_args, rooms)
    print(walk.render(args.edges))
    if code:
        last = next((line for line in reversed(said.splitlines()) if line.strip()), "")
        print(f"the launcher exited with {code}{f': {last}' if last else ''}", file=sys.stderr)
    return code


def _is_module(name: str) -> bool:
    """Whether ``name`` is an importable module or package (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())
