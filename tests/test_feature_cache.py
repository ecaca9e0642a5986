"""The node-local feature cache (issue 14, item 1): capture each row once, train many epochs.

Unit tests: an entry verifies or is removed (flipped bytes, another digest, a truncated file), a disk
that cannot hold the rows is refused before training, and the producer's window captures a later
epoch's g only when asked. End to end on the tiny pipeline (--local, real Mooncake, 4 gloo ranks):
a cached run gives the same per-step losses, consumed rows and final weights as an uncached one while
capturing each row once; killed in epoch 2 and resumed with one entry corrupted and one deleted, it
captures exactly those two again (resumed with two capture nodes) and still reaches the same weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.recipe import load_recipe
from runtime.shared.prompt_order import PromptOrder
from runtime.trainer.feature_cache import FeatureCache, FeatureCacheError, features_digest
from runtime.trainer.setup import feature_source
from runtime.transport.window import WindowLimits, WindowState
from tests.support.cache_entries import make_sample
from tests.support.tiny_runs import committed_per_capture_task, final_weights, metrics, run_tiny

REPO = Path(__file__).resolve().parent.parent


def test_an_entry_round_trips_and_a_damaged_one_is_removed_not_served(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path, "a" * 64).open(rows=4, bytes_per_row=1024)
    sample = make_sample(g=2, row=3)
    cache.store(3, sample)
    back = cache.load(3, g=9, epoch=2)
    assert back is not None and back.g == 9 and back.meta["epoch"] == 2 and back.meta["from_feature_cache"]
    for name, tensor in sample.tensors().items():
        assert torch.equal(getattr(back, name), tensor), name

    # 16 bytes flipped near the end of the file (inside the tensor data): the checksum catches it.
    path = cache.entry_path(3)
    data = bytearray(path.read_bytes())
    data[-40:-24] = bytes(b ^ 0xFF for b in data[-40:-24])
    path.write_bytes(bytes(data))
    assert cache.load(3, g=9, epoch=2) is None and not path.exists() and cache.corrupt == 1

    # Truncated, and written for another digest (another target or data file): both refused.
    cache.store(3, sample)
    path.write_bytes(path.read_bytes()[:100])
    assert cache.load(3, g=9, epoch=2) is None and not path.exists()
    FeatureCache(tmp_path, "a" * 64).store(1, make_sample(g=0, row=1))
    other = FeatureCache(tmp_path, "a" * 24 + "b" * 40)  # same folder prefix, other digest
    assert other.entry_path(1) == cache.entry_path(1)
    assert other.load(1, g=5, epoch=1) is None and cache.corrupt == 2 and other.corrupt == 1


def test_a_disk_that_cannot_hold_the_rows_is_refused_with_both_numbers(tmp_path: Path) -> None:
    with pytest.raises(FeatureCacheError) as err:
        FeatureCache(tmp_path, "c" * 64).open(rows=10, bytes_per_row=10**18)
    text = str(err.value)
    assert str(tmp_path) in text and "10 of 10 rows still to cache" in text and "free" in text
    assert "trainer.feature_cache.enabled: false" in text


def test_the_digest_follows_what_determines_the_features_only() -> None:
    base = feature_source(load_recipe(REPO / "recipes" / "tiny.yaml").recipe)
    other_target = feature_source(
        load_recipe(REPO / "recipes" / "tiny.yaml", overrides=["capture.aux_layer_ids=[1,2,5]"]).recipe
    )
    other_seed = feature_source(
        load_recipe(REPO / "recipes" / "tiny.yaml", overrides=["trainer.seed=7", "trainer.epochs=3"]).recipe
    )
    assert features_digest(base, "d" * 64) == features_digest(other_seed, "d" * 64)
    assert features_digest(base, "d" * 64) != features_digest(other_target, "d" * 64)
    assert features_digest(base, "d" * 64) != features_digest(base, "e" * 64)


def test_the_window_captures_a_later_epoch_only_when_asked() -> None:
    window = WindowState(WindowLimits(8, 4, 10**9, 10**9, 4))
    window.asked_from = 10  # epoch 1 starts at g = 10
    window.observe(6, {})
    assert window.missing() == [6, 7, 8, 9], "epoch 0 in full, nothing of epoch 1"
    window.asked = {11, 13}
    assert window.missing() == [6, 7, 8, 9, 11, 13]
    assert window.claim(8) == [6, 7, 8, 9, 11, 13]


# ------------------------------------------------------------------------------------------------
# end to end on the tiny pipeline
# ------------------------------------------------------------------------------------------------


def committed_captures(job_dir: Path) -> int:
    """Samples the capture component committed in a job (summed over its capture tasks)."""
    counts = committed_per_capture_task(job_dir)
    assert counts, f"no capture log in {job_dir / 'logs'}"
    return sum(counts.values())


def trainer_log(job_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((job_dir / "logs").glob("*trainer_0*.out")))


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.distributed
def test_cached_runs_train_exactly_like_uncached_and_resume_in_epoch_2(
    tmp_path: Path, tiny_reference_run: Path
) -> None:
    runs = tmp_path / "runs"
    cache_dir = tmp_path / "feature_cache"
    checkpoints = tmp_path / "checkpoints"
    cached = ["trainer.feature_cache.enabled=true", f"trainer.feature_cache.dir={cache_dir}"]

    plain = tiny_reference_run  # uncached, 32 steps: 2 epochs of 128 rows, global batch 8
    expected = metrics(plain)
    assert committed_captures(plain) >= 256, "without the cache every epoch is captured"

    # Stopped at step 20 (in epoch 2: steps 17-32), with the cache filled by epoch 1.
    first = run_tiny("local", runs, *cached, "trainer.max_steps=20", f"trainer.checkpoint.dir={checkpoints}")
    assert committed_captures(first) < 128 + 3 * 8, "epoch 2 came from the cache, not from new captures"
    got = metrics(first)
    assert [r["step"] for r in got] == list(range(1, 21))
    assert [r["loss"] for r in got] == [r["loss"] for r in expected[:20]]
    assert [r["row_indices"] for r in got] == [r["row_indices"] for r in expected[:20]]
    assert "feature cache:" in trainer_log(first) and " hits" in trainer_log(first)

    # Damage the cache: flip bytes in the entry of the first row of step 22, delete step 25's first row.
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml").recipe
    order = PromptOrder(recipe.data.num_rows, recipe.trainer.effective_prompt_seed, recipe.trainer.epochs, None)
    (folder,) = list(cache_dir.iterdir())
    flipped = folder / f"row{order.locate(21 * 8).row_index:09d}.safetensors"
    deleted = folder / f"row{order.locate(24 * 8).row_index:09d}.safetensors"
    data = bytearray(flipped.read_bytes())
    data[-64:-48] = bytes(b ^ 0x5A for b in data[-64:-48])
    flipped.write_bytes(bytes(data))
    deleted.unlink()

    # Resumed with two capture nodes (issue 14 item 3): the asked samples are captured by their shares.
    resumed = run_tiny(
        "local",
        runs,
        *cached,
        "trainer.checkpoint.resume_from=auto",
        f"trainer.checkpoint.dir={checkpoints}",
        "job.capture.nodes=2",
        expected_warnings=("is unusable",),  # the damaged entry is named, removed and captured again
    )
    got = metrics(resumed)
    assert [r["step"] for r in got] == list(range(21, 33)), "continued from step 20"
    assert [r["loss"] for r in got] == [r["loss"] for r in expected[20:]]
    assert [r["row_indices"] for r in got] == [r["row_indices"] for r in expected[20:]]
    assert committed_captures(resumed) == 2, "exactly the corrupted and the deleted entry were captured again"
    assert "is unusable" in trainer_log(resumed), "the corrupt entry was named"
    assert final_weights(checkpoints) == final_weights(plain / "checkpoints")
