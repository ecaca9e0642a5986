"""The house rules of the layout, checked on the import graph.

Every Python file of launcher/, runtime/, tools/ (scripts without a suffix too) and tests/ is parsed
with ``ast``; every import counts, at module level or inside a function (a lazy import still runs on
the login node or closes a cycle), except those under ``if TYPE_CHECKING:``. The rules:

- launcher/ never reaches torch, directly or through the repo modules it imports;
- the light shared layer (runtime/shared, runtime/recipe, and the ground floor runtime/files.py)
  never reaches torch and imports nothing else of runtime/;
- the ground floor (runtime/files.py: atomic writes, used by every room) imports nothing of the
  repository;
- runtime/ imports neither launcher/, tools/ nor tests/; launcher/ does not import tools/ or tests/;
- runtime/transport imports neither capture nor trainer; runtime/moe and runtime/trainer do not
  import capture;
- tools/ (benchmarks included) does not import tests/;
- within the light layer runtime/recipe is the lower floor: runtime/shared imports it, never the reverse;
  within runtime/recipe the fit and throughput model (runtime/recipe/fit) is below the checks and the
  loader, which call it;
- the planning walk (``launcher kimi_k3_v1c --plan`` under tools/room_walk) runs down once: from the
  launcher into runtime/recipe, never on into runtime/shared and back;
- the light layer holds no patching: it imports neither ``zipfile`` (unpacking wheels) nor
  ``py_compile`` (byte-compiling), and runs no program (pip, GNU patch) but one: the SGLang patch
  check asks another interpreter where its ``sglang`` lives;
- runtime/sglang_patching (download, apply, regenerate) is imported only by the launcher's pre-flight
  check of the pinned wheel, the tools and the tests: no other runtime room;
- runtime/evaluate (the speculative decoder that judges a draft) may import capture and trainer, but
  no other runtime room imports it, and the launcher only starts it as a program;
- only runtime/transport/liveness.py reads or writes the producer's heartbeat object (its key and record);
- only runtime/transport/settings.py reads the recipe for the transport's components (the doors load a
  resolved recipe and hand it there), and it reaches no torch (the master's command line starts without);
- the recipe stops at each component's door: in the rooms of :data:`RECIPE_STOPS_AT_THE_DOOR` only the
  modules :data:`RECIPE_DOORS` names (process entries, setup modules, test doors) import the recipe
  types (``Recipe``, ``ResolvedRecipe``, the loader, the schema's sections), annotations included;
- no import cycle among repo modules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from runtime.recipe.schema import top_level_sections
from tests.conftest import REPO_ROOT

ROOTS = ("launcher", "runtime", "tools", "tests")
HEAVY = ("torch",)
"""Third-party packages the launcher and the light layer must never reach."""
GROUND_FLOOR = ("runtime.files", "runtime.user_errors")
"""Modules every room may import; they import nothing of the repository."""
LIGHT_LAYER = ("runtime.shared", "runtime.recipe", *GROUND_FLOOR)

PATCHING_MODULES = ("zipfile", "py_compile", "subprocess")
"""Standard-library modules of patching (unpacking the wheel, byte-compiling, running pip and GNU patch)."""
LIGHT_PROGRAM_RUNNERS = {"runtime.shared.sglang_patch_check": "subprocess"}
"""The light modules allowed one of :data:`PATCHING_MODULES`: the check probes another interpreter."""
PATCHING_ROOM = "runtime.sglang_patching"
PATCHING_IMPORTERS = ("launcher.gate", "tools", "tests", PATCHING_ROOM)
"""Who may import :data:`PATCHING_ROOM`: the pre-flight check of the pinned wheel, tools, tests."""

EVALUATE_ROOM = "runtime.evaluate"
"""The draft evaluation: a top room of runtime (it reads capture and trainer; nothing imports it)."""

FORBIDDEN: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("runtime", ("launcher", "tools", "tests"), "runtime/ runs in the allocation and imports only runtime/"),
    ("launcher", ("tools", "tests"), "tools/ are command-line wrappers: nothing imports them"),
    ("runtime.transport", ("runtime.capture", "runtime.trainer"), "transport knows nothing of capture or trainer"),
    ("runtime.moe", ("runtime.capture",), "moe knows nothing of engines"),
    ("runtime.trainer", ("runtime.capture",), "the trainer never knows which engine produced a sample"),
    ("tools", ("tests",), "tools (benchmarks too) do not depend on the test suite"),
    (
        "runtime.recipe",
        ("runtime.shared",),
        "the recipe (schema, loader, checks, fit model) is the light layer's lower floor: shared builds on it, never the reverse",
    ),
    (
        "runtime.recipe.fit",
        ("runtime.recipe.checks", "runtime.recipe.loader"),
        "the fit and throughput model sits below the checks and the loader: they call it, it never calls them",
    ),
)
"""(importer prefix, imported prefixes, why)."""


@dataclass
class Module:
    """One repo module and what it imports."""

    name: str
    path: Path
    repo_imports: dict[str, int] = field(default_factory=dict)
    """Imported repo module -> line of the first import."""
    external: dict[str, int] = field(default_factory=dict)
    """Imported top-level third-party package -> line."""


def _is_python(path: Path) -> bool:
    """A ``.py`` file, or a script without a suffix whose shebang names python."""
    if path.suffix == ".py":
        return True
    if path.suffix or not path.is_file():
        return False
    with path.open("rb") as handle:
        first = handle.readline()
    return first.startswith(b"#!") and b"python" in first


def module_name(path: Path, repo_root: Path) -> str:
    """``runtime/shared/contracts.py`` -> ``runtime.shared.contracts``; a package's ``__init__``
    is the package; a script ``tools/check_patch`` is ``tools.check_patch``."""
    parts = list(path.relative_to(repo_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines inside ``if TYPE_CHECKING:`` blocks (imports there never run)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, int]]:
    skipped = _type_checking_lines(tree)
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno  # a submodule, or a name in ``base``
            yield base, node.lineno


def build_graph(repo_root: Path = REPO_ROOT) -> dict[str, Module]:
    """Every repo module with its repo and third-party imports."""
    paths = [p for root in ROOTS for p in sorted((repo_root / root).rglob("*")) if _is_python(p)]
    paths = [p for p in paths if "fixtures" not in p.parts and "__pycache__" not in p.parts]
    modules = {module_name(p, repo_root): Module(module_name(p, repo_root), p) for p in paths}
    for module in modules.values():
        tree = ast.parse(module.path.read_text(), filename=str(module.path))
        is_package = module.path.name == "__init__.py"
        for name, line in _imported_names(tree, module.name, is_package):
            top = name.split(".")[0]
            if top in ROOTS or top == "conftest":
                target = "tests.conftest" if name.split(".")[0] == "conftest" else name
                if target in modules and target != module.name:
                    module.repo_imports.setdefault(target, line)
            elif top:
                module.external.setdefault(top, line)
    return modules


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _packages_of(name: str, modules: dict[str, Module]) -> list[str]:
    """The package ``__init__`` modules importing ``name`` runs first."""
    parts = name.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in modules]


def heavy_paths(start: str, modules: dict[str, Module]) -> list[str]:
    """The shortest import chain from ``start`` to a heavy package (through parent packages too),
    as ``a -> b -> torch (line N of b.py)``; empty when none is reached."""
    seen = {start}
    queue: list[list[str]] = [[start]]
    while queue:
        chain = queue.pop(0)
        module = modules[chain[-1]]
        for heavy in HEAVY:
            if heavy in module.external:
                return [" -> ".join([*chain, heavy]) + f" (line {module.external[heavy]} of {module.path.name})"]
        for target in [*module.repo_imports, *_packages_of(chain[-1], modules)]:
            for step in [*_packages_of(target, modules), target]:
                if step not in seen:
                    seen.add(step)
                    queue.append([*chain, step])
    return []


def arrow_violations(modules: dict[str, Module], repo_root: Path = REPO_ROOT) -> list[str]:
    """Every import that breaks one of :data:`FORBIDDEN`."""
    problems = []
    for module in modules.values():
        for importer, banned, why in FORBIDDEN:
            if not _within(module.name, importer):
                continue
            for target, line in module.repo_imports.items():
                if any(_within(target, b) for b in banned) and not _within(target, importer):
                    problems.append(f"{module.path.relative_to(repo_root)}:{line} imports {target}: {why}")
    return problems


def import_cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(name: str) -> None:
        nonlocal counter
        index[name] = low[name] = counter
        counter += 1
        stack.append(name)
        on_stack.add(name)
        for target in modules[name].repo_imports:
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in on_stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == name:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for name in sorted(modules):
        if name not in index:
            visit(name)
    return cycles


def test_the_graph_sees_the_repository() -> None:
    modules = build_graph()
    assert {"launcher.cli", "runtime.shared.contracts", "runtime.trainer.loop", "tools.patch_check"} <= set(modules)
    assert "runtime.shared.contracts" in modules["runtime.trainer.loop"].repo_imports
    assert "torch" in modules["runtime.trainer.loop"].external


def test_launcher_never_reaches_torch() -> None:
    modules = build_graph()
    chains = [c for name in modules if _within(name, "launcher") for c in heavy_paths(name, modules)]
    assert not chains, "the launcher must start without torch:\n" + "\n".join(chains)


def test_the_light_layer_reaches_neither_torch_nor_the_rest_of_runtime() -> None:
    modules = build_graph()
    light = [name for name in modules if any(_within(name, p) for p in LIGHT_LAYER)]
    chains = [c for name in light for c in heavy_paths(name, modules)]
    assert not chains, "runtime/shared and runtime/recipe stay torch-free:\n" + "\n".join(chains)
    inward = [
        f"{name} imports {target}"
        for name in light
        for target in modules[name].repo_imports
        if not any(_within(target, p) for p in LIGHT_LAYER) and _within(target, "runtime") and target != "runtime"
    ]
    assert not inward, "the light layer imports only itself:\n" + "\n".join(inward)


def patching_in_the_light_layer(modules: dict[str, Module], repo_root: Path = REPO_ROOT) -> list[str]:
    """Every import of :data:`PATCHING_MODULES` in the light layer that :data:`LIGHT_PROGRAM_RUNNERS`
    does not allow."""
    return [
        f"{module.path.relative_to(repo_root)}:{line} imports {name}"
        for module in modules.values()
        if any(_within(module.name, p) for p in LIGHT_LAYER)
        for name, line in module.external.items()
        if name in PATCHING_MODULES and LIGHT_PROGRAM_RUNNERS.get(module.name) != name
    ]


def patching_importers(modules: dict[str, Module], repo_root: Path = REPO_ROOT) -> list[str]:
    """Every import of :data:`PATCHING_ROOM` from outside :data:`PATCHING_IMPORTERS`."""
    return [
        f"{module.path.relative_to(repo_root)}:{line} imports {target}"
        for module in modules.values()
        if not any(_within(module.name, p) for p in PATCHING_IMPORTERS)
        for target, line in module.repo_imports.items()
        if _within(target, PATCHING_ROOM)
    ]


def test_the_light_layer_holds_no_patching() -> None:
    modules = build_graph()
    problems = patching_in_the_light_layer(modules)
    assert not problems, "download/apply/regenerate belong to runtime/sglang_patching:\n" + "\n".join(problems)
    assert all(runner in modules for runner in LIGHT_PROGRAM_RUNNERS)


def test_only_the_gate_and_the_tools_import_the_patching() -> None:
    modules = build_graph()
    assert PATCHING_ROOM in modules
    problems = patching_importers(modules)
    assert not problems, "the capture engine and the light layer only check the patch:\n" + "\n".join(problems)
    chains = heavy_paths(PATCHING_ROOM + ".regenerate", modules) + heavy_paths(PATCHING_ROOM + ".pinned_wheel", modules)
    assert not chains, "the patching runs on login nodes without torch:\n" + "\n".join(chains)


EVALUATE_TIMERS = ("tools.bench.speedup",)
"""Benchmarks that time the evaluation's own decoders (nothing imports them either)."""


def evaluate_importers(modules: dict[str, Module], repo_root: Path = REPO_ROOT) -> list[str]:
    """Every import of :data:`EVALUATE_ROOM` from outside it (the tests and :data:`EVALUATE_TIMERS` excepted)."""
    return [
        f"{module.path.relative_to(repo_root)}:{line} imports {target}"
        for module in modules.values()
        if not _within(module.name, EVALUATE_ROOM)
        and not _within(module.name, "tests")
        and module.name not in EVALUATE_TIMERS
        for target, line in module.repo_imports.items()
        if _within(target, EVALUATE_ROOM)
    ]


def test_nothing_imports_the_evaluation() -> None:
    modules = build_graph()
    assert EVALUATE_ROOM + ".decoder" in modules
    problems = evaluate_importers(modules)
    assert not problems, "the evaluation is run as a program (python3 -m runtime.evaluate):\n" + "\n".join(problems)


def test_the_ground_floor_imports_nothing_of_the_repository() -> None:
    modules = build_graph()
    assert all(name in modules for name in GROUND_FLOOR)
    upward = [f"{name} imports {target}" for name in GROUND_FLOOR for target in modules[name].repo_imports]
    assert not upward, "the ground floor stands on nothing of the repository:\n" + "\n".join(upward)


def test_temporary_file_and_rename_are_written_in_one_place() -> None:
    """Files are written atomically through runtime/files.py; a hand-written temp-file-and-rename of a
    file elsewhere is a second way to do it (folders and symlinks are renamed where they are made)."""
    allowed = {"runtime/files.py", "runtime/trainer/export.py", "runtime/trainer/checkpoints.py", "launcher/jobs.py"}
    allowed |= {"tools/slurm_local_impl/cluster.py", "tools/slurm_local_impl/hosts_file.py", "tools/tiny_target.py"}
    found = []
    for root in ("launcher", "runtime", "tools"):
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            relative = str(path.relative_to(REPO_ROOT))
            if relative not in allowed and "os.replace(" in path.read_text():
                found.append(relative)
    assert not found, "write through runtime.files (atomic_write_text / atomic_path) instead:\n" + "\n".join(found)


HEARTBEAT_NAMES = ("heartbeat_key", "Heartbeat")
"""The heartbeat's store key and record: what a module needs to read or write the object itself."""
HEARTBEAT_OWNER = "runtime.transport.liveness"


def heartbeat_users(repo_root: Path = REPO_ROOT) -> list[str]:
    """Imports of the heartbeat's key or record in runtime/, outside the liveness module and the
    contract that names the key (imports under ``if TYPE_CHECKING:`` do not count)."""
    found = []
    for path in sorted((repo_root / "runtime").rglob("*.py")):
        name = module_name(path, repo_root)
        if name in (HEARTBEAT_OWNER, "runtime.shared.contracts"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_lines(tree)  # a type in an annotation reads nothing
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.lineno in skipped:
                continue
            for alias in node.names:
                if alias.name in HEARTBEAT_NAMES:
                    found.append(f"{path.relative_to(repo_root)}:{node.lineno} imports {node.module}.{alias.name}")
    return found


def test_only_the_liveness_module_reads_or_writes_the_heartbeat() -> None:
    """Placement (rank 0's segment, fallback, moves) and aging on the reader's clock live in one
    module: a second reader or writer would bypass them."""
    users = heartbeat_users()
    assert not users, f"read or write the heartbeat through {HEARTBEAT_OWNER}:\n" + "\n".join(users)


TRANSPORT_SETTINGS = "runtime.transport.settings"
"""The one module of runtime/transport that reads the recipe (schema, checks, sizes)."""


def recipe_readers_in_transport(modules: dict[str, Module]) -> list[str]:
    """Modules of runtime/transport, other than its settings module, that import more of
    runtime/recipe than the loader (which the doors use to load a resolved recipe)."""
    return [
        f"{module.path.name} imports {target}"
        for module in modules.values()
        if _within(module.name, "runtime.transport") and module.name != TRANSPORT_SETTINGS
        for target in module.repo_imports
        if _within(target, "runtime.recipe")
        and not _within(target, "runtime.recipe.loader")
        and target != "runtime.recipe"
    ]


def test_only_the_transport_settings_read_the_recipe() -> None:
    """Each transport component takes its own typed settings, built once from the recipe in one place."""
    modules = build_graph()
    readers = recipe_readers_in_transport(modules)
    assert not readers, f"build the settings in {TRANSPORT_SETTINGS} and pass them:\n" + "\n".join(readers)
    assert not heavy_paths(TRANSPORT_SETTINGS, modules), heavy_paths(TRANSPORT_SETTINGS, modules)


RECIPE_LOADER = "runtime.recipe.loader"
"""Everything here is the whole recipe: ``ResolvedRecipe``, ``LoadedRecipe`` and their loading."""
RECIPE_SCHEMA = "runtime.recipe.schema"
WHOLE_RECIPE_SECTIONS = frozenset({"Recipe", *(section.__name__ for section in top_level_sections())})
"""The schema's root and its top-level sections: each holds the settings of many parts. The leaf
sections (``DraftConfig``, ``ScheduleConfig``, ``MetricsConfig``, ...) are one part's own frozen
settings, and a part may take its own (see :func:`test_a_recipe_section_is_frozen`)."""
RECIPE_TYPE_NAMES = WHOLE_RECIPE_SECTIONS | {
    "ResolvedRecipe",
    "LoadedRecipe",
    "load_recipe",
    "load_resolved",
    "write_resolved",
}
"""The whole-recipe types as the ``runtime.recipe`` package re-exports them."""
RECIPE_STOPS_AT_THE_DOOR = (
    "runtime.capture",
    "runtime.transport",
    "runtime.probe",
    "runtime.moe",
    "runtime.trainer",
    "runtime.evaluate",
)
"""Rooms whose parts take their own frozen settings (or their own leaf section), never the recipe."""
RECIPE_DOORS = {
    "runtime.capture.__main__": "the capture's process entry: loads the resolved recipe",
    "runtime.capture.setup": "capture_setup / sink_setup / expert_streaming_plan: the capture's settings, built once",
    "runtime.capture.sglang_cpu": "a door for tests and tools: a CPU SGLang server on a loopback recipe",
    "runtime.transport.settings": "TransportSettings.from_recipe: the transport's settings, built once per entry",
    "runtime.transport.__main__": "the transport's command line: loads the resolved recipe",
    "runtime.transport.synthetic": "a process entry: the synthetic producer and trainer of the transport tests",
    "runtime.transport.loopback": "a door for tests and tools: a loopback recipe, master and environment",
    "runtime.probe.__main__": "the probe's process entry: loads the resolved recipe",
    "runtime.trainer.__main__": "the trainer's process entry: loads the resolved recipe",
    "runtime.trainer.setup": "trainer_setup: the trainer's settings (run, source, gate, checkpoints), built once",
    "runtime.trainer.draft_spec": "DraftSpec.from_recipe: the draft's shape, built once by each entry",
    "runtime.evaluate.__main__": "the evaluation's process entry: loads the resolved recipe and its eval section",
    "runtime.evaluate.setup": "eval_setup: the evaluation's settings, built once",
    "runtime.evaluate.during_training": "the process entry of the acceptance during training: loads the resolved recipe",
}
"""Modules of :data:`RECIPE_STOPS_AT_THE_DOOR` allowed the recipe types, each with why."""


def recipe_type_imports(path: Path) -> list[tuple[int, str]]:
    """(line, what) for every import of a recipe type in ``path`` (``TYPE_CHECKING`` ones too: a
    part whose signature names the recipe takes the recipe)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name in (RECIPE_LOADER, RECIPE_SCHEMA)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            whole = (
                [a.name for a in node.names]
                if node.module == RECIPE_LOADER
                else [a.name for a in node.names if a.name in RECIPE_TYPE_NAMES]
                if node.module in (RECIPE_SCHEMA, "runtime.recipe")
                else []
            )
            found += [(node.lineno, f"{node.module}.{name}") for name in whole]
    return found


def test_a_recipe_section_is_frozen() -> None:
    """A part that takes its own leaf section of the recipe cannot change it under another part."""
    import pydantic

    from runtime.recipe import load_recipe

    draft = load_recipe(REPO_ROOT / "recipes" / "tiny.yaml").recipe.trainer.draft
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        draft.num_layers = draft.num_layers + 1


def recipe_past_the_door(repo_root: Path = REPO_ROOT) -> list[str]:
    """Imports of the recipe types in :data:`RECIPE_STOPS_AT_THE_DOOR` outside :data:`RECIPE_DOORS`."""
    problems = []
    for path in sorted((repo_root / "runtime").rglob("*.py")):
        name = module_name(path, repo_root)
        if name in RECIPE_DOORS or not any(_within(name, room) for room in RECIPE_STOPS_AT_THE_DOOR):
            continue
        problems += [f"{path.relative_to(repo_root)}:{line} imports {what}" for line, what in recipe_type_imports(path)]
    return problems


def test_the_recipe_stops_at_each_components_door() -> None:
    """Each process entry reads the resolved recipe once and builds its parts' typed settings in its
    setup module; below it no module takes the recipe."""
    modules = build_graph()
    assert all(door in modules for door in RECIPE_DOORS), sorted(set(RECIPE_DOORS) - set(modules))
    problems = recipe_past_the_door()
    assert not problems, "build the part's settings in the component's setup and pass them:\n" + "\n".join(problems)


def test_no_forbidden_arrows() -> None:
    problems = arrow_violations(build_graph())
    assert not problems, "imports against the layout:\n" + "\n".join(problems)


def test_the_planning_walk_runs_down_once() -> None:
    """``--plan`` calls from the launcher into runtime/recipe (the fit model) and returns: no call
    path bounces on into runtime/shared and back (measured with tools/room_walk)."""
    from tools.room_walk import walk_launcher

    walk, code, _ = walk_launcher(["kimi_k3_v1c", "--plan"])
    assert code == 0
    assert walk.deepest_stack_changes == 1, walk.render(list_edges=True)
    into_shared = [edge for edge in walk.module_edges if walk.room_of(edge[1]) == "runtime.shared"]
    assert not into_shared, walk.render(list_edges=True)


def test_no_import_cycles() -> None:
    cycles = import_cycles(build_graph())
    assert not cycles, "import cycles among repo modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checks_catch_planted_violations(tmp_path: Path) -> None:
    """The rules fail on a small tree that breaks each of them (so a green run means something)."""
    files = {
        "launcher/__init__.py": "",
        "launcher/cli.py": "from runtime.shared import helper\n",
        "runtime/__init__.py": "",
        "runtime/shared/__init__.py": "",
        "runtime/shared/helper.py": "import zipfile\ndef f():\n    import runtime.capture.engine\n",
        "runtime/recipe/__init__.py": "",
        "runtime/recipe/checks.py": "",
        "runtime/recipe/fit/__init__.py": "",
        "runtime/recipe/fit/model.py": "from runtime.recipe import checks\n",
        "runtime/sglang_patching/__init__.py": "",
        "runtime/sglang_patching/tree.py": "import subprocess\n",
        "runtime/capture/__init__.py": "",
        "runtime/capture/engine.py": "import torch\nfrom runtime.moe import loader\nfrom runtime.sglang_patching import tree\n",
        "runtime/evaluate/__init__.py": "",
        "runtime/evaluate/decoder.py": "from runtime.capture import engine\n",
        "runtime/trainer/__init__.py": "",
        "runtime/trainer/loop.py": "from runtime.evaluate import decoder\n",
        "runtime/moe/__init__.py": "",
        "runtime/moe/loader.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tests.x\n"
        "def g():\n    from runtime.capture.engine import X\n",
        "runtime/recipe/schema.py": "",
        "runtime/transport/__init__.py": "",
        "runtime/transport/window.py": "from runtime.recipe.schema import Recipe\n",
        "tools/__init__.py": "",
        "tools/bench.py": "from tests.conftest import free_port\n",
        "tests/__init__.py": "",
        "tests/conftest.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = build_graph(tmp_path)
    chains = heavy_paths("launcher.cli", modules)
    assert (
        chains
        and chains[0].startswith("launcher.cli -> ")
        and chains[0].split(" (line")[0].endswith("runtime.capture.engine -> torch")
    )
    arrows = arrow_violations(modules, tmp_path)
    assert any("runtime/moe/loader.py:5 imports runtime.capture.engine" in a for a in arrows), arrows
    assert any("tools/bench.py:1 imports tests.conftest" in a for a in arrows), arrows
    assert any("runtime/recipe/fit/model.py:1 imports runtime.recipe.checks" in a for a in arrows), arrows
    assert not any("tests.x" in a for a in arrows), "TYPE_CHECKING imports never run"
    assert import_cycles(modules) == [["runtime.capture.engine", "runtime.moe.loader"]]
    assert patching_in_the_light_layer(modules, tmp_path) == ["runtime/shared/helper.py:1 imports zipfile"]
    assert "runtime/capture/engine.py:3 imports runtime.sglang_patching.tree" in patching_importers(modules, tmp_path)
    assert "runtime/trainer/loop.py:1 imports runtime.evaluate.decoder" in evaluate_importers(modules, tmp_path)
    assert recipe_readers_in_transport(modules) == ["window.py imports runtime.recipe.schema"]
    assert recipe_past_the_door(tmp_path) == ["runtime/transport/window.py:1 imports runtime.recipe.schema.Recipe"]
    (tmp_path / "runtime/capture/loop.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runtime.recipe import ResolvedRecipe, RecipeError\n"
    )
    assert "runtime/capture/loop.py:3 imports runtime.recipe.ResolvedRecipe" in recipe_past_the_door(tmp_path)
    (tmp_path / "runtime/capture/status.py").write_text("from runtime.shared.contracts import heartbeat_key\n")
    assert heartbeat_users(tmp_path) == ["runtime/capture/status.py:1 imports runtime.shared.contracts.heartbeat_key"]


def test_the_recipe_walk_records_each_stay_and_counts_climbs_and_returns(tmp_path: Path) -> None:
    """tools/room_walk follows the whole recipe into the functions that receive it (a leaf section is
    not the recipe); its counts come from the rooms on the stack and the order of the stays."""
    import io
    import sys

    from runtime.recipe import load_recipe
    from runtime.trainer.draft_spec import DraftSpec
    from runtime.transport.settings import TransportSettings
    from tools.room_walk import RecipeFollower, RecipeWalk, Stay

    recipe = load_recipe(REPO_ROOT / "recipes" / "tiny.yaml").recipe
    sink = io.StringIO()
    follower = RecipeFollower(sink)
    sys.setprofile(follower.profile)
    try:
        DraftSpec.from_recipe(recipe)
        TransportSettings.from_recipe(recipe)
        DraftSpec(**{**DraftSpec.from_recipe(recipe).__dict__}).with_draft(recipe.trainer.draft)
    finally:
        sys.setprofile(None)
    modules = [line.split('"module": "')[1].split('"')[0] for line in sink.getvalue().splitlines()]
    assert modules == ["runtime.trainer.draft_spec", "runtime.transport.settings", "runtime.trainer.draft_spec"]

    def stay(module: str, *above: str) -> Stay:
        return Stay(module, "f", above)

    walk = RecipeWalk("p", (stay("a"), stay("b", "a"), stay("a", "a", "b"), stay("c"), stay("b"), stay("b")))
    assert walk.rooms == ["a", "b", "c"]
    assert walk.climbs_back_up == 1  # b handed the recipe back up to a, which holds it above
    assert walk.returns == 2  # back to a, later back to b
