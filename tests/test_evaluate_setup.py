"""The evaluation's door (runtime/evaluate/setup.py): the resolved recipe and the eval section to run
become the parts' frozen settings once; derived values (resolved paths, the stop tokens, the route)
are computed there."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from runtime.evaluate.setup import eval_setup
from runtime.recipe.loader import load_recipe, load_resolved, write_resolved
from runtime.trainer.draft_spec import DraftSpec
from tests.conftest import REPO_ROOT


def _resolved(tmp_path: Path, *overrides: str):
    loaded = load_recipe(REPO_ROOT / "recipes" / "tiny.yaml", list(overrides))
    return load_resolved(write_resolved(loaded, tmp_path / "job", REPO_ROOT))


def test_the_eval_setup_resolves_paths_and_derives_the_stop_tokens_and_route(tmp_path: Path) -> None:
    resolved = _resolved(tmp_path, "trainer.seed=5", "capture.special_tokens.eos_id=3")
    recipe = resolved.recipe
    assert recipe.eval is not None
    first = recipe.eval.sets[0]
    section = recipe.eval.model_copy(
        update={"sets": [first, first.model_copy(update={"name": "second", "path": "/data/second.jsonl"})]}
    )

    setup = eval_setup(resolved, section, ["second"])

    assert [(s.name, s.index, s.path) for s in setup.eval.sets] == [("second", 1, Path("/data/second.jsonl"))]
    assert [s.path for s in eval_setup(resolved, section).eval.sets] == [
        REPO_ROOT / ".cache" / "tiny" / "data" / "eval.jsonl",
        Path("/data/second.jsonl"),
    ]
    assert setup.eval.stop_ids == frozenset({3, 8})  # the target's eos and eval.stop_token_ids
    assert setup.eval.temperatures == (0.0, 1.0)
    assert setup.eval.route == "embedded"  # auto: the capture engine's
    assert eval_setup(resolved, section.model_copy(update={"route": "sglang"})).eval.route == "sglang"
    assert setup.target.path == REPO_ROOT / ".cache" / "tiny" / "target"
    assert setup.target.compute_dtype == "float32" and setup.target.aux_layer_ids == (1, 3, 5)
    assert setup.draft == DraftSpec.from_recipe(recipe)
    assert setup.teacher_forcing.anchor_seed == 5
    assert setup.job_dir == resolved.job_dir and setup.recipe_digest == resolved.digest
    assert setup.checkpoint_dir == resolved.job_dir / "checkpoints"
    assert setup.sglang.target_path == setup.target.path and setup.sglang.recipe_file == resolved.path
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.eval.seed = 1  # type: ignore[misc]
