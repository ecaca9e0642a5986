"""Recipe problems: one clear message per bad input, naming the file, the field and the fix."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.user_errors import UserError

SHOWN_SOURCE_CHARS = 160
"""The longest ``--set`` (or field path) a problem line shows whole."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a recipe."""

    path: str
    """Dotted field path, e.g. ``transport.high_watermark_samples``."""
    message: str
    """What is wrong, naming the values involved."""
    fix: str = ""
    """What to change."""
    source: str = ""
    """Where the value came from: the recipe file, its smoke overlay, or a ``--set`` override."""

    def render(self) -> str:
        """One line (plus a fix line) for an operator; a long ``--set`` it came from is shortened (a
        6,000-character value would fill the console twice)."""
        source = (
            self.source if len(self.source) <= SHOWN_SOURCE_CHARS else self.source[: SHOWN_SOURCE_CHARS - 4] + " ..."
        )
        where = f" (from {source})" if source else ""
        path = self.path if len(self.path) <= SHOWN_SOURCE_CHARS else self.path[: SHOWN_SOURCE_CHARS - 4] + " ..."
        text = f"{path or '<recipe>'}{where}: {self.message}"
        if self.fix:
            text += f"\n      fix: {self.fix}"
        return text


class RecipeError(UserError, ValueError):
    """A recipe (file, overlay or override) that cannot be used, with every problem found."""

    def __init__(self, file: str, problems: list[Problem]) -> None:
        self.file = file
        self.problems = problems
        lines = [f"recipe {file} has {len(problems)} problem(s):"]
        lines += [f"  - {p.render()}" for p in problems]
        super().__init__("\n".join(lines))
