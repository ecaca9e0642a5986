"""Smoke gate (``trainer_gate.json``) and the finite-update guard on injected NaNs, with real
trainer processes over gloo."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from runtime.trainer.file_source import read_sample_file, sample_file, write_sample_file
from tests.support.trainer_runs import launch, make_inputs, make_run

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("trainer-gate")
    target, samples = make_inputs(root, count=8)
    poisoned = root / "poisoned"
    shutil.copytree(samples, poisoned)
    bad = read_sample_file(sample_file(poisoned, 1), 1)
    bad.hs[5, :] = float("nan")  # one context row of sample g=1: every block anchored after it sees NaN
    write_sample_file(poisoned, bad)
    return target, samples, poisoned


def test_smoke_gate_passes_with_checkpoint_hash(tmp_path: Path, inputs, port_factory) -> None:
    target, samples, _ = inputs
    run = make_run(
        tmp_path,
        "smoke",
        world_size=2,
        target=target,
        samples=samples,
        overrides=["trainer.global_batch_size=2"],
        smoke=True,
    )
    result = launch(run, port_factory())
    assert result.ok, result.text()
    gate = json.loads((run.job_dir / "trainer_gate.json").read_text())
    assert gate["format"] == "dspark-trainer-gate/1"
    assert gate["passed"] is True and gate["problems"] == [] and gate["error"] is None
    assert gate["step"] == 1 and gate["world_size"] == 2 and gate["update_finite"] is True
    assert [r["rank"] for r in gate["ranks"]] == [0, 1]
    assert all(all(r["terms_finite"].values()) and r["params_finite_after_update"] for r in gate["ranks"])
    assert [r["samples"] for r in gate["ranks"]] == [[0], [1]]
    checkpoint = gate["checkpoint"]
    assert checkpoint["reload_matches"] is True
    assert checkpoint["weights_sha256"] == checkpoint["reloaded_sha256"] == run.state(1)["weights_sha256"]
    assert Path(gate["export"], "model.safetensors").is_file()
    assert run.state(1)["smoke"] is True


def test_smoke_gate_aborts_on_injected_nan_naming_step_term_and_rank(tmp_path: Path, inputs, port_factory) -> None:
    target, _, poisoned = inputs
    run = make_run(
        tmp_path,
        "nan",
        world_size=2,
        target=target,
        samples=poisoned,
        overrides=["trainer.global_batch_size=2"],
        smoke=True,
    )
    result = launch(run, port_factory())
    assert result.codes != [0, 0]
    gate = json.loads((run.job_dir / "trainer_gate.json").read_text())
    assert gate["passed"] is False and gate["update_finite"] is False
    problems = " ".join(gate["problems"])
    assert "not finite on rank(s) [1]" in problems  # sample g=1 went to rank 1
    assert "non-finite update at optimizer step 0" in gate["error"]
    assert "'ce'" in gate["error"] or "'l1'" in gate["error"]
    assert not run.checkpoint_dir.exists() or not any(run.checkpoint_dir.glob("step_*"))


def test_full_run_skips_and_counts_then_aborts_after_consecutive_skips(tmp_path: Path, inputs, port_factory) -> None:
    target, _, poisoned = inputs
    common = [
        "trainer.micro_batch_size=2",
        "trainer.gradient_accumulation_steps=1",
        "trainer.global_batch_size=2",
        "trainer.max_steps=3",
    ]
    skip = make_run(
        tmp_path,
        "skip",
        world_size=1,
        target=target,
        samples=poisoned,
        overrides=[*common, "trainer.max_consecutive_skips=2"],
    )
    result = launch(skip, port_factory())
    assert result.ok, result.text()
    metrics = skip.metrics()
    assert [m["skipped"] for m in metrics] == [1, 0, 0]
    assert [m["skipped_total"] for m in metrics] == [1, 1, 1]
    assert skip.state(3)["skipped_updates"] == 1
    weights = skip.exported(3)
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())
    # The export and the checkpoint record their run (no job.json here: no job id), the step and the weights.
    from runtime.shared.draft_provenance import verify_export_whole

    export = skip.checkpoint_dir / "export-step_00000003"
    provenance = json.loads((export / "provenance.json").read_text())
    assert (provenance["job_id"], provenance["step"], set(provenance["weights_sha256"])) == (
        None,
        3,
        {"model.safetensors"},
    )
    verify_export_whole(export)
    assert "job_id" in skip.state(3) and "job_dir" in skip.state(3)

    abort = make_run(
        tmp_path,
        "abort",
        world_size=1,
        target=target,
        samples=poisoned,
        overrides=[*common, "trainer.max_consecutive_skips=1"],
    )
    result = launch(abort, port_factory())
    assert result.codes == [1]
    assert "1 skipped updates in a row (trainer.max_consecutive_skips 1): aborting" in result.logs[0]
    assert "non-finite update at optimizer step 0" in result.logs[0]
