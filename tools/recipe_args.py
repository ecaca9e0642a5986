"""``--recipe NAME`` for the data tools: load a recipe and resolve its paths like the runtime does."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from runtime.recipe.loader import find_recipe_file, load_recipe
from runtime.recipe.schema import Recipe

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ToolRecipe:
    """A validated recipe and where it came from."""

    recipe: Recipe
    source: Path

    def path(self, value: str) -> Path:
        """A recipe path made absolute: relative paths are relative to the repository root (as
        :meth:`runtime.recipe.loader.ResolvedRecipe.resolve_path` does)."""
        path = Path(os.path.expandvars(os.path.expanduser(value)))
        return path if path.is_absolute() else REPO_ROOT / path


def load_tool_recipe(name_or_path: str, overrides: list[str] | None = None) -> ToolRecipe:
    """``tiny`` -> ``recipes/tiny.yaml``, validated (the recipe errors name the file and field)."""
    path = find_recipe_file(name_or_path, REPO_ROOT / "recipes")
    return ToolRecipe(load_recipe(path, overrides or []).recipe, path)
