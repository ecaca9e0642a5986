"""The trainer's door: :func:`runtime.trainer.setup.trainer_setup` reads the resolved recipe once and
hands each part its own frozen settings; nothing in them is the whole recipe."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from runtime.recipe import load_recipe, load_resolved, write_resolved
from runtime.recipe.fit.store_budget import largest_sample
from runtime.recipe.loader import ResolvedRecipe
from runtime.recipe.schema import CaptureSection, DataSection, JobSection, Recipe, TrainerSection, TransportSection
from runtime.trainer.draft_spec import DraftSpec
from runtime.trainer.feature_cache import FeatureCacheError, cache_root, features_digest
from runtime.trainer.settings import TrainerSetupError
from runtime.trainer.setup import TrainerSetup, feature_source, trainer_setup
from runtime.trainer.sources import open_sample_source
from runtime.transport.settings import TransportSettings

REPO_ROOT = Path(__file__).resolve().parent.parent
SHA = "ab" * 32
ENV = {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1"}
WHOLE_RECIPE = (Recipe, ResolvedRecipe, JobSection, CaptureSection, TransportSection, TrainerSection, DataSection)


def resolved_tiny(tmp_path: Path, *overrides: str, smoke: bool = False) -> ResolvedRecipe:
    loaded = load_recipe(
        REPO_ROOT / "recipes" / "tiny.yaml", overrides=[f"data.expected_sha256={SHA}", *overrides], smoke=smoke
    )
    return load_resolved(write_resolved(loaded, tmp_path / "job", REPO_ROOT))


def values_within(value: Any) -> list[Any]:
    """``value`` and every value inside it: dataclass fields, mappings, sequences."""
    found = [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for item in dataclasses.fields(value):
            found += values_within(getattr(value, item.name))
    elif isinstance(value, dict):
        for item in value.values():
            found += values_within(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            found += values_within(item)
    return found


def test_the_setup_builds_each_part_once_and_holds_no_whole_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    resolved = resolved_tiny(tmp_path)
    recipe = resolved.recipe
    built = []
    original = TransportSettings.from_recipe.__func__  # type: ignore[attr-defined]

    def counted(cls: type[TransportSettings], given: Recipe) -> TransportSettings:
        built.append(given)
        return original(cls, given)

    monkeypatch.setattr(TransportSettings, "from_recipe", classmethod(counted))
    setup = trainer_setup(resolved, ENV)
    assert len(built) == 1, "the transport's settings are built once, by the setup"
    monkeypatch.undo()

    assert isinstance(setup, TrainerSetup)
    assert setup.source.transport == TransportSettings.from_recipe(recipe)
    assert setup.draft_spec == DraftSpec.from_recipe(recipe)
    assert (setup.run.rank, setup.run.world_size, setup.run.num_rows) == (1, 4, 128)
    assert setup.recipe_digest == resolved.digest and setup.job_name == recipe.job.name
    assert setup.checkpoint is recipe.trainer.checkpoint and setup.optimizer is recipe.trainer.optimizer
    assert setup.batch.global_batch_size == recipe.trainer.global_batch_size
    assert setup.frozen_vocab.target_dir == resolved.resolve_path(recipe.capture.target_path)
    assert setup.gate.checks_captured_samples and not setup.gate.enabled
    assert setup.source.feature_cache is None  # trainer.feature_cache is off in tiny
    whole = [type(v).__name__ for v in values_within(setup) if isinstance(v, WHOLE_RECIPE)]
    assert not whole, f"the setup hands a part the whole recipe: {whole}"
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.run = setup.run  # type: ignore[misc]


def test_a_smoke_run_turns_the_gate_on(tmp_path: Path) -> None:
    setup = trainer_setup(resolved_tiny(tmp_path, smoke=True), ENV)
    assert setup.gate.enabled and setup.run.smoke and setup.gate.job_dir == setup.run.job_dir


def test_the_setup_refuses_a_world_size_the_recipe_does_not_have(tmp_path: Path) -> None:
    resolved = resolved_tiny(tmp_path)
    with pytest.raises(TrainerSetupError) as err:
        trainer_setup(resolved, {"WORLD_SIZE": "2", "RANK": "0"})
    assert str(err.value) == (
        f"{resolved.path}: WORLD_SIZE is 2, but the recipe's trainer has 4 ranks (job.trainer.nodes 1 x "
        "job.trainer.tasks_per_node 4); fix: start one trainer process per rank of the recipe"
    )


def test_the_feature_cache_settings_are_derived_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_TEST_CACHE_ROOT", str(tmp_path / "local"))
    resolved = resolved_tiny(
        tmp_path, "trainer.feature_cache.enabled=true", "trainer.feature_cache.dir=${DSPARK_TEST_CACHE_ROOT}/cache"
    )
    setup = trainer_setup(resolved, ENV)
    cache = setup.source.feature_cache
    assert cache is not None
    assert cache_root(cache.folder) == tmp_path / "local" / "cache"
    assert cache.features_digest == features_digest(feature_source(resolved.recipe), SHA)
    assert cache.largest_sample_bytes == largest_sample(resolved.recipe).total_bytes
    assert cache.num_rows == setup.run.num_rows == 128
    assert cache.max_samples is None and cache.epochs == resolved.recipe.trainer.epochs

    # A variable this process lacks is refused when the cache opens, naming the field and the fix.
    monkeypatch.delenv("DSPARK_TEST_CACHE_ROOT")
    missing = trainer_setup(resolved, ENV).source.feature_cache
    assert missing is not None
    with pytest.raises(FeatureCacheError, match="names an environment variable this process does not have"):
        cache_root(missing.folder)


def test_a_files_source_without_a_folder_is_refused_when_opened(tmp_path: Path) -> None:
    setup = trainer_setup(resolved_tiny(tmp_path, "trainer.sample_source=files"), ENV)
    assert not setup.gate.checks_captured_samples and setup.source.feature_cache is None
    with pytest.raises(ValueError, match="trainer.sample_source is 'files' but trainer.sample_dir is not set"):
        open_sample_source(setup.source, rank=0, world_size=4)
