"""``--recipe NAME`` for the data tools: load a recipe and resolve its paths like the runtime does."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.recipe.loader import find_recipe_file, load_recipe, resolve_recipe_path
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
        return resolve_recipe_path(value, REPO_ROOT)


def load_tool_recipe(name_or_path: str, overrides: list[str] | None = None, smoke: bool = False) -> ToolRecipe:
    """``tiny`` -> ``recipes/tiny.yaml``, validated (the recipe errors name the file and field);
    ``smoke`` applies its smoke overlay."""
    path = find_recipe_file(name_or_path, REPO_ROOT / "recipes")
    return ToolRecipe(load_recipe(path, overrides or [], smoke=smoke).recipe, path)
