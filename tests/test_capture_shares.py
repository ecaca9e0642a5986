"""Several capture nodes in one job (issue 14, item 3): ``job.capture.nodes: N`` runs N engine +
producer pairs; share ``k`` captures the g with ``g % N == k`` into the same store.

Unit: the window of each share claims and cleans up only its own g while resident samples and the
watermarks stay global; the recipe refuses node counts the engines cannot use. End to end on the
tiny pipeline (--local, real Mooncake, 4 gloo ranks): two capture processes feed one trainer, and
the run gives the same per-step losses, consumed rows and final weights as one capture node, with
both capture processes committing samples.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.recipe import load_recipe
from runtime.recipe.capture_layout import capture_shares
from runtime.recipe.checks import check_recipe
from runtime.transport.window import WindowLimits, WindowState
from tests.support.tiny_runs import committed_per_capture_task, final_weights, metrics, run_tiny, weights_at

REPO = Path(__file__).resolve().parent.parent


def test_each_share_claims_its_own_g_and_the_watermarks_stay_global() -> None:
    limits = WindowLimits(8, 4, 10**9, 10**9, 4)
    first, second = (WindowState(limits, share_index=k, share_count=2) for k in (0, 1))
    for window in (first, second):
        window.observe(10, {10: 5, 11: 5, 3: 5, 4: 5})  # 3 and 4 are below the cursor: garbage
    assert first.claim(8) == [12, 14, 16] and second.claim(8) == [13, 15, 17]
    assert first.garbage() == [4] and second.garbage() == [3], "each cleans up its own"
    # Global residency: 4 resident + 3 in flight of its own; the other share's claims are not seen
    # until they are committed (the overshoot is at most one batch per share).
    assert first.resident_samples == 7 and not first.paused
    first.observe(10, {10: 5, 11: 5, 3: 5, 4: 5, 13: 5, 15: 5})  # the next scan sees the other share's commits
    assert first.resident_samples == 9 and first.paused, "the sample watermark counts every share's samples"


def test_capture_shares_follow_the_engine_and_bad_node_counts_are_refused() -> None:
    tiny = REPO / "recipes" / "tiny.yaml"
    assert capture_shares(load_recipe(tiny, ["job.capture.nodes=3"]).recipe) == 3
    k3 = REPO / "recipes" / "kimi_k3_v1c.yaml"
    assert capture_shares(load_recipe(k3, ["job.capture.nodes=2"]).recipe) == 2, "TP8 on 8 GPUs: a server per node"
    tp16 = load_recipe(k3, ["job.capture.nodes=2", "capture.sglang.tp_size=16"]).recipe
    assert capture_shares(tp16) == 1, "TP16 spans the two nodes: one server"
    problems = check_recipe(tp16.model_copy(update={"job": tp16.job.model_copy(deep=True)}))
    assert not [p for p in problems if p.path == "job.capture.nodes"]
    from runtime.recipe.errors import RecipeError

    with pytest.raises(RecipeError, match="job.capture.nodes.*not a multiple of the 2 nodes"):
        load_recipe(k3, ["job.capture.nodes=3", "capture.sglang.tp_size=16"])
    with pytest.raises(RecipeError, match="several SGLang servers that each span 2 nodes"):
        load_recipe(k3, ["job.capture.nodes=4", "capture.sglang.tp_size=16"])


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["local", pytest.param("slurm", marks=pytest.mark.slurm)])
def test_two_capture_nodes_train_exactly_like_one(
    mode: str, tmp_path: Path, tiny_reference_run: Path, request: pytest.FixtureRequest
) -> None:
    """Against the first 8 steps of the one-capture-node reference run. On Slurm: a hetjob whose capture
    group spans two of the local cluster's three nodes."""
    if mode == "slurm":
        request.getfixturevalue("slurm_cluster")
    two = run_tiny(mode, tmp_path / "runs", "trainer.max_steps=8", "job.capture.nodes=2")
    got, expected = metrics(two), metrics(tiny_reference_run)[:8]
    assert [r["step"] for r in got] == list(range(1, 9))
    assert [r["loss"] for r in got] == [r["loss"] for r in expected]
    assert [r["row_indices"] for r in got] == [r["row_indices"] for r in expected]
    assert final_weights(two / "checkpoints") == weights_at(tiny_reference_run / "checkpoints", 8)
    counts = committed_per_capture_task(two)
    assert sorted(counts) == [0, 1] and all(n >= 28 for n in counts.values()), counts  # 64 samples, about half each
    log = (two / "logs").glob("*_capture_1.out")
    assert any("capture share 1 of 2" in p.read_text(errors="replace") for p in log)
