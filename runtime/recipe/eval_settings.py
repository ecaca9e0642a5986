"""The eval section an evaluation runs with: the job's (or its recipe file's), with ``--set eval.*``
applied and every named eval set checked. Light (no torch), so the launcher refuses a bad eval
request before it starts a process or submits a job, with the same message the evaluation gives."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from runtime.recipe.errors import Problem, RecipeError
from runtime.recipe.loader import apply_override, load_recipe, problem_from_validation_error, redact_override
from runtime.recipe.schema import EvalSection


def eval_settings(
    resolved_eval: EvalSection | None,
    eval_recipe: str | None,
    overrides: list[str],
    where: str,
    vocab_size: int | None = None,
) -> EvalSection:
    """The eval section to run: the job's, else the one of ``eval_recipe``, with ``overrides``; with
    ``vocab_size`` (the target's), stop token ids outside the vocabulary are refused."""
    section = _eval_section(resolved_eval, eval_recipe, overrides, where)
    outside = [(i, t) for i, t in enumerate(section.stop_token_ids) if vocab_size is not None and t >= vocab_size]
    if outside:
        raise RecipeError(
            where,
            [
                Problem(
                    f"eval.stop_token_ids[{i}]",
                    f"is {token}, outside the target's vocabulary (ids 0..{vocab_size - 1 if vocab_size else 0}): "
                    "generation would never stop on it",
                    "use the id the target's tokenizer gives that token",
                )
                for i, token in outside
            ],
        )
    return section


def _eval_section(
    resolved_eval: EvalSection | None, eval_recipe: str | None, overrides: list[str], where: str
) -> EvalSection:
    section = resolved_eval
    if section is None and eval_recipe and Path(eval_recipe).is_file():
        section = load_recipe(Path(eval_recipe)).recipe.eval
        where = eval_recipe
    if section is None:
        raise RecipeError(
            where,
            [
                Problem(
                    "eval",
                    "is not set, so there is nothing to evaluate on",
                    "add an eval: section (see recipes/tiny.yaml)",
                )
            ],
        )
    if not overrides:
        return section
    document = {"eval": section.model_dump(mode="json")}
    for item in overrides:
        if not item.startswith("eval."):
            key = item.split("=")[0]
            raise RecipeError(
                where,
                [
                    Problem(
                        key,
                        "cannot change at eval time (the draft was trained with it)",
                        "--set eval.* fields only; to change it, train again",
                        f"--set {redact_override(item)}",
                    )
                ],
            )
        apply_override(document, item, where)
    try:
        return EvalSection.model_validate(document["eval"])
    except ValidationError as exc:
        origins = {item.split("=")[0]: f"--set {redact_override(item)}" for item in overrides}
        problems = []
        for err in exc.errors():
            problem = problem_from_validation_error({**err, "loc": ("eval", *err["loc"])}, document)
            source = next((o for key, o in origins.items() if problem.path.startswith(key)), "")
            problems.append(Problem(problem.path, problem.message, problem.fix, source))
        raise RecipeError(where, problems) from None


def check_eval_set_names(settings: EvalSection, names: list[str] | None, where: str) -> None:
    """Refuse ``--eval-set`` names the eval section does not have, listing the ones it has."""
    known = [s.name for s in settings.sets]
    unknown = sorted(set(names or []) - set(known))
    if unknown:
        raise RecipeError(
            where,
            [Problem("eval.sets", f"has no set {', '.join(unknown)}", f"use one of {', '.join(known)}", "--eval-set")],
        )
