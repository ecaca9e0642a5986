"""``--plan``: what the recipe will ask of the machines, before anything is submitted.

Per component resources; bytes per sample and per optimizer step; Mooncake segment and watermark
margins; then the sections of the fit model (runtime/recipe/fit): trainer memory per rank, whether
the target fits the capture node, and a throughput model (capture, transfer, train seconds per
sample) that names the bottleneck and the trainer's expected idle fraction. Every number is
computed at ``data.max_length`` (the worst case) from the recipe and the stated hardware
assumptions in its ``plan`` section; the plan says where it is an estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from runtime.recipe import Recipe
from runtime.recipe.fit.capture_node import capture_node_fit
from runtime.recipe.fit.report import Finding, FitReport
from runtime.recipe.fit.slurm_request import eval_memory_request, memory_fixes, memory_request, node_memory_gib
from runtime.recipe.fit.store_budget import StoreBudget, store_budget
from runtime.recipe.fit.throughput import throughput_model
from runtime.recipe.fit.trainer_memory import trainer_memory_fit
from runtime.recipe.site_facts import (
    GPUS_PER_NODE_FACT,
    NODE_MEMORY_CAP_FACT,
    PLAN_FIELD_OF_FACT,
    SITE_FIELDS,
    SiteFacts,
)
from runtime.recipe.units import format_bytes

SITE_FACT_NAMES = {name: target for name, (target, _) in PLAN_FIELD_OF_FACT.items()}
"""Probe fact (or skipped-measurement) name -> the plan field it stands for."""
TIME_LIMIT_MARGIN = 1.5
"""The suggested time limit: the planned run (every sample at max_length, an upper bound) plus the
SGLang server's start, times this."""
TIME_LIMIT_FLOOR_MIN = 10
"""The suggested time limit is never below this (Slurm's start-up, the environment setup)."""


@dataclass
class Plan:
    """The plan: titled sections of (label, value) rows, findings, and the raw numbers."""

    sections: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    numbers: dict[str, float] = field(default_factory=dict)

    @property
    def blockers(self) -> list[Finding]:
        """Findings that stop a submission."""
        return [f for f in self.findings if f.level == "blocker"]

    def add(self, report: FitReport) -> None:
        """Append a section with its findings and numbers."""
        self.sections.append((report.title, report.rows))
        self.findings += report.findings
        self.numbers.update(report.numbers)

    def render(self) -> str:
        """Plain text (readable in a terminal and in a Slurm log)."""
        lines: list[str] = []
        for title, rows in self.sections:
            lines.append(f"== {title}")
            width = max((len(label) for label, _ in rows), default=0)
            lines += [f"  {label:<{width}}  {value}" for label, value in rows]
        lines.append("== verdict")
        for finding in self.findings:
            lines.append(f"  [{finding.level.upper()}] {finding.message}")
            lines += [f"      option: {option}" for option in finding.options]
        if not self.blockers:
            lines.append("  no blockers")
        return "\n".join(lines)


def make_plan(recipe: Recipe, facts: SiteFacts | None = None) -> Plan:
    """Compute the plan of ``recipe`` (whose ``plan`` fields carry ``facts`` when the probe measured
    them: ``--plan --site-facts``; the plan says which site figures are measured, which assumed)."""
    plan = Plan()
    budget = store_budget(recipe)
    for report in (
        _data_per_sample_and_step(recipe, budget),
        _mooncake(recipe, budget),
        trainer_memory_fit(recipe),
        capture_node_fit(recipe),
        throughput_model(recipe),
    ):
        plan.add(report)
    # First in the text, last computed: the time limit is read against the run time.
    components = _components(recipe, plan.numbers, facts or SiteFacts())
    plan.add(components)
    plan.sections.insert(0, plan.sections.pop())
    plan.add(_site_figures(recipe, facts or SiteFacts()))
    return plan


def _site_figures(recipe: Recipe, facts: SiteFacts) -> FitReport:
    """Each site figure the plan rests on: measured by ``--probe`` (how, where) or assumed."""
    report = FitReport("site figures (measured by --probe, or assumed)")
    for dotted in SITE_FIELDS:
        name = dotted.split(".", 1)[1]
        value = getattr(recipe.plan, name)
        shown = _site_value(name, value)
        found = facts.measured_field(dotted)
        if found is not None and found[1] != value:  # a --set after the facts wins
            how = f"set by --set (the probe measured {_site_value(name, found[1])})"
        elif found is not None:
            how = f"measured on {found[0]['where']}: {found[0]['how']}"
        else:
            why = next((w for n, w in facts.skipped.items() if SITE_FACT_NAMES.get(n) == dotted), None)
            given = "the recipe's value" if name in recipe.plan.model_fields_set else "the schema's default"
            how = f"assumed (the probe skipped it: {why}; {given})" if why else f"assumed ({given})"
        report.rows.append((dotted, f"{shown}  {how}"))
    if facts.sources:
        report.rows.append(("facts read from", ", ".join(facts.sources)))
    return report


def _site_value(name: str, value: float) -> str:
    """A site figure with its unit."""
    if name == "pcie_h2d_bytes_per_s":
        return f"{value / 1e9:.1f} GB/s per GPU"
    if name.endswith("_bytes"):
        return format_bytes(value)
    return f"{value:g} {'Gbit/s' if name == 'link_gbps' else 'GB/s'}"


def _components(recipe: Recipe, numbers: dict[str, float], facts: SiteFacts) -> FitReport:
    """Per component: shape, ``--mem`` (with its parts) and what ``--exclusive`` holds, against the
    memory the site allows (the probe's facts, or ``plan.slurm_max_mem_per_node_gib``); the time limit."""
    job = recipe.job
    report = FitReport("components (what the job asks Slurm for)")
    if job.layout == "one_node":
        report.rows.append(
            (
                "layout",
                f"one node (job.layout: one_node): both components share its "
                f"{max(job.capture.gpus_per_node, job.trainer.gpus_per_node)} GPU(s), "
                f"--mem={node_memory_gib(recipe)['one node']}G (the two requests below added)",
            )
        )
    for name in ("capture", "trainer"):
        res = getattr(job, name)
        request = memory_request(recipe, name)
        report.numbers[f"{name}_mem_request_gib"] = request.requested_gib
        report.rows.append(
            (
                name,
                f"{res.nodes} node(s) x {res.gpus_per_node} GPU(s), {res.tasks_per_node} task(s)/node, "
                f"{res.cpus_per_task} CPU(s)/task",
            )
        )
        report.rows.append((f"  memory per {name} node", request.describe()))
        if res.exclusive:
            report.rows.append(
                (
                    "  --exclusive",
                    f"holds each whole node for {res.tasks_per_node} task(s) on {res.gpus_per_node} GPU(s): GPUs, "
                    f"cores and memory beyond these stay idle for the job (job.{name}.exclusive: false shares the node)",
                )
            )
    if recipe.eval is not None:
        eval_request = eval_memory_request(recipe)
        report.numbers["eval_mem_request_gib"] = eval_request.requested_gib
        report.rows.append(
            (
                "eval job (launcher eval)",
                f"1 capture-kind node, {recipe.eval.time_limit_min} min (eval.time_limit_min), "
                f"{eval_request.describe()}",
            )
        )
    _memory_caps(recipe, report, facts)
    _gpus_seen(recipe, report, facts)
    report.rows.append(("time limit", _time_limit(recipe, report, numbers)))
    return report


def _memory_caps(recipe: Recipe, report: FitReport, facts: SiteFacts) -> None:
    """Each component's ``--mem`` against the memory its nodes allow: the probe's measured cap of that
    node (a blocker above it, naming both numbers), or the recipe's ``plan.slurm_max_mem_per_node_gib``
    (the recipe checks refuse above it); with neither, a warning naming what the site must allow."""
    cap = recipe.plan.slurm_max_mem_per_node_gib
    unknown: list[str] = []
    for name, requested in node_memory_gib(recipe).items():
        # The one node of job.layout: one_node is measured by the probe's capture task.
        component = "capture" if name == "one node" else name
        measured = facts.component_fact(NODE_MEMORY_CAP_FACT, component)
        if measured is not None:
            node_cap, fact = measured
            report.rows.append(
                (f"memory cap, {name} node", f"{node_cap} GiB, measured on {fact['where']}: {fact['how']}")
            )
            if requested > node_cap:
                report.findings.append(
                    Finding(
                        "blocker",
                        f"the {name} node's --mem={requested}G is above the {node_cap} GiB its node allows (measured "
                        f'by the probe on {fact["where"]}: {fact["how"]}): Slurm refuses such a request ("Requested '
                        'node configuration is not available"), or the node cannot give it',
                        tuple(
                            memory_fixes(recipe, component)
                            + (["job.layout: separate_nodes (a node for each component)"] if name == "one node" else [])
                        ),
                    )
                )
        elif cap is not None:
            report.rows.append((f"memory cap, {name} node", f"{cap} GiB (plan.slurm_max_mem_per_node_gib)"))
        else:
            unknown.append(f"--mem={requested}G on a {name} node")
    if unknown:
        report.rows.append(("memory cap", "none known (no plan.slurm_max_mem_per_node_gib, no probe facts)"))
        report.findings.append(
            Finding(
                "warn",
                f"the site's memory per node is not known: the site must allow {' and '.join(unknown)} (Slurm refuses "
                "a --mem above a node's RealMemory or MaxMemPerNode)",
                (
                    "python3 -m launcher RECIPE --probe, then --plan --site-facts runs/NAME/STAMP/site_facts",
                    "--set plan.slurm_max_mem_per_node_gib=N (MaxMemPerNode, or RealMemory of `scontrol show node`)",
                ),
            )
        )


def _gpus_seen(recipe: Recipe, report: FitReport, facts: SiteFacts) -> None:
    """A blocker when the probe saw fewer GPUs on a component's node than the recipe asks for."""
    for name in ("capture", "trainer"):
        seen = facts.component_fact(GPUS_PER_NODE_FACT, name)
        wanted = getattr(recipe.job, name).gpus_per_node
        if seen is not None and wanted and seen[0] < wanted:
            report.findings.append(
                Finding(
                    "blocker",
                    f"the probe saw {seen[0]} GPU(s) on the {name} node ({seen[1]['where']}: {seen[1]['how']}); the "
                    f"recipe asks for {wanted} (job.{name}.gpus_per_node)",
                    (f"--set job.{name}.gpus_per_node={seen[0]}, or use nodes with {wanted} GPUs",),
                )
            )


def _time_limit(recipe: Recipe, report: FitReport, numbers: dict[str, float]) -> str:
    """The recipe's time limit against the planned run (and the SGLang server's start), and why it
    is kept; a warning when the run would not fit it."""
    job = recipe.job
    limit = f"{job.time_limit_min} min ({job.time_limit_min / 60:.1f} h, job.time_limit_min), requeue up to {job.max_requeues} times"
    run_s = numbers.get("run_seconds")
    if not run_s:
        return limit + " (no run time planned: data.num_rows unknown)"
    start_s = recipe.capture.sglang.health_timeout_s if recipe.capture.engine == "sglang" else 0
    needed_s = run_s + start_s
    suggested_min = max(TIME_LIMIT_FLOOR_MIN, math.ceil(needed_s * TIME_LIMIT_MARGIN / 60))
    start = f" + up to {_hours(start_s)} of server start (capture.sglang.health_timeout_s)" if start_s else ""
    report.numbers.update(time_limit_suggested_min=suggested_min)
    if job.time_limit_min * 60 < needed_s:
        report.findings.append(
            Finding(
                "warn",
                f"job.time_limit_min {job.time_limit_min} is below the planned {_hours(needed_s)} "
                f"({_hours(run_s)} of run{start}): the job reaches its limit and continues only through "
                f"requeues (up to {job.max_requeues}), each restarting the capture server",
                (f"--set job.time_limit_min={suggested_min} (the plan x {TIME_LIMIT_MARGIN:g})",),
            )
        )
    return (
        f"{limit}; the plan needs {_hours(run_s)} of run{start}, x {TIME_LIMIT_MARGIN:g} (at least "
        f"{TIME_LIMIT_FLOOR_MIN} min): --set job.time_limit_min={suggested_min}. The recipe's value is kept: the "
        "run time rests on assumed rates until a real run measures them, and a time-out only requeues"
    )


def _hours(seconds: float) -> str:
    """``0.89 h``, or minutes below an hour (``4.2 min``)."""
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def _data_per_sample_and_step(recipe: Recipe, budget: StoreBudget) -> FitReport:
    sample, step_bytes, t = budget.sample, budget.step_bytes, recipe.trainer
    report = FitReport("data per sample and per step (at data.max_length)")
    report.numbers.update(
        sample_feature_bytes=sample.feature_bytes, sample_bytes=sample.total_bytes, step_bytes=step_bytes
    )
    report.rows += [
        ("tokens per sample T", f"{recipe.data.max_length:,}"),
        ("features T x (n_aux+1) x H x 2", f"{sample.feature_bytes:,} B ({format_bytes(sample.feature_bytes)})"),
        ("whole sample (+ ids, mask, meta)", f"{sample.total_bytes:,} B ({format_bytes(sample.total_bytes)})"),
        (
            "global batch G",
            f"{t.global_batch_size} = {t.micro_batch_size} x {t.gradient_accumulation_steps} x "
            f"{recipe.trainer_world_size} ranks",
        ),
        ("bytes per optimizer step", f"{step_bytes:,} B ({format_bytes(step_bytes)})"),
    ]
    return report


def _mooncake(recipe: Recipe, budget: StoreBudget) -> FitReport:
    tr, g = recipe.transport, recipe.trainer.global_batch_size
    report = FitReport("Mooncake")
    report.rows += [
        ("protocol", f"{tr.protocol}, bind {tr.bind_address}"),
        ("global segment", format_bytes(tr.global_segment_bytes)),
        (
            "store cap (eviction ratio)",
            f"{format_bytes(tr.store_cap_bytes)} ({tr.store_cap_bytes / tr.global_segment_bytes:.4f})",
        ),
        ("sample watermarks high/low", f"{tr.high_watermark_samples} / {tr.low_watermark_samples} (G = {g})"),
        (
            "byte watermarks high/low",
            f"{format_bytes(tr.high_watermark_bytes)} / {format_bytes(tr.low_watermark_bytes)}",
        ),
        (
            "one step of largest samples",
            f"{format_bytes(budget.step_bytes)} (margin to high watermark {format_bytes(budget.step_margin_bytes)})",
        ),
        ("lease / transfer timeout", f"{tr.kv_lease_ttl_s} s / {tr.transfer_timeout_s} s"),
    ]
    # The recipe checks refuse watermarks that do not (runtime/recipe/checks.py).
    report.findings.append(Finding("ok", "watermarks hold one global step and stay under the eviction cap"))
    return report
