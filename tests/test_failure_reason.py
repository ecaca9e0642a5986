"""Why a Slurm job failed is where the operator looks: ``status`` names it in one line (spent requeues, the
first task that died, or the batch script's own first error), and ``logs`` shows the batch log of a job
whose components never started. (The real thing on the local Slurm cluster: tests/test_k3_rehearsal.py.)"""

from __future__ import annotations

import io
from pathlib import Path

from launcher.control import print_logs
from launcher.deaths import Death, claim_first_death
from launcher.failure_reason import batch_log_path, failure_reason, first_batch_error, record_not_requeued
from launcher.jobs import JobRecord

BASH_REFUSAL = (
    "/var/spool/slurmd/job00042/slurm_script: line 41: K3_FEATURE_CACHE_DIR: export K3_FEATURE_CACHE_DIR before "
    "sbatch (used by trainer.feature_cache.dir)"
)


def _record(job_dir: Path) -> JobRecord:
    return JobRecord(
        job_id="42", mode="slurm", name="k3", job_dir=str(job_dir), recipe_source="recipes/kimi_k3_v1c.yaml",
        recipe_digest="0" * 64, smoke=False, probe=True, components={"capture": 1, "trainer": 4},
    )  # fmt: skip


def test_a_job_that_failed_before_its_components_started_says_the_batch_scripts_error(tmp_path: Path) -> None:
    log = batch_log_path(tmp_path, "42")
    log.parent.mkdir()
    log.write_text(f"some site banner\n{BASH_REFUSAL}\n[dspark] trainer finished with exit code 1\n")
    assert first_batch_error(log) == (
        "batch script line 41: K3_FEATURE_CACHE_DIR: export K3_FEATURE_CACHE_DIR before sbatch (used by "
        "trainer.feature_cache.dir)"
    )
    record = _record(tmp_path)
    reason = failure_reason(tmp_path, "42", [record.log_path("trainer", 0)])
    assert reason.startswith("the batch script failed before its components started: batch script line 41: ")
    out = io.StringIO()
    print_logs(record, None, None, follow=False, out=out)
    shown = out.getvalue()
    assert f"==> {log} <==" in shown and BASH_REFUSAL in shown and "the batch log above is all the job wrote" in shown
    # once a task log exists, the batch log is not mixed into the components' logs
    record.log_path("trainer", 0).write_text("[trainer] step 1\n")
    out = io.StringIO()
    print_logs(record, None, None, follow=False, out=out)
    assert BASH_REFUSAL not in out.getvalue() and "[trainer] step 1" in out.getvalue()
    assert failure_reason(tmp_path, "42", [record.log_path("trainer", 0)]).startswith("the batch log says: ")


def test_the_first_death_and_spent_requeues_are_named_before_the_batch_log(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    batch_log_path(tmp_path, "42").write_text("[dspark] capture failed with exit code 1; stopping the trainer\n")
    claim_first_death(tmp_path, Death("capture", 0, 1, last_words="[capture rank 0] error: no target at /x. Fix: y"))
    assert failure_reason(tmp_path, "42", []) == "the cause: capture rank 0 exited with code 1: no target at /x"
    record_not_requeued(tmp_path, "Job not requeued because: timed-out too many times.", 3)
    assert failure_reason(tmp_path, "42", []) == (
        "not requeued: the job reached its time limit again after its 3 requeue(s) (job.max_requeues) were spent"
    )
    assert failure_reason(tmp_path / "nothing", "42", []) == ""
