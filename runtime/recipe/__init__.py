"""The recipe contract shared by the launcher and the runtime (pydantic only, no torch)."""

from runtime.recipe.errors import Problem, RecipeError
from runtime.recipe.loader import (
    RESOLVED_FILENAME,
    LoadedRecipe,
    ResolvedRecipe,
    load_recipe,
    load_resolved,
    recipe_digest,
    write_resolved,
)
from runtime.recipe.schema import Recipe
from runtime.recipe.sizes import SampleSize

__all__ = [
    "RESOLVED_FILENAME",
    "LoadedRecipe",
    "Problem",
    "Recipe",
    "RecipeError",
    "ResolvedRecipe",
    "SampleSize",
    "load_recipe",
    "load_resolved",
    "recipe_digest",
    "write_resolved",
]
