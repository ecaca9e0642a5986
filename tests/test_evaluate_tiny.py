"""``python3 -m launcher eval JOB --local`` on the tiny reference run (32 optimizer steps): the trained
draft against the untrained floor on the held-out prompts, greedy and sampled, with the lossless
check, the teacher-forced tau beside it, the export folder holding the same draft as the checkpoint,
and the plots. The reference run is read, never written: results go to a temporary folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.shared.acceptance_length import POOLED_KEY
from tests.conftest import REPO_ROOT
from tests.support.launcher_cli import launch

pytestmark = pytest.mark.slow

TRAINED = "step_00000032"
SAMPLED_MARGIN = 0.03
"""How far the 32-step draft's acceptance length must clear the untrained floor at temperature 1.
Measured 1.233 against 1.178 on the pinned tiny world (tokens emitted per verify step; the world and the
draws are the same on every run of one machine type): 0.03 leaves about half the gap. The 32-step draft
is young: greedily it is still below the floor (1.38 against 1.56), since it first loses what an
untrained draft gets right and passes it near step 40. The product's claim, the default 96-step draft
clearing the floor by a token at both temperatures, is tests/test_first_run.py's."""


def _eval(job_dir: Path, out: Path, *args: str) -> dict:
    done = launch(["eval", str(job_dir), "--local", "--out", str(out), *args])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {"stdout": done.stdout, "results": json.loads((out / "results.json").read_text())}


def test_the_trained_draft_accepts_more_than_the_untrained_one_and_decoding_stays_lossless(
    tiny_reference_run: Path, tmp_path: Path
) -> None:
    run = _eval(tiny_reference_run, tmp_path / "checkpoint")
    results = run["results"]
    assert results["draft"] == {
        "label": TRAINED,
        "kind": "checkpoint",
        "path": str(tiny_reference_run / "checkpoints" / TRAINED),
        "step": 32,
    }
    assert results["sets"] == {"tiny-heldout": 32} and results["block_size"] == 7
    passes = {entry["temperature"]: entry["drafts"] for entry in results["passes"]}
    for label in (TRAINED, "untrained"):
        agreement = passes[0.0][label]["greedy_agreement"]
        assert agreement["identical"] == agreement["prompts"] == 32, agreement
        figures = passes[0.0][label]["overall"]
        assert figures["verify_steps"] > 100 and 1.0 <= figures[POOLED_KEY] <= 8.0
    trained = passes[1.0][TRAINED]["overall"][POOLED_KEY]
    floor = passes[1.0]["untrained"]["overall"][POOLED_KEY]
    assert trained >= floor + SAMPLED_MARGIN, (trained, floor)
    teacher = results["teacher_forced"]
    assert teacher[TRAINED]["tau"] > teacher["untrained"]["tau"] > 1.0
    assert "greedy outputs identical to the target's own greedy decoding: 32/32" in run["stdout"]
    assert (tmp_path / "checkpoint" / "summary.txt").read_text().startswith(f"eval of {TRAINED} on 32 prompts")
    for plot in ("slot_accept_rate.png", "calibration.png", "acceptance_over_steps.png"):
        assert (tmp_path / "checkpoint" / plot).stat().st_size > 1000
    assert not (tiny_reference_run / "eval").exists()

    # Every decode is on record, and an independent replay agrees: the figures are sums over the lines,
    # and plain transformers greedy decoding gives every recorded greedy output (replayed for 6 prompts).
    from runtime.evaluate.decodes import read_decodes

    lines = read_decodes(tmp_path / "checkpoint" / "decodes.jsonl")
    assert len(lines) == 32 * 2 * 3  # prompts x temperatures x (target alone, trained, untrained)
    assert {line["decoder"] for line in lines} == {"target alone", TRAINED, "untrained"}
    replay = subprocess.run(
        [sys.executable, "-m", "tools.replay_decodes", str(tmp_path / "checkpoint"), "--limit", "6"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=600,
    )
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
    assert "figures: 0 of results.json's acceptance lengths differ" in replay.stdout
    assert "greedy: 18/18 recorded outputs identical to transformers greedy" in replay.stdout

    # The exported draft (what SGLang would serve) is the same draft: the same weights, read both ways.
    import torch

    from runtime.evaluate.draft import build_draft
    from runtime.recipe import load_resolved
    from runtime.shared.checkpoint_folders import resolve_draft_source
    from runtime.trainer.draft_spec import DraftSpec

    spec = DraftSpec.from_recipe(load_resolved(tiny_reference_run / "recipe.resolved.json").recipe)
    checkpoints = tiny_reference_run / "checkpoints"
    export = resolve_draft_source(str(checkpoints / f"export-{TRAINED}"), checkpoints)
    assert export.kind == "export" and export.step == 32
    weights = [
        build_draft(source, spec, seed=0, device="cpu", dtype=torch.float32).state_dict()
        for source in (resolve_draft_source(TRAINED, checkpoints), export)
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
