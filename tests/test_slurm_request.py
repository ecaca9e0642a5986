"""What the job asks Slurm for matches the plan: ``--mem`` per component from the plan's host
memory plus the stated margin, the site's cap, the time limit against the planned run, and what
``--exclusive`` holds."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from launcher.plan import make_plan
from launcher.render import RenderOptions, render_script
from runtime.recipe import RecipeError, load_recipe
from runtime.recipe.fit.slurm_request import PROCESS_ALLOWANCE_BYTES, memory_request

REPO = Path(__file__).resolve().parent.parent
K3 = REPO / "recipes" / "kimi_k3_v1c.yaml"
GIB = 2**30


def _het_groups(script: str) -> tuple[str, str]:
    capture, _, trainer = script.partition("#SBATCH hetjob")
    return capture, trainer


def test_k3_mem_per_component_is_the_plans_host_memory_plus_the_margin() -> None:
    recipe = load_recipe(K3).recipe
    plan = make_plan(recipe)
    capture = memory_request(recipe, "capture")
    # the plan's figure of the capture node is exactly the host-memory row's
    assert capture.plan_bytes == plan.numbers["capture_host_bytes"]
    sample = 5_637_738_496
    margin = 8 * (PROCESS_ALLOWANCE_BYTES + sample) + 1 * GIB + 5_637_144_576
    assert capture.requested_gib == math.ceil((capture.plan_bytes + margin) / GIB) == 1900
    trainer = memory_request(recipe, "trainer")
    assert trainer.plan_bytes == 0 and trainer.requested_gib == math.ceil(
        (4 * (PROCESS_ALLOWANCE_BYTES + sample) + 4 * GIB) / GIB
    )
    text = plan.render()
    assert (
        "memory per capture node  --mem=1900G per node (derived: 763.28 GiB streamed experts + 1.00 TiB Mooncake segment"
        in text
    )
    assert f"memory per trainer node  --mem={trainer.requested_gib}G per node (derived:" in text
    assert "holds each whole node for 4 task(s) on 4 GPU(s)" in text
    assert "mem site default" not in text
    script_capture, script_trainer = _het_groups(render_script(recipe, RenderOptions(recipe_file="recipes/k3.yaml")))
    assert "#SBATCH --mem=1900G" in script_capture and "#SBATCH --mem=" not in script_trainer.replace(
        f"#SBATCH --mem={trainer.requested_gib}G", ""
    )
    assert f"#SBATCH --mem={trainer.requested_gib}G" in script_trainer


def test_an_explicit_mem_gib_wins_and_one_below_the_plan_is_refused() -> None:
    recipe = load_recipe(K3, ["job.trainer.mem_gib=500"]).recipe
    _, trainer = _het_groups(render_script(recipe, RenderOptions(recipe_file="recipes/k3.yaml")))
    assert "#SBATCH --mem=500G" in trainer
    assert "--mem=500G per node (job.trainer.mem_gib; the plan counts" in make_plan(recipe).render()
    with pytest.raises(RecipeError) as info:
        load_recipe(K3, ["job.capture.mem_gib=1000"])
    assert "job.capture.mem_gib" in str(info.value)
    assert "is 1000 GiB, below the 1900 GiB the plan counts on a capture node" in str(info.value)


def test_a_request_above_the_site_cap_is_refused_with_both_numbers_and_the_fix() -> None:
    assert load_recipe(K3, ["plan.slurm_max_mem_per_node_gib=1900"]).recipe.plan.slurm_max_mem_per_node_gib == 1900
    with pytest.raises(RecipeError) as info:
        load_recipe(K3, ["plan.slurm_max_mem_per_node_gib=1800"])
    message = str(info.value)
    assert "plan.slurm_max_mem_per_node_gib" in message
    assert "is 1800 GiB, below the 1900 GiB a capture node needs by the plan" in message
    assert "transport.segment_placement" in message  # the fix
    # the segment moved to the trainer node: the capture node fits the cap, the trainer's grows
    moved = load_recipe(K3, ["plan.slurm_max_mem_per_node_gib=1800", "transport.segment_placement=trainer"]).recipe
    assert memory_request(moved, "trainer").requested_gib == 1024 + 58


def test_the_plan_explains_the_time_limit_and_warns_when_the_run_would_not_fit() -> None:
    plan = make_plan(load_recipe(K3).recipe)
    text, run_s = plan.render(), plan.numbers["run_seconds"]
    suggested = math.ceil((run_s + 5400) * 1.5 / 60)  # + capture.sglang.health_timeout_s
    assert plan.numbers["time_limit_suggested_min"] == suggested
    assert "time limit" in text and "2880 min (48.0 h, job.time_limit_min)" in text
    assert f"the plan needs {run_s / 60:.1f} min of run + up to 1.50 h of server start" in text
    assert f"--set job.time_limit_min={suggested}" in text and "The recipe's value is kept" in text
    short = make_plan(load_recipe(K3, ["job.time_limit_min=60"]).recipe)
    (warning,) = [f for f in short.findings if "job.time_limit_min 60" in f.message]
    assert warning.level == "warn" and "requeues (up to 3)" in warning.message
    assert warning.options == (f"--set job.time_limit_min={suggested} (the plan x 1.5)",)
    assert not [f for f in plan.findings if "job.time_limit_min" in f.message]


def test_the_k3_smoke_job_asks_for_the_time_its_plan_needs_and_runbook_says_so() -> None:
    """The smoke overlay's time limit is its plan's suggestion rounded up to 10 minutes (no 4 h request
    for a job the docs call short), and RUNBOOK's two mentions name that number."""
    smoke = load_recipe(K3, smoke=True).recipe
    suggested = make_plan(smoke).numbers["time_limit_suggested_min"]
    assert smoke.job.time_limit_min == math.ceil(suggested / 10) * 10
    text = " ".join((REPO / "RUNBOOK.md").read_text().split())
    assert f"The smoke job asks Slurm for {smoke.job.time_limit_min} minutes on both nodes" in text
    assert f"{suggested} minutes" in text
    assert f"holds the job's two nodes for at most {smoke.job.time_limit_min} minutes" in text
    script = render_script(smoke, RenderOptions(recipe_file="recipes/kimi_k3_v1c.yaml", smoke=True))
    assert script.count(f"#SBATCH --time={smoke.job.time_limit_min}\n") == 2


def test_the_eval_job_asks_for_the_served_targets_memory_not_the_site_default() -> None:
    """The eval job serves K3 as capture does (experts streamed from host memory, 8 TP processes) with
    no Mooncake: its --mem is the streamed experts plus the allowances, below the capture node's."""
    from launcher.eval_job import render_eval_script
    from runtime.recipe.fit.slurm_request import eval_memory_request
    from runtime.recipe.schema import EvalSection, EvalSet

    k3 = load_recipe(K3).recipe
    eval_section = EvalSection(sets=[EvalSet(name="gsm8k", path="data/gsm8k.jsonl", sha256="0" * 64)])
    recipe = k3.model_copy(update={"eval": eval_section})
    request = eval_memory_request(recipe)
    capture = memory_request(recipe, "capture")
    assert request.plan_parts == {"streamed experts": capture.plan_parts["streamed experts"]}
    assert request.requested_gib == math.ceil(
        (capture.plan_parts["streamed experts"] + 8 * PROCESS_ALLOWANCE_BYTES) / GIB
    )
    assert request.requested_gib < capture.requested_gib
    script = render_eval_script(recipe, "recipes/k3.yaml")
    assert f"#SBATCH --mem={request.requested_gib}G" in script
    text = make_plan(recipe).render()
    assert (
        f"eval job (launcher eval)   1 capture-kind node, 60 min (eval.time_limit_min), --mem={request.requested_gib}G"
        in text
    )
    # the operator's figure for a capture-kind node wins, as for the training job's capture component
    pinned = recipe.model_copy(
        update={
            "job": recipe.job.model_copy(update={"capture": recipe.job.capture.model_copy(update={"mem_gib": 2000})})
        }
    )
    assert "#SBATCH --mem=2000G" in render_eval_script(pinned, "recipes/k3.yaml")


def test_the_k3_probe_asks_for_minutes_and_little_memory_and_reads_no_data(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from launcher.cli import main

    for name in ("K3_TARGET_DIR", "K3_DATA_DIR", "K3_INIT_CHECKPOINT", "K3_FEATURE_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    assert main(["kimi_k3_v1c", "--probe", "--dry-run"]) == 0
    script = capsys.readouterr().out
    job = render_script(load_recipe(K3).recipe, RenderOptions(recipe_file="recipes/kimi_k3_v1c.yaml"))
    for probe_group, job_group in zip(_het_groups(script), _het_groups(job), strict=True):
        minutes = int(probe_group.split("#SBATCH --time=")[1].split()[0])
        mem_gib = int(probe_group.split("#SBATCH --mem=")[1].split("G")[0])
        assert minutes <= 30 and mem_gib <= 32, probe_group
        assert mem_gib < int(job_group.split("#SBATCH --mem=")[1].split("G")[0]) / 3
        for same in ("--gpus-per-node=", "--ntasks-per-node=", "--exclusive"):  # the same node kinds
            assert (same in probe_group) == (same in job_group)
    assert "--probe" in script


def test_the_runbooks_cache_rate_figure_is_the_plans() -> None:
    """RUNBOOK section 5: "Below about N GB/s the plan's K3 run time passes one hour"."""
    text = " ".join((REPO / "RUNBOOK.md").read_text().split())
    rate = int(text.split("Below about ")[1].split(" GB/s the plan's K3 run time passes one hour")[0])

    def run_hours(gbps: float) -> float:
        return make_plan(load_recipe(K3, [f"plan.cache_read_gbps={gbps}"]).recipe).numbers["run_seconds"] / 3600

    assert run_hours(rate) <= 1.0 < run_hours(rate - 1)


def _runbook_numbers(text: str, pattern: str) -> list[str]:
    """The figures ``pattern``'s groups capture in RUNBOOK's text (whitespace folded); fails if absent."""
    found = re.search(pattern, text)
    assert found, f"RUNBOOK no longer says {pattern!r}: update this check with the sentence"
    return [group.replace(",", "") for group in found.groups()]


def _as_quoted(value: float, quoted: str) -> str:
    """``value`` written with as many decimals as the RUNBOOK's figure ``quoted``."""
    decimals = len(quoted.partition(".")[2])
    return f"{value:.{decimals}f}"


def test_the_runbooks_k3_figures_are_the_plans() -> None:
    """Each K3 figure RUNBOOK quotes from the plan (sections 2, 5, 7, 8, 8a) is recomputed from the plan
    code and compared at the precision the RUNBOOK writes it."""
    from runtime.recipe.fit.capture_hbm import capture_hbm_fit
    from runtime.recipe.fit.slurm_request import eval_memory_request, probe_memory_request

    text = " ".join((REPO / "RUNBOOK.md").read_text().split())
    recipe = load_recipe(K3).recipe
    n = make_plan(recipe).numbers
    no_cache = make_plan(load_recipe(K3, ["trainer.feature_cache.enabled=false"]).recipe).numbers
    two_nodes = make_plan(load_recipe(K3, ["job.capture.nodes=2"]).recipe).numbers
    rows = dict(capture_hbm_fit(recipe).rows)  # type: ignore[union-attr]
    tib, hour = 2**40, 3600
    streaming = recipe.capture.expert_streaming
    checks: list[tuple[str, list[float]]] = [
        (
            r"`--mem=(\d+)G` on the capture node \(([\d.]+) TiB of streamed",
            [n["capture_mem_request_gib"], n["capture_host_bytes"] / tib],
        ),
        (r"and `--mem=(\d+)G` on the trainer node", [n["trainer_mem_request_gib"]]),
        (
            r"~([\d,]+) GB of MXFP4 weights exceed one 8 x H200 node's ([\d,]+) GB",
            [n["target_weight_bytes"] / 1e9, n["capture_hbm_bytes"] / 1e9],
        ),
        (
            r"a GPU budget of (\d+) GB of experts per GPU keeps (\d+) of (\d+) MoE layers resident, the other (\d+)",
            [
                (streaming.gpu_budget_bytes or 0) / 1e9,
                n["streaming_resident_layers"],
                n["streaming_resident_layers"] + n["streaming_streamed_layers"],
                n["streaming_streamed_layers"],
            ],
        ),
        (
            r"K3: ([\d.]+) s \+ ([\d.]+) s \+ ([\d.]+) s = ([\d.]+) s of compute; ([\d.]+) s of copies",
            [
                n["prefill_expert_s"],
                n["prefill_dense_s"],
                n["prefill_attention_s"],
                n["prefill_compute_s"],
                n["prefill_pcie_s"],
            ],
        ),
        (r"one capture node starves the trainer \((\d+)% idle\)", [100 * no_cache["trainer_idle_fraction"]]),
        (r"trainer node's local disk \(([\d.]+) TiB\)", [n["feature_cache_bytes"] / tib]),
        (r"feature cache \(~([\d.]+) TiB; section 7\)", [n["feature_cache_bytes"] / tib]),
        (
            r"run time drops from ([\d.]+) h to about ([\d.]+) h \(the trainer still idles (\d+)% of it",
            [no_cache["run_seconds"] / hour, n["run_seconds"] / hour, 100 * n["trainer_idle_fraction"]],
        ),
        (
            r"the plan: ([\d.]+) h instead of ([\d.]+) h for K3",
            [two_nodes["run_seconds"] / hour, n["run_seconds"] / hour],
        ),
        (
            r"`plan.cache_read_gbps`: (\d+) TB and (\d+) GB/s",
            [recipe.plan.trainer_local_disk_bytes / 1e12, recipe.plan.cache_read_gbps],
        ),
        (
            r"three K3-size entries \(([\d.]+) GiB each: ([\d.]+) GiB of free space",
            [n["sample_bytes"] / GIB, 3 * n["sample_bytes"] / GIB],
        ),
        (
            r"small `--mem` \(the buffers it measures with: (\d+) GiB on K3's capture node, (\d+) GiB on its trainer node\)",
            [
                probe_memory_request(recipe, "capture").requested_gib,
                probe_memory_request(recipe, "trainer").requested_gib,
            ],
        ),
        (
            r"the draft's full state \((\d+) GiB of fp32 weights and AdamW moments\)",
            [n["draft_trainable_params"] * 12 / GIB],
        ),
        (r"the served target's memory, about (\d+) GiB\)", [eval_memory_request(recipe).requested_gib]),
        (
            r"`eval job` row once the recipe has `eval:`; about (\d+) GiB for K3\)",
            [eval_memory_request(recipe).requested_gib],
        ),
    ]
    eval_row, batch_row = rows["eval decode (streamed)"], rows["eval batch for 1 h"]
    eval_hours = {int(b): float(h) for b, h in re.findall(r"batch (\d+): [^;]*?, ([\d.]+) h", eval_row)}
    checks += [
        (
            r"`eval decode \(streamed\)` row: about ([\d.]+) h for 1,000 prompts x 256 tokens at batch 128",
            [eval_hours[128]],
        ),
        (r"new tokens take about ([\d.]+) h at batch 1 and ([\d.]+) h at batch 128", [eval_hours[1], eval_hours[128]]),
        (r"the smallest batch that finishes within an hour \((\d+)\)", [float(batch_row.split(">= ")[1].split()[0])]),
        (r"`capture.sglang.max_total_tokens` \(([\d,]+) for K3", [recipe.capture.sglang.max_total_tokens]),
    ]
    wrong = []
    for pattern, values in checks:
        quoted = _runbook_numbers(text, pattern)
        assert len(quoted) == len(values), pattern
        for figure, value in zip(quoted, values, strict=True):
            if _as_quoted(value, figure) != figure:
                wrong.append(f"RUNBOOK says {figure} where the plan gives {value:g} ({pattern})")
    assert not wrong, "\n".join(wrong)
