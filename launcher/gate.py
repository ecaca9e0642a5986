"""The smoke gate: eight checks, in order, stopping at the first failure with the reason and the fix.

    1 plan                      the recipe's plan has no blocker                        (login node)
    2 sglang patch              the installed SGLang carries our capture patch           (login node)
    3 data sha256               the data file hashes to data.expected_sha256             (login node)
    4 mooncake master health    the master answered and the producer connected           (capture_gate.json)
    5 engine health             the capture engine started and reported healthy          (capture_gate.json)
    6 captured sample contract  every sample the trainer received has the contract's
                                fields, dtypes and shapes                                 (trainer_gate.json)
    7 finite update             one optimizer update, finite on every trainer rank        (trainer_gate.json)
    8 checkpoint                written, read back, same weights hash                     (trainer_gate.json)

Checks 1-3 run before anything is submitted; their functions are also what refuses a normal
submission. Checks 4-8 read the records the components write in a smoke run. The result is a
PASS/FAIL table and ``gate.json`` in the job folder.
"""

from __future__ import annotations

import datetime as dt
import json
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runtime.files import atomic_write_text
from runtime.recipe import LoadedRecipe
from runtime.recipe.loader import resolve_recipe_path
from runtime.shared.contracts import (
    CAPTURE_GATE_FILE,
    JOB_FOLDER_SETTING,
    TRAINER_GATE_FILE,
    CaptureGateRecord,
    CaptureStageName,
    TrainerGateRecord,
    read_record,
)

GATE_FORMAT = "dspark-gate/1"
GATE_FILENAME = "gate.json"

PASS, FAIL, SKIP, NOT_RUN, PENDING = "PASS", "FAIL", "SKIP", "NOT RUN", "PENDING"
CHECK_NAMES = (
    "plan",
    "sglang patch",
    "data sha256",
    "mooncake master health",
    "engine health",
    "captured sample contract",
    "finite update on every rank",
    "checkpoint written, reloaded, hashed",
)
PREFLIGHT = CHECK_NAMES[:3]


@dataclass
class Check:
    """One row of the gate."""

    name: str
    status: str
    detail: str = ""
    fix: str = ""


# ----------------------------------------------------------------------------------------------
# checks 1-3: before submission
# ----------------------------------------------------------------------------------------------


def check_plan(loaded: LoadedRecipe, allow_blockers: bool = False) -> Check:
    """No blocker in the plan (or the operator allowed them)."""
    from launcher.plan import make_plan

    blockers = make_plan(loaded.recipe).blockers
    if not blockers:
        return Check("plan", PASS, "no blockers")
    text = "; ".join(b.message for b in blockers)
    if allow_blockers:
        return Check("plan", PASS, f"blockers allowed by --allow-blockers: {text}")
    options = [o for b in blockers for o in b.options]
    fix = "change the recipe (see --plan)" + (": " + " | ".join(options) if options else "")
    return Check("plan", FAIL, text, fix + ", or pass --allow-blockers")


def check_sglang_patch(loaded: LoadedRecipe, repo_root: Path) -> Check:
    """The installed SGLang (of ``capture.sglang.python`` when set) carries the recipe's patch
    target (embedded engine: skipped)."""
    recipe = loaded.recipe
    if recipe.capture.engine != "sglang":
        return Check("sglang patch", SKIP, f"capture.engine is {recipe.capture.engine}: no SGLang involved")
    from runtime.sglang_patching.pinned_wheel import check_wheel
    from runtime.shared.sglang_patch_check import check_installed, installed_sglang_root
    from runtime.shared.sglang_patch_manifest import PatchError

    target = recipe.capture.sglang.patch_target
    python = recipe.capture.sglang.python
    if python:  # the server runs in its own interpreter (e.g. the capture venv): check that one
        try:
            report = check_installed(target, python=resolve_recipe_path(python, repo_root))
        except PatchError as exc:
            return Check(
                "sglang patch", FAIL, str(exc), "fix capture.sglang.python (tools/bootstrap_sglang builds one)"
            )
    elif installed_sglang_root() is None:
        # A login node needs neither torch nor SGLang: check that the patch applies to the pinned
        # wheel; the capture component checks its own installed SGLang when the engine starts.
        report = check_wheel(target)
        if report.ok:
            return Check(
                "sglang patch",
                PASS,
                f"sglang is not installed here; the patch {report.target} applies to {report.tree} "
                "(the capture node's SGLang is checked when its engine starts)",
            )
        return Check("sglang patch", FAIL, "; ".join(report.problems), report.fix or "run tools/check_patch")
    else:
        report = check_installed(target)
    if report.ok:
        return Check("sglang patch", PASS, f"{report.tree}: sglang {report.version}, target {report.target}")
    return Check("sglang patch", FAIL, "; ".join(report.problems), report.fix)


def check_data(loaded: LoadedRecipe, repo_root: Path) -> Check:
    """``data.train_path`` hashes to ``data.expected_sha256`` and every row is sound (the verify tool's
    row checks: UTF-8 JSON, complete last line, ids in the vocabulary, mask of 0/1 that is not all
    zero, lengths within ``data.max_length``), before anything is submitted."""
    from runtime.shared.data_files import check_data_sha256, verify_data_file

    recipe = loaded.recipe
    data = recipe.data
    path = resolve_recipe_path(data.train_path, repo_root)
    try:
        digest = check_data_sha256(path, data.expected_sha256, recipe_file=loaded.source)
    except (ValueError, OSError) as exc:
        fix = (
            "prepare and verify the data (tools/prepare_data, tools/verify_data), or correct data.train_path / "
            "data.expected_sha256"
        )
        return Check("data sha256", FAIL, str(exc), fix)
    try:
        summary = verify_data_file(
            path, vocab_size=recipe.capture.vocab_size, max_length=data.max_length, num_rows=data.num_rows
        )
    except (ValueError, OSError) as exc:
        message, _, fix = str(exc).partition("; fix: ")
        return Check("data sha256", FAIL, message, fix or "regenerate the file with tools/prepare_data")
    return Check("data sha256", PASS, f"{path.name}: {digest[:16]}..., {summary.rows} rows checked")


def preflight_checks(loaded: LoadedRecipe, repo_root: Path, allow_blockers: bool = False) -> list[Check]:
    """Checks 1-3, stopping at the first failure."""
    checks = [check_plan(loaded, allow_blockers)]
    if checks[-1].status != FAIL:
        checks.append(check_sglang_patch(loaded, repo_root))
    if checks[-1].status != FAIL:
        checks.append(check_data(loaded, repo_root))
    return checks


# ----------------------------------------------------------------------------------------------
# checks 4-8: from the components' records
# ----------------------------------------------------------------------------------------------


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _log_hint(job_dir: Path, component: str) -> str:
    logs = sorted((job_dir / "logs").glob(f"*_{component}_0.out"))
    if not logs:
        return f"no {component} log yet in {job_dir / 'logs'}"
    tail = [line for line in logs[-1].read_text(errors="replace").splitlines() if line.strip()][-3:]
    return f"see {logs[-1]}; last lines: " + " | ".join(tail)


def job_checks(job_dir: Path) -> list[Check]:
    """Checks 4-8 from ``capture_gate.json`` and ``trainer_gate.json`` (missing records fail)."""
    capture = read_record(job_dir / CAPTURE_GATE_FILE, CaptureGateRecord) or CaptureGateRecord()
    trainer = read_record(job_dir / TRAINER_GATE_FILE, TrainerGateRecord)
    checks = [*_capture_checks(job_dir, capture)]
    if trainer is None:
        missing = Check(
            "captured sample contract",
            FAIL,
            "the trainer wrote no trainer_gate.json: " + _log_hint(job_dir, "trainer"),
            "read the trainer log; the trainer never finished its first step",
        )
        return [*checks, missing]
    if trainer.error and not trainer.ranks:
        failed = Check(
            "captured sample contract",
            FAIL,
            f"the trainer failed before its step: {trainer.error}",
            "read the trainer log",
        )
        return [*checks, failed]
    return [*checks, _contract_check(trainer), _update_check(trainer), _checkpoint_check(trainer)]


def _capture_checks(job_dir: Path, capture: CaptureGateRecord) -> list[Check]:
    """Checks 4 (master) and 5 (engine) from the capture stages."""

    def stage_check(name: str, stage: CaptureStageName, fix: str) -> Check:
        entry = capture.stages.get(stage)
        if entry is None:
            return Check(
                name, FAIL, f"the capture component recorded no '{stage}' stage: " + _log_hint(job_dir, "capture"), fix
            )
        return Check(name, PASS if entry.ok else FAIL, entry.detail, "" if entry.ok else fix)

    master = stage_check(
        "mooncake master health",
        "master",
        "check transport ports and bind address (a port in use, or capture.owns_master: false with no master "
        "running), and the master log in logs/mooncake_master.log",
    )
    data_stage = capture.stages.get("data")
    if data_stage is not None and not data_stage.ok:
        engine = Check(
            "engine health",
            FAIL,
            f"not started: the data check on the capture node failed: {data_stage.detail}",
            "make data.train_path readable on the capture node with the expected SHA-256",
        )
    else:
        engine = stage_check(
            "engine health",
            "engine",
            "see the capture log; for SGLang run tools/check_patch --apply and check capture.sglang.*, for the "
            "embedded engine check capture.target_path (tools/make_tiny_target for tiny)",
        )
    return [master, engine]


def _contract_problems(trainer: TrainerGateRecord) -> list[str]:
    return [p for r in trainer.ranks for p in r.sample_contract.problems]


def _contract_check(trainer: TrainerGateRecord) -> Check:
    """Check 6: every captured sample the trainer received kept the contract."""
    contracts = [r.sample_contract for r in trainer.ranks]
    samples = sorted(g for c in contracts for g in c.samples)
    problems = _contract_problems(trainer)
    if problems or not samples:
        detail = "; ".join(problems) or "no captured sample reached the trainer"
        fix = "the capture engine and the recipe disagree (capture.aux_layer_ids, hidden_size, dtypes)"
        return Check("captured sample contract", FAIL, detail, fix)
    fields = next((c.fields for c in contracts if c.fields), {})
    shown = ", ".join(f"{k} {v.dtype}{v.shape}" for k, v in fields.items())
    return Check("captured sample contract", PASS, f"samples {samples}: {shown}")


def _update_check(trainer: TrainerGateRecord) -> Check:
    """Check 7: the update was finite on every rank, applied, and left finite parameters."""
    name = "finite update on every rank"
    finite_after = bool(trainer.ranks) and all(r.params_finite_after_update for r in trainer.ranks)
    if trainer.update_finite and trainer.update_applied and finite_after:
        loss = trainer.loss.total if trainer.loss else float("nan")
        grad_norm = trainer.grad_norm if trainer.grad_norm is not None else float("nan")
        detail = f"step {trainer.step} on {trainer.world_size} ranks, grad norm {grad_norm:.4g}, loss {loss:.4g}"
        return Check(name, PASS, detail)
    contract = set(_contract_problems(trainer))
    other = [p for p in trainer.problems if p not in contract]
    detail = f"optimizer update {trainer.step}: " + (
        "; ".join(other) or str(trainer.error or "the update was not finite")
    )
    fix = (
        "find the rank and term named here; check its samples (NaN/inf in hs or lhs), the learning rate and the "
        "loss weights"
    )
    return Check(name, FAIL, detail, fix)


def _checkpoint_check(trainer: TrainerGateRecord) -> Check:
    """Check 8: the smoke step's checkpoint was written, read back and hashed equal."""
    name = "checkpoint written, reloaded, hashed"
    point = trainer.checkpoint
    if point is not None and point.reload_matches:
        return Check(name, PASS, f"{point.path}: weights sha256 {point.weights_sha256}")
    saved = point.weights_sha256 if point else None
    reloaded = point.reloaded_sha256 if point else None
    detail = f"checkpoint {point.path if point else None}: saved {saved}, read back {reloaded}"
    return Check(
        name, FAIL, detail, "check the checkpoint folder's file system (space, permissions) and the trainer log"
    )


# ----------------------------------------------------------------------------------------------
# the gate as a whole
# ----------------------------------------------------------------------------------------------


def settle(checks: list[Check], pending: bool = False) -> list[Check]:
    """All eight rows: everything after the first failure is NOT RUN; rows without a result are
    PENDING (the job still runs) or NOT RUN."""
    by_name = {c.name: c for c in checks}
    rows: list[Check] = []
    failed = False
    for name in CHECK_NAMES:
        check = by_name.get(name)
        if failed:
            rows.append(Check(name, NOT_RUN, "an earlier check failed"))
        elif check is None:
            rows.append(Check(name, PENDING if pending else NOT_RUN, "waiting for the job" if pending else ""))
        else:
            rows.append(check)
            failed = check.status == FAIL
    return rows


def passed(rows: list[Check]) -> bool:
    """Every check passed or was skipped."""
    return all(r.status in {PASS, SKIP} for r in rows)


def write_gate(job_dir: Path, rows: list[Check], job_id: str | None, loaded_source: str, digest: str) -> Path:
    """Write ``gate.json`` atomically."""
    payload = {
        "format": GATE_FORMAT,
        "passed": passed(rows),
        "job_id": job_id,
        "recipe": loaded_source,
        "recipe_digest": digest,
        "written_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "checks": [asdict(r) for r in rows],
    }
    target = job_dir / GATE_FILENAME
    atomic_write_text(target, json.dumps(payload, indent=2) + "\n", JOB_FOLDER_SETTING)
    return target


def read_preflight(job_dir: Path) -> list[Check]:
    """The pre-submission rows recorded in ``gate.json`` (empty when absent)."""
    payload = _read(job_dir / GATE_FILENAME) or {}
    return [
        Check(**c) for c in payload.get("checks", []) if c["name"] in PREFLIGHT and c["status"] in {PASS, SKIP, FAIL}
    ]


def render(rows: list[Check]) -> str:
    """The PASS/FAIL table with the fix under each failure."""
    indent = " " * 52
    lines = [f"  {'#':>2}  {'check':<38} {'result':<8} detail"]
    for index, row in enumerate(rows, start=1):
        detail = row.detail if len(row.detail) <= 600 else row.detail[:597] + "..."
        wrapped = textwrap.wrap(detail, 100) or [""]
        lines.append(f"  {index:>2}  {row.name:<38} {row.status:<8} {wrapped[0]}")
        lines += [indent + part for part in wrapped[1:]]
        if row.status == FAIL and row.fix:
            fix = textwrap.wrap("fix: " + row.fix, 100)
            lines += [indent + part for part in fix]
    verdict = "PASS" if passed(rows) else ("PENDING" if any(r.status == PENDING for r in rows) else "FAIL")
    lines.append(f"  smoke gate: {verdict}")
    return "\n".join(lines)
