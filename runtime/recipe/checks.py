"""Checks that relate several recipe fields. Each message names both values and the fix."""

from __future__ import annotations

import os
from pathlib import Path

from runtime.recipe.capture_layout import capture_shares, nodes_per_engine
from runtime.recipe.errors import Problem
from runtime.recipe.fit.expert_streaming import target_streaming_split
from runtime.recipe.fit.host_memory import host_needs_per_node, streamed_expert_host_bytes
from runtime.recipe.fit.slurm_request import memory_fixes, memory_request, node_memory_gib
from runtime.recipe.fit.store_budget import StoreBudget, store_budget
from runtime.recipe.fit.throughput import run_steps
from runtime.recipe.schema import Recipe, credentials_in
from runtime.recipe.streaming_budget import StreamingBudgetError, check_host_memory
from runtime.recipe.units import format_bytes
from runtime.user_errors import CHECKOUT, write_place_problem

MOONCAKE_MIN_SEGMENT_BYTES = 16 * 2**20
"""mooncake-transfer-engine 0.3.13 refuses a global segment below 16 MiB at client setup."""


def check_recipe(recipe: Recipe) -> list[Problem]:
    """Every cross-field problem of ``recipe`` (an empty list when it is consistent)."""
    problems: list[Problem] = []
    problems += _check_batch(recipe)
    budget = store_budget(recipe)
    problems += _check_watermark_samples(recipe)
    problems += _check_watermark_bytes(recipe, budget)
    problems += _check_segment(recipe, budget)
    problems += _check_ports(recipe)
    problems += _check_capture(recipe)
    problems += _check_target_attention(recipe)
    problems += _check_trainer(recipe)
    problems += _check_devices_against_gpus(recipe)
    problems += _check_credentials(recipe)
    problems += _check_nul(recipe)
    problems += _check_token_ids(recipe)
    problems += _check_job_timing(recipe)
    problems += _check_layout(recipe)
    problems += check_write_places(recipe)
    if not problems:  # needs a consistent recipe (the streaming split)
        problems += _check_host_memory_per_node(recipe, streamed_expert_host_bytes(recipe))
        problems += _check_memory_requests(recipe)
    return problems


WRITE_FIELDS: dict[str, str] = {
    "job.runs_dir": "job folders, logs and records",
    "trainer.checkpoint.dir": "checkpoints, exports and the latest link (keep_last deletes older step_* there)",
    "trainer.feature_cache.dir": "the feature cache (entries are written and removed there)",
}
"""Recipe fields that name a folder the run writes into, with what goes there."""


def check_write_places(recipe: Recipe) -> list[Problem]:
    """Every folder the run writes into passes the one write rule (runtime/user_errors.py
    ``write_place_problem``): never the filesystem root, a home folder itself, the checkout or its
    checked-in folders. A path with a ``${VAR}`` this process cannot expand is checked where it runs."""
    values = {
        "job.runs_dir": recipe.job.runs_dir,
        "trainer.checkpoint.dir": recipe.trainer.checkpoint.dir,
        "trainer.feature_cache.dir": recipe.trainer.feature_cache.dir if recipe.trainer.feature_cache.enabled else None,
    }
    out = []
    for field, value in values.items():
        if not value:
            continue
        expanded = os.path.expandvars(value)
        if "$" in expanded:
            continue
        path = Path(expanded)  # a ~ stays for the rule to read (with an empty HOME it would mean the root)
        problem = write_place_problem(path if path.is_absolute() or expanded.startswith("~") else CHECKOUT / path)
        if problem:
            out.append(
                Problem(
                    field,
                    f"{value!r} {problem}; the run writes {WRITE_FIELDS[field]} there",
                    "name a folder of its own, e.g. runs/ or a folder on a scratch disk",
                )
            )
    return out


def _check_job_timing(recipe: Recipe) -> list[Problem]:
    """The stop signal comes well inside the time limit (Slurm sends ``--signal=USR2@N`` N seconds before
    the limit: a delay beyond half the limit fires at the job's start and requeues it at once), the
    trainer's stop fits before the limit, and the capture's heartbeat comes well inside the idle time-out."""
    job, out = recipe.job, []
    limit_s = job.time_limit_min * 60
    if job.signal_delay_s > limit_s // 2:
        out.append(
            Problem(
                "job.signal_delay_s",
                f"is {job.signal_delay_s} s, more than half the job's time limit of {limit_s} s (job.time_limit_min "
                f"{job.time_limit_min}): Slurm would signal the stop near the job's start, and it would requeue itself "
                "at once",
                f"keep it at most {limit_s // 2} s (a few minutes is usual), or raise job.time_limit_min",
            )
        )
    if job.stop_grace_s > job.signal_delay_s:
        out.append(
            Problem(
                "job.stop_grace_s",
                f"is {job.stop_grace_s} s, longer than job.signal_delay_s {job.signal_delay_s} s: a stop at the time-out "
                "signal could still be writing its checkpoint when the time limit kills the job",
                f"keep job.stop_grace_s at most job.signal_delay_s, or raise job.signal_delay_s to {job.stop_grace_s}",
            )
        )
    transport = recipe.transport
    if transport.heartbeat_interval_s * 2 > transport.idle_timeout_s:
        out.append(
            Problem(
                "transport.heartbeat_interval_s",
                f"is {transport.heartbeat_interval_s:g} s, more than half transport.idle_timeout_s "
                f"{transport.idle_timeout_s:g} s: a healthy but quiet producer would be taken for a dead one",
                f"keep it at most {transport.idle_timeout_s / 2:g} s, or raise transport.idle_timeout_s",
            )
        )
    return out


def _check_target_attention(recipe: Recipe) -> list[Problem]:
    """``linear_attn_config``'s layer lists: 1-based within the target's layers, and
    ``full_attn_layers`` exactly the layers not in ``kda_layers`` (how SGLang 0.5.23 reads them: a
    list that says otherwise would be silently ignored there)."""
    attention = recipe.capture.target_attention
    if attention is None or attention.linear_attn_config is None:
        return []
    linear, layers = attention.linear_attn_config, recipe.capture.num_target_layers
    path = "capture.target_attention.linear_attn_config"
    out = []
    for name in ("kda_layers", "full_attn_layers"):
        outside = sorted(i for i in getattr(linear, name) if not 1 <= i <= layers)
        if outside:
            out.append(
                Problem(
                    f"{path}.{name}",
                    f"names layers {outside} outside 1..{layers} (capture.num_target_layers; the lists are 1-based)",
                    "copy the lists from the target's config.json unchanged",
                )
            )
    full = set(range(1, layers + 1)) - set(linear.kda_layers)
    if not out and set(linear.full_attn_layers) != full:
        out.append(
            Problem(
                f"{path}.full_attn_layers",
                f"lists {len(linear.full_attn_layers)} layers, but the {len(full)} layers not in kda_layers are "
                f"full attention (SGLang reads every layer not in kda_layers as full); they differ at "
                f"{sorted(full.symmetric_difference(linear.full_attn_layers))}",
                "copy both lists from the target's config.json unchanged",
            )
        )
    return out


def _check_memory_requests(recipe: Recipe) -> list[Problem]:
    """Each component's ``--mem`` holds what the plan counts on its node, and each node the job asks for
    (:func:`node_memory_gib`: one per component, or the one node of ``job.layout: one_node``) stays under
    the site's cap ``plan.slurm_max_mem_per_node_gib``."""
    out = []
    requests = {component: memory_request(recipe, component) for component in ("capture", "trainer")}
    for component, request in requests.items():
        if request.explicit_gib is not None and request.explicit_gib < request.needed_gib:
            out.append(
                Problem(
                    f"job.{component}.mem_gib",
                    f"is {request.explicit_gib} GiB, below the {request.needed_gib} GiB the plan counts on a "
                    f"{component} node ({request.describe()})",
                    f"raise it to at least {request.needed_gib}, or remove it (the launcher derives it from the plan)",
                )
            )
    cap = recipe.plan.slurm_max_mem_per_node_gib
    flagged = {problem.path.split(".")[1] for problem in out}  # their own field says it first
    for node, gib in node_memory_gib(recipe).items():
        if cap is None or gib <= cap or node in flagged:
            continue
        if node in requests:
            needs = f"a {node} node needs by the plan ({requests[node].describe()})"
            fix = "; or ".join(memory_fixes(recipe, node)) + " (and raise the cap to what they have)"
        else:
            needs = (
                f"the one node of job.layout: one_node needs (capture {requests['capture'].requested_gib} GiB + "
                f"trainer {requests['trainer'].requested_gib} GiB)"
            )
            fix = (
                "job.layout: separate_nodes (each component on a node of its own), or a node with more memory "
                "(and raise the cap to what it has)"
            )
        out.append(Problem("plan.slurm_max_mem_per_node_gib", f"is {cap} GiB, below the {gib} GiB {needs}", fix))
    return out


def _check_layout(recipe: Recipe) -> list[Problem]:
    """``job.layout: one_node`` puts both components in one plain job on one node: each on one node,
    the placement settings of the two the same (one ``#SBATCH`` block carries them), and the embedded
    capture engine (an SGLang server takes most of each GPU's memory before the trainer starts)."""
    job = recipe.job
    if job.layout != "one_node":
        return []
    fix_layout = "or job.layout: separate_nodes"
    out = [
        Problem(
            f"job.{component}.nodes",
            f"is {getattr(job, component).nodes}, but job.layout: one_node runs both components on one node",
            f"set job.{component}.nodes: 1, {fix_layout}",
        )
        for component in ("capture", "trainer")
        if getattr(job, component).nodes != 1
    ]
    for setting in ("exclusive", "constraint", "extra_sbatch"):
        capture_value, trainer_value = getattr(job.capture, setting), getattr(job.trainer, setting)
        if capture_value != trainer_value:
            out.append(
                Problem(
                    f"job.trainer.{setting}",
                    f"is {trainer_value!r}, job.capture.{setting} is {capture_value!r}: with job.layout: one_node "
                    "one #SBATCH block asks for the node both share",
                    f"give job.capture.{setting} and job.trainer.{setting} the same value, {fix_layout}",
                )
            )
    if recipe.capture.engine != "embedded":
        out.append(
            Problem(
                "capture.engine",
                f"is {recipe.capture.engine}, but job.layout: one_node shares the node's GPUs with the trainer, and "
                "an SGLang server reserves most of each GPU's memory (mem_fraction_static) before the trainer starts",
                f"capture.engine: embedded, {fix_layout}",
            )
        )
    return out


def _strings(value: object, path: str) -> list[tuple[str, str]]:
    """Every string in a dumped recipe, with its dotted path (``job.setup[1]``)."""
    if isinstance(value, str):
        return [(path, value)]
    if isinstance(value, dict):
        return [item for key, sub in value.items() for item in _strings(sub, f"{path}.{key}" if path else str(key))]
    if isinstance(value, list | tuple):
        items = [item for index, sub in enumerate(value) for item in _strings(sub, f"{path}[{index}]")]
        if value and all(isinstance(sub, str) for sub in value):
            items.append((path, " ".join(value)))  # an argument list: a flag and its value are two elements
        return items
    return []


def _check_nul(recipe: Recipe) -> list[Problem]:
    """No value holds a NUL character: no path, argument or name can (the OS refuses it at the first use,
    far from the field)."""
    found = {path for path, text in _strings(recipe.model_dump(mode="json"), "") if "\x00" in text}
    return [
        Problem(path, "holds a NUL character (\\x00), which no path, argument or name can hold", "remove it")
        for path in sorted(found)
    ]


def _check_credentials(recipe: Recipe) -> list[Problem]:
    """No string of the recipe (setup lines, extra arguments, environment values ...) writes a credential
    down: the recipe is copied into every job folder and rendered into batch scripts."""
    out: list[Problem] = []
    for path, text in _strings(recipe.model_dump(mode="json"), ""):
        names = credentials_in(text)
        # One problem per field: an argument list's joined form comes after its elements.
        if names and not any(p.path == path or p.path.startswith(path + "[") for p in out):
            out.append(
                Problem(
                    path,
                    f"writes a credential into the recipe ({', '.join(names)} with a literal value)",
                    "export it in the submitting shell instead (both components inherit it), and refer to it as "
                    f"${_variable_name(names[0])}",
                )
            )
    return out


def _variable_name(found: str) -> str:
    name = found.lstrip("-").upper().replace("-", "_")
    if found.startswith("a token"):
        return "THE_TOKEN_VARIABLE"
    return name if name.isidentifier() else "THE_CREDENTIAL_VARIABLE"


def _check_batch(recipe: Recipe) -> list[Problem]:
    t = recipe.trainer
    world = recipe.trainer_world_size
    product = t.micro_batch_size * t.gradient_accumulation_steps * world
    if product == t.global_batch_size:
        return []
    return [
        Problem(
            "trainer.global_batch_size",
            f"is {t.global_batch_size}, but micro_batch_size {t.micro_batch_size} x "
            f"gradient_accumulation_steps {t.gradient_accumulation_steps} x trainer ranks {world} "
            f"(job.trainer.nodes {recipe.job.trainer.nodes} x job.trainer.tasks_per_node "
            f"{recipe.job.trainer.tasks_per_node}) = {product}",
            f"set trainer.global_batch_size: {product}, or change the accumulation so the product "
            f"equals {t.global_batch_size}",
        )
    ]


def _check_watermark_samples(recipe: Recipe) -> list[Problem]:
    """The sample watermarks hold one global step, low below high."""
    tr = recipe.transport
    g = recipe.trainer.global_batch_size
    out: list[Problem] = []
    if tr.high_watermark_samples < g:
        out.append(
            Problem(
                "transport.high_watermark_samples",
                f"is {tr.high_watermark_samples}, below one global step "
                f"(trainer.global_batch_size {g}): the trainer could never see a whole step",
                f"set transport.high_watermark_samples >= {g}",
            )
        )
    if tr.low_watermark_samples < g:
        out.append(
            Problem(
                "transport.low_watermark_samples",
                f"is {tr.low_watermark_samples}, below one global step "
                f"(trainer.global_batch_size {g}): the producer could stay paused while a step "
                "still waits for samples",
                f"set transport.low_watermark_samples >= {g}",
            )
        )
    if tr.low_watermark_samples > tr.high_watermark_samples:
        out.append(
            Problem(
                "transport.low_watermark_samples",
                f"is {tr.low_watermark_samples}, above transport.high_watermark_samples {tr.high_watermark_samples}",
                "make the low watermark <= the high watermark",
            )
        )
    return out


def _check_watermark_bytes(recipe: Recipe, budget: StoreBudget) -> list[Problem]:
    """The byte watermarks hold one global step of the largest samples, low below high, and the
    store stays under its eviction cap even with the samples in flight at a pause."""
    tr = recipe.transport
    g = recipe.trainer.global_batch_size
    largest = budget.sample.total_bytes
    out: list[Problem] = []
    if tr.high_watermark_bytes < budget.step_bytes:
        out.append(
            Problem(
                "transport.high_watermark_bytes",
                f"is {format_bytes(tr.high_watermark_bytes)}, below one global step of the largest "
                f"samples: trainer.global_batch_size {g} x {format_bytes(largest)} "
                f"(data.max_length {recipe.data.max_length}) = {format_bytes(budget.step_bytes)}",
                f"raise transport.high_watermark_bytes to at least {budget.step_bytes} "
                f"({format_bytes(budget.step_bytes)}) or lower data.max_length",
            )
        )
    if tr.low_watermark_bytes > tr.high_watermark_bytes:
        out.append(
            Problem(
                "transport.low_watermark_bytes",
                f"is {format_bytes(tr.low_watermark_bytes)}, above transport.high_watermark_bytes "
                f"{format_bytes(tr.high_watermark_bytes)}",
                "make the low byte watermark <= the high byte watermark",
            )
        )
    if tr.high_watermark_bytes > tr.store_cap_bytes:
        out.append(
            Problem(
                "transport.high_watermark_bytes",
                f"is {format_bytes(tr.high_watermark_bytes)}, above transport.store_cap_bytes "
                f"{format_bytes(tr.store_cap_bytes)} (segment x eviction ratio): Mooncake would "
                "evict samples the trainer has not consumed",
                "lower transport.high_watermark_bytes below transport.store_cap_bytes, or raise "
                "the store cap and segment",
            )
        )
    out += _check_paused_peak(recipe, budget)
    return out


def _check_paused_peak(recipe: Recipe, budget: StoreBudget) -> list[Problem]:
    """The producer pauses once resident bytes reach the high watermark, but samples already being
    captured still land: up to one capture batch of the largest samples on top."""
    tr = recipe.transport
    in_flight, in_flight_bytes, peak = budget.in_flight_samples, budget.in_flight_bytes, budget.paused_peak_bytes
    if not tr.high_watermark_bytes <= tr.store_cap_bytes < peak:
        return []
    return [
        Problem(
            "transport.high_watermark_bytes",
            f"is {format_bytes(tr.high_watermark_bytes)}; with {in_flight} sample(s) in flight at the "
            f"pause (largest {format_bytes(budget.sample.total_bytes)}) the store can hold {format_bytes(peak)}, "
            f"above transport.store_cap_bytes {format_bytes(tr.store_cap_bytes)}: Mooncake would evict samples "
            "the trainer has not consumed",
            (
                f"lower transport.high_watermark_bytes to at most {tr.store_cap_bytes - in_flight_bytes} "
                "or raise transport.store_cap_bytes (and the segment)"
                if tr.store_cap_bytes > in_flight_bytes
                else f"raise transport.store_cap_bytes (and transport.global_segment_bytes) to at least "
                f"{format_bytes(peak)}, or lower capture.batch_size: {in_flight} sample(s) in flight "
                f"alone need {format_bytes(in_flight_bytes)}"
            ),
        )
    ]


def _check_segment(recipe: Recipe, budget: StoreBudget) -> list[Problem]:
    """The Mooncake segment holds the store cap, Mooncake's smallest segment and one sample."""
    tr = recipe.transport
    largest = budget.sample.total_bytes
    out: list[Problem] = []
    if tr.store_cap_bytes > tr.global_segment_bytes:
        out.append(
            Problem(
                "transport.store_cap_bytes",
                f"is {format_bytes(tr.store_cap_bytes)}, above transport.global_segment_bytes "
                f"{format_bytes(tr.global_segment_bytes)}: the eviction ratio would exceed 1",
                "make transport.store_cap_bytes <= transport.global_segment_bytes",
            )
        )
    if tr.global_segment_bytes < MOONCAKE_MIN_SEGMENT_BYTES:
        out.append(
            Problem(
                "transport.global_segment_bytes",
                f"is {format_bytes(tr.global_segment_bytes)}, below Mooncake's smallest segment "
                f"{format_bytes(MOONCAKE_MIN_SEGMENT_BYTES)} (client setup fails with 'Total size must be at least')",
                f"raise transport.global_segment_bytes to at least {MOONCAKE_MIN_SEGMENT_BYTES}",
            )
        )
    if largest > tr.global_segment_bytes:
        out.append(
            Problem(
                "transport.global_segment_bytes",
                f"is {format_bytes(tr.global_segment_bytes)}, smaller than one sample "
                f"({format_bytes(largest)} at data.max_length {recipe.data.max_length})",
                f"raise transport.global_segment_bytes above {largest}",
            )
        )
    return out


def _check_ports(recipe: Recipe) -> list[Problem]:
    """Every port of :func:`job_ports` has its own number."""
    out: list[Problem] = []
    seen: dict[int, str] = {}
    for name, port in job_ports(recipe).items():
        if port in seen:
            out.append(
                Problem(name, f"uses port {port}, already used by {seen[port]}", "give each port its own number")
            )
        seen[port] = name
    return out


def job_ports(recipe: Recipe) -> dict[str, int]:
    """Every TCP port the job listens on, by the recipe field that sets it. With ``--local`` all of
    them are bound on this machine, so each needs its own number and must be free before the start."""
    tr = recipe.transport
    ports = {
        "job.master_port": recipe.job.master_port,
        "transport.master_rpc_port": tr.master_rpc_port,
        "transport.metadata_http_port": tr.metadata_http_port,
        "transport.metrics_port": tr.metrics_port,
    }
    if recipe.capture.engine == "sglang":
        ports["capture.sglang.port"] = recipe.capture.sglang.port
    return ports


def _check_capture(recipe: Recipe) -> list[Problem]:
    c = recipe.capture
    out: list[Problem] = []
    last = c.num_target_layers - 1
    for index, layer in enumerate(c.aux_layer_ids):
        path = f"capture.aux_layer_ids[{index}]"
        if layer < 0 or layer > last:
            out.append(
                Problem(
                    path,
                    f"layer id {layer} is outside the target's decoder layers 0..{last} "
                    f"(capture.num_target_layers {c.num_target_layers})",
                    f"use ids in 0..{last - 1}",
                )
            )
        elif layer == last:
            out.append(
                Problem(
                    path,
                    f"layer id {layer} is the last decoder layer (capture.num_target_layers "
                    f"{c.num_target_layers}); its output is what lhs carries after the final norm",
                    f"use ids in 0..{last - 1}",
                )
            )
    duplicates = sorted({x for x in c.aux_layer_ids if c.aux_layer_ids.count(x) > 1})
    if duplicates:
        out.append(Problem("capture.aux_layer_ids", f"repeats layer ids {duplicates}", "list each layer once"))
    if c.engine == "sglang" and c.sglang.device == "cuda":
        gpus = recipe.job.capture.gpus_per_node * recipe.job.capture.nodes
        if c.sglang.tp_size > gpus:
            out.append(
                Problem(
                    "capture.sglang.tp_size",
                    f"is {c.sglang.tp_size}, more than the capture component's GPUs "
                    f"(job.capture.gpus_per_node {recipe.job.capture.gpus_per_node} x job.capture.nodes "
                    f"{recipe.job.capture.nodes} = {gpus})",
                    "lower tp_size or request more GPUs for job.capture",
                )
            )
        if c.sglang.context_length < recipe.data.max_length:
            out.append(
                Problem(
                    "capture.sglang.context_length",
                    f"is {c.sglang.context_length}, below data.max_length {recipe.data.max_length}",
                    f"set capture.sglang.context_length >= {recipe.data.max_length}",
                )
            )
        if c.sglang.max_total_tokens < recipe.data.max_length:
            out.append(
                Problem(
                    "capture.sglang.max_total_tokens",
                    f"is {c.sglang.max_total_tokens}, below data.max_length {recipe.data.max_length}",
                    f"set capture.sglang.max_total_tokens >= {recipe.data.max_length}",
                )
            )
    out += _check_expert_streaming(recipe)
    if c.expert_parallel > 1 and c.engine != "embedded":
        out.append(
            Problem(
                "capture.expert_parallel",
                f"is {c.expert_parallel}, but capture.engine is {c.engine}; expert parallelism is a "
                "setting of the embedded engine (SGLang takes its own server flags)",
                "set capture.expert_parallel: 1 or capture.engine: embedded",
            )
        )
    return out


def _check_expert_streaming(recipe: Recipe) -> list[Problem]:
    c = recipe.capture
    s = c.expert_streaming
    if not s.enabled:
        return []
    if (s.gpu_budget_bytes is None) == (s.resident_fraction is None):
        both = s.gpu_budget_bytes is not None
        return [
            Problem(
                "capture.expert_streaming",
                "sets both gpu_budget_bytes and resident_fraction"
                if both
                else "sets neither gpu_budget_bytes nor resident_fraction",
                "give exactly one: gpu_budget_bytes (routed-expert bytes per GPU, resident layers + buffers) or "
                "resident_fraction (share of MoE layers kept resident)",
            )
        ]
    if c.num_moe_layers is not None and c.num_moe_layers > c.num_target_layers:
        return [
            Problem(
                "capture.num_moe_layers",
                f"is {c.num_moe_layers}, more than capture.num_target_layers {c.num_target_layers}",
                f"set capture.num_moe_layers <= {c.num_target_layers}",
            )
        ]
    try:
        target_streaming_split(recipe)
    except StreamingBudgetError as exc:
        message, _, fix = str(exc).partition("; fix: ")
        return [Problem("capture.expert_streaming.gpu_budget_bytes", message.split(" is ", 1)[-1], fix)]
    return []


def _check_host_memory_per_node(recipe: Recipe, streamed_expert_bytes: int) -> list[Problem]:
    out = []
    needs = host_needs_per_node(recipe, streamed_expert_bytes)
    for node, memory in (
        ("capture", recipe.plan.capture_host_memory_bytes),
        ("trainer", recipe.plan.trainer_host_memory_bytes),
    ):
        error = check_host_memory(needs[node], memory, node=node, host_field=f"plan.{node}_host_memory_bytes")
        if error is not None:
            message, _, fix = str(error).partition("; fix: ")
            out.append(Problem(f"plan.{node}_host_memory_bytes", message, fix))
    return out


def _check_devices_against_gpus(recipe: Recipe) -> list[Problem]:
    """A component set to run on CUDA needs GPUs on its nodes, and a GPU trainer one GPU per rank:
    caught here, not as a CUDA error (or eight ranks on four GPUs) inside the job."""
    job, out = recipe.job, []
    capture_device = recipe.capture.sglang.device if recipe.capture.engine == "sglang" else recipe.capture.device
    capture_field = "capture.sglang.device" if recipe.capture.engine == "sglang" else "capture.device"
    for field, device, component in (
        ("trainer.device", recipe.trainer.device, "trainer"),
        (capture_field, capture_device, "capture"),
    ):
        if device == "cuda" and getattr(job, component).gpus_per_node == 0:
            out.append(
                Problem(
                    field,
                    f"is cuda, but job.{component}.gpus_per_node is 0: Slurm gives the {component} nodes no GPU",
                    f"set job.{component}.gpus_per_node to the GPUs each node has, or {field}: cpu",
                )
            )
        if device == "cpu" and getattr(job, component).gpus_per_node > 0:
            # The reverse: GPUs held for the whole job and never used (and a CPU run that crawls).
            out.append(
                Problem(
                    field,
                    f"is cpu, but job.{component}.gpus_per_node is {getattr(job, component).gpus_per_node}: the "
                    f"{component} would hold GPUs it never uses",
                    f"set {field}: cuda, or job.{component}.gpus_per_node: 0",
                )
            )
    trainer = job.trainer
    if recipe.trainer.device != "cpu" and 0 < trainer.gpus_per_node < trainer.tasks_per_node:
        out.append(
            Problem(
                "job.trainer.tasks_per_node",
                f"is {trainer.tasks_per_node}, but job.trainer.gpus_per_node is {trainer.gpus_per_node}: each "
                "trainer rank needs a GPU of its own",
                f"set job.trainer.tasks_per_node: {trainer.gpus_per_node} (and trainer.global_batch_size to match), or "
                f"job.trainer.gpus_per_node: {trainer.tasks_per_node}",
            )
        )
    return out


def _check_trainer(recipe: Recipe) -> list[Problem]:
    t = recipe.trainer
    d = t.draft
    out: list[Problem] = []
    if d.hidden_size != recipe.capture.hidden_size:
        out.append(
            Problem(
                "trainer.draft.hidden_size",
                f"is {d.hidden_size}, but capture.hidden_size is {recipe.capture.hidden_size}; the "
                "draft shares the target's frozen embedding and lm_head",
                f"set trainer.draft.hidden_size: {recipe.capture.hidden_size}",
            )
        )
    if d.num_attention_heads % d.num_key_value_heads:
        out.append(
            Problem(
                "trainer.draft.num_key_value_heads",
                f"is {d.num_key_value_heads}, which does not divide trainer.draft.num_attention_heads "
                f"{d.num_attention_heads}",
                "choose a divisor of the query heads",
            )
        )
    if d.mask_token_id >= recipe.capture.vocab_size:
        out.append(
            Problem(
                "trainer.draft.mask_token_id",
                f"is {d.mask_token_id}, outside the vocabulary (capture.vocab_size {recipe.capture.vocab_size})",
                f"use an id below {recipe.capture.vocab_size}",
            )
        )
    if recipe.data.max_length > d.max_position_embeddings:
        out.append(
            Problem(
                "data.max_length",
                f"is {recipe.data.max_length}, above trainer.draft.max_position_embeddings {d.max_position_embeddings}",
                "raise the draft's max positions or lower data.max_length",
            )
        )
    if t.checkpoint.resume_from and t.checkpoint.init_from:
        out.append(
            Problem(
                "trainer.checkpoint.init_from",
                f"is {t.checkpoint.init_from!r} while trainer.checkpoint.resume_from is "
                f"{t.checkpoint.resume_from!r}: a full resume and a weights-only warm start exclude "
                "each other",
                "keep only one of them",
            )
        )
    out.extend(_check_feature_cache(recipe))
    out.extend(_check_capture_shares(recipe))
    schedule = t.schedule
    if schedule.type == "constant" and schedule.warmup_steps:
        out.append(
            Problem(
                "trainer.schedule.warmup_steps",
                f"is {schedule.warmup_steps}, but trainer.schedule.type is constant (no warmup)",
                "use type: constant_with_warmup, or warmup_steps: 0",
            )
        )
    if schedule.total_steps is not None and schedule.warmup_steps >= schedule.total_steps:
        out.append(
            Problem(
                "trainer.schedule.warmup_steps",
                f"is {schedule.warmup_steps}, not below trainer.schedule.total_steps {schedule.total_steps}",
                "shorten the warmup",
            )
        )
    out.extend(_warmup_beyond_the_run(recipe))
    return out


def _check_token_ids(recipe: Recipe) -> list[Problem]:
    """Special and stop token ids are inside the target's vocabulary: an id outside it never appears,
    so generation would never stop on it."""
    vocab = recipe.capture.vocab_size
    named = [
        (f"capture.special_tokens.{n}", getattr(recipe.capture.special_tokens, n))
        for n in ("bos_id", "eos_id", "pad_id")
    ]
    if recipe.eval is not None:
        named += [(f"eval.stop_token_ids[{i}]", v) for i, v in enumerate(recipe.eval.stop_token_ids)]
    return [
        Problem(path, f"is {value}, outside the target's vocabulary (capture.vocab_size {vocab}: ids 0..{vocab - 1})",
                "use the id the target's tokenizer gives that token")
        for path, value in named
        if value is not None and value >= vocab
    ]  # fmt: skip


def _warmup_beyond_the_run(recipe: Recipe) -> list[Problem]:
    """A warmup as long as the whole run (its length derived from epochs, rows and the global batch;
    a run cut short by ``max_steps``, a smoke run, is left alone): the LR would never reach its peak."""
    schedule = recipe.trainer.schedule
    if schedule.type == "constant" or schedule.total_steps is not None or recipe.trainer.max_steps is not None:
        return []
    steps = run_steps(recipe)
    if not 0 < steps <= schedule.warmup_steps:
        return []
    return [
        Problem(
            "trainer.schedule.warmup_steps",
            f"is {schedule.warmup_steps}, but the run has {steps} optimizer steps (data.num_rows x trainer.epochs / "
            "trainer.global_batch_size): the learning rate would never reach its peak",
            f"shorten the warmup below {steps}, or set trainer.schedule.total_steps",
        )
    ]


def _check_feature_cache(recipe: Recipe) -> list[Problem]:
    cache = recipe.trainer.feature_cache
    if not cache.enabled:
        return []
    out: list[Problem] = []
    if not cache.dir:
        out.append(
            Problem(
                "trainer.feature_cache.dir",
                "is not set while trainer.feature_cache.enabled is true",
                "set it to a folder on the trainer node's local disk, e.g. /local/nvme/dspark_cache",
            )
        )
    if recipe.trainer.sample_source != "mooncake":
        out.append(
            Problem(
                "trainer.feature_cache.enabled",
                f"is true with trainer.sample_source {recipe.trainer.sample_source!r}: the cache keeps samples "
                "read from the Mooncake data plane",
                "set trainer.feature_cache.enabled: false",
            )
        )
    if recipe.job.trainer.nodes > 1:
        # Any rank may need any row in a later epoch; a node-local cache serves only its own node.
        out.append(
            Problem(
                "trainer.feature_cache.enabled",
                f"is true with job.trainer.nodes {recipe.job.trainer.nodes}: the cache is node-local and a later "
                "epoch deals each row to any rank",
                "use one trainer node, or set trainer.feature_cache.enabled: false",
            )
        )
    return out


def _check_capture_shares(recipe: Recipe) -> list[Problem]:
    job = recipe.job.capture
    per_engine = nodes_per_engine(recipe)
    if job.nodes % per_engine:
        return [
            Problem(
                "job.capture.nodes",
                f"is {job.nodes}, not a multiple of the {per_engine} nodes one SGLang server spans (capture.sglang."
                f"tp_size {recipe.capture.sglang.tp_size} over job.capture.gpus_per_node {job.gpus_per_node})",
                f"use a multiple of {per_engine} nodes",
            )
        ]
    if capture_shares(recipe) > 1 and per_engine > 1:
        return [
            Problem(
                "job.capture.nodes",
                f"is {job.nodes}: several SGLang servers that each span {per_engine} nodes are not supported",
                f"use {per_engine} nodes (one server across them), or a tp_size of at most {job.gpus_per_node}",
            )
        ]
    if capture_shares(recipe) > 1 and job.tasks_per_node != 1:
        return [
            Problem(
                "job.capture.tasks_per_node",
                f"is {job.tasks_per_node}: with {job.nodes} capture nodes each node runs one capture task "
                "(its engine uses the node's GPUs)",
                "set job.capture.tasks_per_node: 1",
            )
        ]
    return []
