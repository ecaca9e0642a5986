"""The cross-process contracts of runtime/shared/contracts.py: the sample check, the step's sample
indices, and the typed smoke-gate records as the components write them and the launcher reads them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from launcher.gate import FAIL, PASS, job_checks
from runtime.shared.contracts import (
    CAPTURE_GATE_FILE,
    TRAINER_GATE_FILE,
    CapturedSample,
    CaptureGateRecord,
    CheckpointGateRecord,
    FieldRecord,
    LossRecord,
    RankGateRecord,
    SampleContractRecord,
    StageRecord,
    TrainerGateRecord,
    read_record,
    sample_problems,
    step_sample_indices,
    write_record,
)


def _sample(
    tokens: int = 6, hidden: int = 4, num_aux: int = 2, hs_dtype: torch.dtype = torch.bfloat16
) -> CapturedSample:
    meta = {
        "g": 3,
        "epoch": 0,
        "row_id": 1,
        "num_tokens": tokens,
        "hidden_size": hidden,
        "aux_layer_ids": [0, 1],
        "target_revision": None,
        "engine": "embedded",
        "fields": {},
    }
    return CapturedSample(
        g=3,
        ids=torch.zeros(tokens, dtype=torch.int64),
        mask=torch.ones(tokens, dtype=torch.uint8),
        hs=torch.zeros(tokens, num_aux * hidden, dtype=hs_dtype),
        lhs=torch.zeros(tokens, hidden, dtype=torch.bfloat16),
        meta=meta,
    )


def test_sample_problems_name_the_field_dtype_and_shape() -> None:
    assert sample_problems(_sample(), [0, 1], hidden_size=4, max_length=16) == []
    problems = sample_problems(_sample(hs_dtype=torch.float32), [0, 1, 2], hidden_size=4, max_length=4)
    assert "sample g=3: field hs has dtype float32, expected bfloat16" in problems
    assert "sample g=3: field hs has shape (6, 8), expected (6, 12)" in problems
    assert "sample g=3: T=6 is outside 1..4 (data.max_length)" in problems
    assert any("meta aux_layer_ids [0, 1] != capture.aux_layer_ids [0, 1, 2]" in p for p in problems)


def test_step_sample_indices_deal_each_step_exactly_once() -> None:
    world, micro, accumulation = 3, 2, 2
    for step in range(3):
        per_rank = [step_sample_indices(step, r, world, micro, accumulation) for r in range(world)]
        assert sorted(g for part in per_rank for g in part) == list(range(step * 12, (step + 1) * 12))
    assert step_sample_indices(1, 1, world, micro, accumulation) == [14, 15, 20, 21]


def _passing_trainer_record() -> TrainerGateRecord:
    contract = SampleContractRecord(samples=[0], fields={"ids": FieldRecord(dtype="int64", shape=[5])})
    return TrainerGateRecord(
        passed=True,
        step=1,
        world_size=1,
        update_finite=True,
        update_applied=True,
        grad_norm=0.5,
        loss=LossRecord(total=2.0, ce=1.0, l1=1.0, confidence=0.1),
        ranks=[
            RankGateRecord(
                rank=0,
                terms_finite={"ce": True},
                params_finite_after_update=True,
                samples=[0],
                sample_contract=contract,
            )
        ],
        checkpoint=CheckpointGateRecord(path="ck", weights_sha256="ab", reloaded_sha256="ab", reload_matches=True),
    )


def _write_capture_ok(job_dir: Path) -> None:
    stages = {name: StageRecord(ok=True, detail=f"{name} ok") for name in ("data", "master", "engine", "capture")}
    write_record(job_dir / CAPTURE_GATE_FILE, CaptureGateRecord(stages=stages))


def test_records_round_trip_and_the_launcher_reads_them(tmp_path: Path) -> None:
    _write_capture_ok(tmp_path)
    record = _passing_trainer_record()
    record.grad_norm = float("nan")  # NaN survives the round trip as JSON's NaN
    write_record(tmp_path / TRAINER_GATE_FILE, record)
    back = read_record(tmp_path / TRAINER_GATE_FILE, TrainerGateRecord)
    assert back is not None and math.isnan(back.grad_norm or 0.0) and back.ranks[0].sample_contract.samples == [0]

    write_record(tmp_path / TRAINER_GATE_FILE, _passing_trainer_record())
    assert [c.status for c in job_checks(tmp_path)] == [PASS] * 5


def test_an_update_that_was_not_applied_fails_check_7_by_its_flag(tmp_path: Path) -> None:
    _write_capture_ok(tmp_path)
    record = _passing_trainer_record()
    record.update_applied = False
    write_record(tmp_path / TRAINER_GATE_FILE, record)
    statuses = {c.name: c.status for c in job_checks(tmp_path)}
    assert statuses["finite update on every rank"] == FAIL
    assert statuses["captured sample contract"] == PASS


def test_a_record_of_another_shape_is_named_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / TRAINER_GATE_FILE
    assert read_record(path, TrainerGateRecord) is None
    path.write_text('{"format": "dspark-trainer-gate/1", "step": "one", "surprise": 1}')
    with pytest.raises(ValueError, match=r"trainer_gate\.json: not a valid TrainerGateRecord .*fix: delete it"):
        read_record(path, TrainerGateRecord)
