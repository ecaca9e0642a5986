"""Load a recipe: YAML file -> smoke overlay -> ``--set`` overrides -> typed, checked Recipe.

Also writes and reads the resolved recipe, the one file the runtime reads.
"""

from __future__ import annotations

import copy
import datetime as dt
import difflib
import hashlib
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from runtime.files import atomic_write_text
from runtime.recipe.checks import check_recipe
from runtime.recipe.errors import Problem, RecipeError
from runtime.recipe.schema import Recipe, credentials_in
from runtime.user_errors import REDACTED, UserError, file_kind_problem, is_secret_name, redact

RESOLVED_FORMAT = "dspark-resolved-recipe/1"
RESOLVED_FILENAME = "recipe.resolved.json"


@dataclass
class LoadedRecipe:
    """A validated recipe and where it came from."""

    recipe: Recipe
    source: str
    """Recipe file as given (relative to the repository when inside it)."""
    overrides: list[str] = field(default_factory=list)
    """``--set`` overrides applied, in order."""
    smoke: bool = False
    """Whether the smoke overlay was applied."""

    @property
    def digest(self) -> str:
        """SHA-256 of the canonical JSON of the recipe (machine independent)."""
        return recipe_digest(self.recipe)


@dataclass
class ResolvedRecipe:
    """The resolved recipe as the runtime sees it."""

    recipe: Recipe
    digest: str
    path: Path
    """The resolved file itself (inside the job folder)."""
    repo_root: Path
    """Repository root that relative recipe paths are resolved against."""
    source: str
    smoke: bool
    overrides: list[str]

    @property
    def job_dir(self) -> Path:
        """The job folder holding this resolved recipe."""
        return self.path.parent

    def resolve_path(self, value: str) -> Path:
        """A recipe path made absolute: relative paths are relative to the repository root."""
        return resolve_recipe_path(value, self.repo_root)

    def checkpoint_dir(self, job_dir: Path | None = None) -> Path:
        """Where the trainer keeps its checkpoints: ``trainer.checkpoint.dir``, or ``checkpoints/`` in
        the job folder (``job_dir``, default this recipe's folder)."""
        configured = self.recipe.trainer.checkpoint.dir
        return self.resolve_path(configured) if configured else (job_dir or self.job_dir) / "checkpoints"


def resolve_recipe_path(value: str, repo_root: Path) -> Path:
    """A path from a recipe: ``~`` and ``${VAR}`` expanded, relative to ``repo_root`` unless absolute."""
    path = Path(os.path.expandvars(os.path.expanduser(value)))
    return path if path.is_absolute() else repo_root / path


NOT_IN_DIGEST = ("eval",)
"""Top-level sections left out of the digest: how a finished draft is evaluated does not change the
training run, so a job folder verifies and resumes whatever eval settings it was resolved with (or
without, before the section existed)."""


DIGEST_DEFAULTS_LEFT_OUT: dict[tuple[str, ...], Any] = {
    ("trainer", "draft", "attention"): "gqa",
    ("trainer", "draft", "mla"): None,
    ("trainer", "draft", "layers"): None,
    ("trainer", "draft", "kda"): None,
}
"""Fields added after recipes were first digested, left out of the digest while they hold the value every
earlier recipe meant: a job resolved before they existed keeps its digest (its checkpoints' record, its
resume), and a recipe that sets them gets another one."""


def recipe_digest(recipe: Recipe) -> str:
    """SHA-256 of the canonical JSON form of ``recipe`` (the sections of :data:`NOT_IN_DIGEST` and the
    defaults of :data:`DIGEST_DEFAULTS_LEFT_OUT` left out)."""
    document = recipe.model_dump(mode="json", exclude=set(NOT_IN_DIGEST))
    for path, default in DIGEST_DEFAULTS_LEFT_OUT.items():
        parent = document
        for part in path[:-1]:
            parent = parent.get(part, {}) if isinstance(parent, dict) else {}
        if isinstance(parent, dict) and path[-1] in parent and parent[path[-1]] == default:
            del parent[path[-1]]
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class RecipeLookupError(UserError, FileNotFoundError):
    """No recipe file by that name or path; the message lists the recipes there are."""


def find_recipe_file(name_or_path: str, recipes_dir: Path) -> Path:
    """``tiny`` -> ``recipes/tiny.yaml``; a path is returned as is. Errors list what exists."""
    candidate = Path(name_or_path)
    known = sorted(p.stem for p in recipes_dir.glob("*.y*ml"))
    if re.search(r"[\x00-\x1f\x7f]", name_or_path):
        raise RecipeLookupError(
            f"recipe path {name_or_path!r} holds a control character (a newline?); it is written into batch "
            "scripts and commands. Fix: rename the file without it"
        )
    if candidate.is_dir():
        raise RecipeLookupError(f"{candidate} is a folder; fix: give a recipe file (a .yaml) or a recipe name")
    if candidate.is_file():
        return candidate
    kind = file_kind_problem(candidate)
    if kind is not None:
        raise RecipeLookupError(f"recipe file {candidate} is {kind}, not a regular file; fix: give a recipe file")
    if candidate.suffix in {".yaml", ".yml"}:
        raise RecipeLookupError(
            f"recipe file {candidate} does not exist; fix: check the path, or give a recipe name from {recipes_dir} "
            f"({', '.join(known)})"
        )
    for suffix in (".yaml", ".yml"):
        path = recipes_dir / f"{name_or_path}{suffix}"
        if path.exists():
            return path
    hint = difflib.get_close_matches(name_or_path, known, n=1)
    did_you_mean = f" Did you mean '{hint[0]}'?" if hint else ""
    raise RecipeLookupError(
        f"no recipe named '{name_or_path}' in {recipes_dir}.{did_you_mean} Known recipes: {', '.join(known)}; fix: "
        "give one of them, or the path of a recipe file"
    )


def refuse_repeated_sets(overrides: list[str], where: str) -> None:
    """Two ``--set`` of one key on one command line: refused, naming the key (the last would silently win)."""
    seen: dict[str, str] = {}
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key in seen:
            raise RecipeError(
                where,
                [
                    Problem(
                        key,
                        f"is set twice on the command line ({redact_override(seen[key])!r}, then "
                        f"{redact_override(item)!r}); the last would silently win",
                        "keep the one you mean",
                        "--set",
                    )
                ],
            )
        seen[key] = item


def load_recipe(
    path: str | Path,
    overrides: list[str] | None = None,
    smoke: bool = False,
    display_name: str | None = None,
) -> LoadedRecipe:
    """Read, overlay, override and validate a recipe file. Raises RecipeError listing every problem."""
    path = Path(path)
    name = display_name or str(path)
    return load_document(_read_yaml(path, name), name, overrides, smoke)


def load_document(
    raw: dict[str, Any], name: str, overrides: list[str] | None = None, smoke: bool = False
) -> LoadedRecipe:
    """Overlay, override and validate a recipe document (a recipe file's content, or a job's resolved
    recipe for ``--resume JOB``); ``name`` is what its messages call it. Raises RecipeError."""
    overrides = list(overrides or [])
    raw = copy.deepcopy(raw)
    # ``--set smoke.KEY=VALUE`` edits the overlay itself: applied first, so it is validated (and merged
    # under --smoke) exactly like the file's overlay; every other --set wins over the overlay.
    smoke_origins: dict[str, str] = {}
    for item in [i for i in overrides if i.split("=", 1)[0].strip().startswith("smoke.")]:
        if not isinstance(raw.get("smoke"), dict):
            raw["smoke"] = {}
        key = apply_override(raw, item, name)
        smoke_origins[key.removeprefix("smoke.")] = f"--set {redact_override(item)}"
    origins: dict[str, str] = dict(smoke_origins) if smoke else {}
    overrides_after_overlay = [i for i in overrides if not i.split("=", 1)[0].strip().startswith("smoke.")]
    smoke_overlay = raw.get("smoke") or {}
    if not isinstance(smoke_overlay, dict):
        raise RecipeError(name, [Problem("smoke", "must be a mapping (an overlay of recipe keys)", "", name)])

    if smoke:
        if not smoke_overlay:
            raise RecipeError(
                name,
                [
                    Problem(
                        "smoke", "--smoke was given but the recipe has no smoke overlay", "add a smoke: section", name
                    )
                ],
            )
        document = deep_merge(raw, smoke_overlay)
    else:
        document = copy.deepcopy(raw)
    for item in overrides_after_overlay:
        key = apply_override(document, item, name)
        origins[key] = f"--set {redact_override(item)}"

    recipe = _validate(document, name, origins, smoke_overlay if smoke else {})
    problems = check_recipe(recipe)
    if recipe.capture.inject_nan_at_g is not None and not smoke:
        problems.append(
            Problem(
                "capture.inject_nan_at_g",
                f"is {recipe.capture.inject_nan_at_g}: NaN injection is a smoke-gate self-test",
                "use it only with --smoke",
            )
        )
    if not smoke and smoke_overlay:
        # A typo in the smoke overlay should fail now, not minutes before a gate on the cluster.
        smoke_doc = deep_merge(raw, smoke_overlay)
        smoke_recipe = _validate(smoke_doc, name, smoke_origins, smoke_overlay, prefix="smoke.")
        # A problem the base recipe already has is not repeated for the overlay: the cause is said once.
        seen = {(p.path, p.message) for p in problems}
        problems += [
            Problem(f"smoke.{p.path}", p.message, p.fix, f"smoke overlay in {name}")
            for p in check_recipe(smoke_recipe)
            if (p.path, p.message) not in seen
        ]
    if problems:
        raise RecipeError(name, [_with_source(p, name, origins, smoke_overlay if smoke else {}) for p in problems])
    return LoadedRecipe(recipe=recipe, source=name, overrides=overrides, smoke=smoke)


def deep_merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overlay`` merged in (mappings merge, everything else replaces); the
    ``smoke`` key itself is dropped from the result."""
    merged = copy.deepcopy({k: v for k, v in base.items() if k != "smoke"})
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def apply_override(document: dict[str, Any], item: str, file: str) -> str:
    """Apply one ``a.b.c=value`` override in place (value parsed as YAML); returns the key."""
    if "=" not in item:
        shown = item if len(item) <= 80 else item[:77] + "..."
        fix = (
            "write --set key.path=VALUE, e.g. --set trainer.optimizer.lr=1e-4"
            if not item.strip()
            else (f"write --set {shown}=VALUE")
        )
        raise RecipeError(
            file, [Problem(shown or "--set ''", "an override must look like key.path=value", fix, f"--set {shown!r}")]
        )
    key, text = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if "[" in key or "]" in key:
        field = key.split("[", 1)[0]
        raise RecipeError(
            file,
            [
                Problem(
                    key,
                    "--set does not reach into a list by index",
                    f"give the whole list: --set '{field}=[...]'",
                    f"--set {redact_override(item)}",
                )
            ],
        )
    if not all(parts):
        raise RecipeError(
            file, [Problem(key, "empty segment in the key path", "write a.b.c=value", f"--set {redact_override(item)}")]
        )
    try:
        # A text field takes the text as written (a SHA-256 of digits is not the number 0).
        if _expects_text(parts):
            value = None if text.strip() in {"null", "~"} and _accepts_none(parts) else text
        else:
            value = parse_yaml(text) if text.strip() else ""
    except yaml.YAMLError as exc:
        shown = redact_override(item).partition("=")[2]
        shown = shown if len(shown) <= 80 else shown[:76] + " ..."
        problem = str(getattr(exc, "problem", None) or exc).strip()
        raise RecipeError(
            file,
            [
                Problem(
                    key,
                    f"cannot parse value {shown!r} as YAML ({problem})",
                    exc.fix if isinstance(exc, YamlShapeError) else _yaml_fix(problem, set_value=True),
                    f"--set {redact_override(item)}",
                )
            ],
        ) from None
    node: Any = document
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part) if isinstance(node, dict) else None
        if child is None:
            child = {}
            node[part] = child
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise RecipeError(
                file,
                [
                    Problem(
                        key,
                        f"{where} is not a section, so {key} cannot be set",
                        f"set {where} itself, or a field of the section that holds it",
                        f"--set {redact_override(item)}",
                    )
                ],
            )
        node = child
    node[parts[-1]] = value
    return key


def write_resolved(loaded: LoadedRecipe, job_dir: Path, repo_root: Path) -> Path:
    """Write ``recipe.resolved.json`` into ``job_dir`` atomically; returns its path."""
    job_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": RESOLVED_FORMAT,
        "digest": loaded.digest,
        "source": loaded.source,
        "smoke": loaded.smoke,
        "overrides": loaded.overrides,
        "repo_root": str(repo_root),
        "resolved_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "recipe": loaded.recipe.model_dump(mode="json"),
    }
    target = job_dir / RESOLVED_FILENAME
    atomic_write_text(target, json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return target


def load_resolved(path: str | Path) -> ResolvedRecipe:
    """Read a resolved recipe written by the launcher and verify its digest."""
    path = Path(path)
    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"resolved recipe {path} does not exist; the launcher writes it into the job folder. Fix: name a job "
            "folder the launcher made (runs/NAME/STAMP), or make one (python3 -m launcher RECIPE, or python3 -m "
            "launcher resolve RECIPE --job-dir DIR)"
        ) from None
    except json.JSONDecodeError as exc:
        raise RecipeError(
            str(path), [Problem("", f"not valid JSON: {exc}", "re-resolve the recipe with the launcher")]
        ) from exc
    if payload.get("format") != RESOLVED_FORMAT:
        raise RecipeError(
            str(path),
            [Problem("format", f"is {payload.get('format')!r}, expected {RESOLVED_FORMAT!r}", "re-resolve the recipe")],
        )
    recipe = _validate(payload["recipe"], str(path), {}, {})
    digest = recipe_digest(recipe)
    if digest != payload.get("digest"):
        raise RecipeError(
            str(path),
            [
                Problem(
                    "digest",
                    f"the recipe content hashes to {digest[:12]}..., but the file records "
                    f"{str(payload.get('digest'))[:12]}...: it was edited after resolution",
                    "change the YAML recipe (or --set) and resolve again instead of editing this file",
                )
            ],
        )
    return ResolvedRecipe(
        recipe=recipe,
        digest=digest,
        path=path.resolve(),
        repo_root=Path(payload["repo_root"]),
        source=payload.get("source", ""),
        smoke=bool(payload.get("smoke")),
        overrides=list(payload.get("overrides", [])),
    )


# ----------------------------------------------------------------------------------------------
# validation error -> problems
# ----------------------------------------------------------------------------------------------


MAX_YAML_ALIASES = 200
"""More aliases (``*name``) than a recipe needs: past this, a document is refused before it is built."""
MAX_YAML_VALUES = 200_000
"""Values a recipe may expand to (aliases counted at each use): a "billion laughs" stops here."""
MAX_YAML_DEPTH = 60
"""Nesting a recipe may have (the schema is a few levels deep)."""


class YamlShapeError(yaml.YAMLError):
    """A YAML document that parses but cannot be a recipe value (too large, recursive, an odd key);
    ``problem`` says what, ``fix`` what to do."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.problem, self.fix = problem, fix


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader for recipes and ``--set`` values: it refuses a key given twice in one mapping
    (plain PyYAML keeps the last), keys that are not plain values, and more than
    :data:`MAX_YAML_ALIASES` aliases; merge keys (``<<: *defaults``) work. Scalars resolve as in
    YAML 1.2: only true/false are booleans, and ``0755``, ``1:30`` and ``2024-01-01`` stay text
    (YAML 1.1 made them octal, base-60 and a date)."""

    yaml_implicit_resolvers: dict[Any, Any] = {}
    _aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):  # type: ignore[no-untyped-call]
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise YamlShapeError(
                    f"more than {MAX_YAML_ALIASES} aliases (*name)",
                    "write the values out; a recipe needs few aliases (this looks like an expansion bomb)",
                )
        return super().compose_node(parent, index)  # type: ignore[no-untyped-call]

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        explicit = [pair for pair in node.value if pair[0].tag != "tag:yaml.org,2002:merge"]
        self.flatten_mapping(node)  # type: ignore[no-untyped-call]
        seen: dict[Any, int] = {}
        for key_node, _ in explicit:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if not isinstance(key, str):
                shown = (
                    f"a {type(key).__name__} (a '? ' complex key)" if isinstance(key, list | dict | set) else repr(key)
                )
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the key {shown} is not a name (a number, null, a list or a mapping); keys are names: quote it "
                    "if it is one",
                    key_node.start_mark,
                )
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (first given at line {seen[key]})", key_node.start_mark
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_YAML12_RESOLVERS = {
    "tag:yaml.org,2002:bool": r"^(?:true|True|TRUE|false|False|FALSE)$",
    "tag:yaml.org,2002:int": r"^(?:[-+]?0b[0-1_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$",
    "tag:yaml.org,2002:float": (
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
}
for _first, _resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items():
    for _tag, _regexp in _resolvers:
        if _tag == "tag:yaml.org,2002:timestamp":
            continue
        pattern = re.compile(_YAML12_RESOLVERS[_tag]) if _tag in _YAML12_RESOLVERS else _regexp
        _UniqueKeyLoader.yaml_implicit_resolvers.setdefault(_first, []).append((_tag, pattern))


def _yaml_fix(problem: str, set_value: bool = False) -> str:
    """The fix for a YAML error, from what PyYAML says went wrong."""
    if "could not determine a constructor for the tag" in problem:
        return "remove the tag (!!python/..., !name): recipes hold plain values only"
    if "found undefined alias" in problem:
        return "define the anchor (&name) before using *name, or quote a value that starts with *"
    if "is not a name" in problem:
        return "use a name as the key (quote it: '123': ...)"
    if set_value:
        return "close the bracket or quote, or quote the whole value: --set 'KEY=\"text\"'"
    return "fix the YAML syntax"


def parse_yaml(text: str) -> Any:
    """One YAML document as a recipe value (see :class:`_UniqueKeyLoader`), refused with a
    :class:`yaml.YAMLError` when it nests deeper than :data:`MAX_YAML_DEPTH`, refers to itself or
    expands to more than :data:`MAX_YAML_VALUES` values."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except RecursionError:
        raise YamlShapeError(
            "nested too deeply to read", f"a recipe nests a few levels; keep it under {MAX_YAML_DEPTH}"
        ) from None
    except ValueError as exc:  # a value YAML cannot convert (an integer of more than 4,300 digits, a bad date)
        raise YamlShapeError(
            f"holds a value that cannot be converted ({str(exc)[:120]})",
            "write the value as a plain number of a sensible size, or quote it to keep it as text",
        ) from None
    count = 0
    stack: list[tuple[Any, int, frozenset[int]]] = [(data, 0, frozenset())]
    while stack:
        value, depth, path = stack.pop()
        count += 1
        if count > MAX_YAML_VALUES:
            raise YamlShapeError(
                f"expands to more than {MAX_YAML_VALUES} values (aliases counted at each use)",
                "write the values out; no recipe is this large (this looks like an expansion bomb)",
            )
        if depth > MAX_YAML_DEPTH:
            raise YamlShapeError(
                f"nested more than {MAX_YAML_DEPTH} levels deep", "flatten it; the schema is a few levels deep"
            )
        if isinstance(value, dict | list):
            if id(value) in path:
                raise YamlShapeError("an alias refers to the mapping or list it is in (a cycle)", "remove the cycle")
            inner = path | {id(value)}
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1, inner) for child in children)
    return data


def _read_yaml(path: Path, name: str) -> dict[str, Any]:
    try:
        raw_bytes = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"recipe file {name} does not exist") from None
    try:
        text = raw_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw_bytes[: exc.start].count(b"\n") + 1
        raise RecipeError(
            name,
            [
                Problem(
                    "",
                    f"the file is not UTF-8 text: byte 0x{raw_bytes[exc.start]:02x} at line {line} cannot be decoded",
                    "save the recipe as UTF-8 (iconv -f latin1 -t utf-8, or re-save it in your editor)",
                )
            ],
        ) from None
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = str(getattr(exc, "problem", exc))
        if problem.startswith("duplicate key"):
            raise RecipeError(
                name,
                [Problem("", f"{problem}, again{where}", "keep one of them: plain YAML would silently take the last")],
            ) from None
        if isinstance(exc, YamlShapeError):
            raise RecipeError(name, [Problem("", f"the YAML {exc.problem}", exc.fix)]) from None
        raise RecipeError(name, [Problem("", f"YAML syntax error{where}: {problem}", _yaml_fix(problem))]) from None
    if not isinstance(data, dict):
        raise RecipeError(
            name, [Problem("", "the top level must be a mapping of sections", "start with job:, capture:, ...")]
        )
    return data


def _validate(
    document: dict[str, Any],
    file: str,
    origins: dict[str, str],
    smoke_overlay: dict[str, Any],
    prefix: str = "",
) -> Recipe:
    try:
        return Recipe.model_validate(document)
    except ValidationError as exc:
        problems = [problem_from_validation_error(err, document) for err in exc.errors()]
        if prefix:
            problems = [
                Problem(prefix + p.path, p.message, p.fix, _with_source(p, file, origins, {}).source)
                if _with_source(p, file, origins, {}).source != file
                else Problem(prefix + p.path, p.message, p.fix, f"smoke overlay in {file}")
                for p in problems
            ]
        else:
            problems = [_with_source(p, file, origins, smoke_overlay) for p in problems]
        raise RecipeError(file, problems) from None


def _mentions(message: str, key: str) -> bool:
    """Whether ``message`` names the field ``key`` (or a field under it) as a dotted path."""
    return re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", message) is not None


def _with_source(problem: Problem, file: str, origins: dict[str, str], smoke_overlay: dict[str, Any]) -> Problem:
    """``problem`` with the input that caused it: the ``--set`` of its own field, else the ``--set`` of a
    field its message names (``capture.sglang.tp_size`` refused because ``--set job.capture.gpus_per_node=4``
    left too few GPUs), else the smoke overlay or the recipe file."""
    if problem.source:
        return problem
    path = problem.path.split("[")[0]
    for key, origin in origins.items():
        if path == key or path.startswith(key + ".") or key.startswith(path + "."):
            return Problem(problem.path, problem.message, problem.fix, origin)
    named = [origin for key, origin in origins.items() if _mentions(problem.message, key)]
    if named:
        return Problem(problem.path, problem.message, problem.fix, " and ".join(dict.fromkeys(named)))
    if _has_path(smoke_overlay, path.split(".")):
        return Problem(problem.path, problem.message, problem.fix, f"smoke overlay in {file}")
    return Problem(problem.path, problem.message, problem.fix, file)


def _has_path(tree: Any, parts: list[str]) -> bool:
    for part in parts:
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return bool(parts)


def _dotted(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that holds the field at ``loc`` (following nested sections)."""
    model: type[BaseModel] = Recipe
    for part in loc:
        if isinstance(part, int):
            continue
        info = model.model_fields.get(part)
        if info is None:
            return None
        inner = _section_type(info.annotation)
        if inner is None:
            return None
        model = inner
    return model


def _expects_text(parts: list[str]) -> bool:
    """Whether the schema field at ``parts`` holds text (str, optional str, or a string Literal)."""
    model = _model_at(tuple(parts[:-1]))
    info = model.model_fields.get(parts[-1]) if model else None
    if info is None:
        return False
    annotation = info.annotation
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    options = [a for a in typing.get_args(annotation) if a is not type(None)] if is_union else [annotation]
    # A constrained text field (``Annotated[str, validator]``) holds text too.
    options = [typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a for a in options]
    return bool(options) and all(
        a is str or (typing.get_origin(a) is typing.Literal and all(isinstance(v, str) for v in typing.get_args(a)))
        for a in options
    )


def _accepts_none(parts: list[str]) -> bool:
    model = _model_at(tuple(parts[:-1]))
    info = model.model_fields.get(parts[-1]) if model else None
    return info is not None and type(None) in typing.get_args(info.annotation)


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_type(arg)
        if found is not None:
            return found
    return None


def _field_known(loc: tuple[Any, ...]) -> bool:
    parent = _model_at(loc[:-1]) if loc else None
    return parent is not None and str(loc[-1]) in parent.model_fields


def problem_from_validation_error(err: Any, document: dict[str, Any]) -> Problem:
    """One pydantic error of the recipe (its ``loc`` from the recipe's root) as a :class:`Problem`."""
    loc = tuple(err["loc"])
    path = _dotted(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _model_at(loc[:-1])
        name = str(loc[-1])
        known = sorted(parent.model_fields) if parent else []
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        head, dot, rest = name.partition(".")
        if dot and head in known:  # "trainer.seed": 5 written as one key: the dotted form is --set's, not YAML's
            return Problem(
                path,
                f"unknown key '{name}': a dotted name is one key in YAML",
                f"nest it: write '{rest}' under the '{head}:' section (dotted paths are for --set {name}=VALUE)",
            )
        if close:
            return Problem(path, f"unknown key '{name}'. Did you mean '{close[0]}'?", f"rename it to '{close[0]}'")
        return Problem(path, f"unknown key '{name}'", f"remove it; known keys here: {', '.join(known)}")
    if kind == "missing":
        parent = _model_at(loc[:-1])
        info = parent.model_fields.get(str(loc[-1])) if parent else None
        description = f" ({info.description})" if info and info.description else ""
        return Problem(path, f"required key is missing{description}", f"add {loc[-1]}: <value>")
    section = _section_type(_model_at(loc[:-1]).model_fields[str(loc[-1])].annotation) if _field_known(loc) else None
    if kind in {"model_type", "dict_type"} and section is not None:
        fields = ", ".join(sorted(section.model_fields))
        return Problem(
            path,
            f"is a section, not a single value (got {err.get('input')!r})",
            f"set a field inside it, e.g. --set {path}.FIELD=VALUE; its fields: {fields}",
        )
    shown = redact(repr(_redact_secret_keys(err.get("input"))))
    if len(shown) > 80:
        shown = shown[:77] + "..."
    parent = _model_at(loc[:-1])
    info = parent.model_fields.get(str(loc[-1])) if parent and loc else None
    expected = _describe_type(info.annotation) if info else ""
    fix = f"write {expected}" if expected else "correct the value"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:  # a range error: the fix is the allowed range, not the type
        limit = next(iter((err.get("ctx") or {}).values()), None)
        fix = f"use a value {bounds[kind]} {limit}" + (f" ({expected})" if expected else "")
    lengths = {
        "string_too_long": "at most {} characters",
        "string_too_short": "at least {} characters",
        "too_long": "at most {} items",
        "too_short": "at least {} items",
    }
    if kind in lengths:
        ctx = err.get("ctx") or {}
        limit = ctx.get("max_length", ctx.get("min_length"))
        fix = "use " + lengths[kind].format(limit)
    if kind == "string_pattern_mismatch":
        pattern = str((err.get("ctx") or {}).get("pattern", ""))
        if "0-9a-f" in pattern:
            fix = "write the 64 lowercase hex digits of a SHA-256 (sha256sum FILE)" + (
                ", or manifest" if "manifest" in pattern else ""
            )
        elif "A-Za-z0-9_" in pattern:
            fix = "use letters, digits, '_', '.' and '-' only, on one line (no '/', spaces or newlines)"
    if kind in {"int_parsing", "float_parsing"} and err.get("input") in {"true", "false"}:
        fix = "write a number: true/false is a boolean, not a number"
    if kind == "string_type" and isinstance(err.get("input"), int | float | bool):
        fix = (
            "quote it, e.g. '0123' or 'no': YAML reads unquoted digits, numbers and true/false as numbers and "
            "booleans, not text"
        )
    if kind == "string_type" and isinstance(err.get("input"), dt.date | dt.datetime):
        fix = "quote it, e.g. '2024-01-01': YAML reads an unquoted date (or a !!timestamp) as a date, not text"
    if isinstance(err.get("input"), tuple) or (
        isinstance(err.get("input"), list) and any(isinstance(item, tuple) for item in err["input"])
    ):
        fix = f"write {expected or 'the value'} as a plain list or mapping: an !!omap or !!pairs tag makes pairs"
    message = err["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if " Fix: " in message:  # a validator that knows the fix says it
        message, fix = message.split(" Fix: ", 1)
    return Problem(path, f"{message} (got {shown})", fix)


def redact_override(item: str) -> str:
    """``--set KEY=VALUE`` as it may be shown: the value hidden when KEY names a credential (an
    environment name such as HF_TOKEN; never a field such as ``eval.max_new_tokens``) or the value
    writes one down."""
    key, sep, value = item.partition("=")
    secret = is_secret_name(key.rsplit(".", 1)[-1]) or credentials_in(value)
    return f"{key}={REDACTED}" if sep and secret else redact(item)


def _redact_secret_keys(value: Any) -> Any:
    """A value as an error may show it: the values of credential-named keys hidden, at any depth."""
    if isinstance(value, dict):
        return {k: (REDACTED if is_secret_name(str(k)) else _redact_secret_keys(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_secret_keys(v) for v in value]
    return value


def _describe_type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    text = text.replace("typing.", "")
    if "Literal" in str(annotation):
        options = [a for a in typing.get_args(annotation) if not isinstance(a, type)]
        if options:
            return "one of " + ", ".join(repr(o) for o in options)
    return f"a value of type {text}"
