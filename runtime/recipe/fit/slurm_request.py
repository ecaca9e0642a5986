"""What the job asks Slurm for, from the plan: host memory per component node (``--mem``) and the
time limit against the planned run.

Memory. A node without ``--mem`` gets the site's DefMemPerCPU / DefMemPerNode, often a few GB, and
the K3 capture node dies while loading. So every component requests, per node, the plan's host
memory figure for that node (:func:`runtime.recipe.fit.host_memory.host_needs_per_node`: its share
of the Mooncake segment, the streamed experts of every GPU) plus a stated margin:

- per process of the component (one per GPU or per task, whichever is more: SGLang's TP workers,
  the trainer's ranks) :data:`PROCESS_ALLOWANCE_BYTES` for Python, torch, the CUDA context and the
  loaders, plus one largest sample (the producer's commit copy, a rank's fetched or cached sample);
- the Mooncake client's registered local buffer (``transport.local_buffer_bytes``) per client;
- on the capture node, the commit pipeline's pinned staging slots.

``job.<component>.mem_gib`` set in the recipe wins (below the figure it is refused); the site's
cap ``plan.slurm_max_mem_per_node_gib`` (MaxMemPerNode, or what the nodes really have) refuses a
request above it, naming both numbers.

The eval job (``launcher eval``) runs on one node of the capture kind and serves the target the way
capture does, without the Mooncake segment, its client or the commit staging: its request is the
streamed experts plus the process allowances (:func:`eval_memory_request`), never more than the
capture node's, so the capture node's checks cover it.

The probe job (``--probe``) has the job's shape on the same partitions and node kinds but loads no
target and no data: it asks for :data:`PROBE_TIME_LIMIT_MIN` minutes and the memory of what it
moves (:func:`probe_memory_request`), so it lands long before the real job would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.recipe.fit.host_memory import host_needs_per_node, streamed_expert_host_bytes
from runtime.recipe.fit.store_budget import commit_staging_slots, largest_sample
from runtime.recipe.schema import Recipe
from runtime.recipe.units import format_bytes

GIB = 2**30
PROCESS_ALLOWANCE_BYTES = 8 * GIB
"""Host memory of one component process besides the samples and what the plan counts: Python,
torch and the CUDA context (about 3 GiB), the weight loaders' buffers and the trainer's frozen
embedding and lm_head on their way to the GPU (4.4 GiB at K3). An allowance, not measured."""
PROBE_TIME_LIMIT_MIN = 20
"""The probe job's time limit: its route check and measurements take a few minutes (each wait for
the other node ends after two minutes)."""
PROBE_PROCESS_ALLOWANCE_BYTES = 2 * GIB
"""Host memory of one probe process besides the bytes it moves: Python, torch, gloo, a Mooncake client."""
PROBE_MEASURE_BYTES_RANGE = (64 * 2**20, 2**30)
"""Bytes each probe measurement moves (per GPU for the host-to-device copies): the recipe's largest
sample, within this range (K3: 1 GiB; the tiny recipe: 64 MiB)."""
PROBE_LINK_OBJECTS = 4
"""Objects the probe's link measurement serves from the capture node (the first read pays for fresh
allocations and is not counted)."""
PROBE_EVICTION_WATERMARK = 0.95
"""The eviction high watermark of the probe's own Mooncake masters: the master evicts objects once its
segments are fuller than this share, so a probe segment holds its objects below it."""
PROBE_SEGMENT_SLACK_BYTES = 64 * 2**20
"""Room beyond the watermark's share in a probe segment, for the allocator's rounding."""
PROBE_BUFFERS = 3
"""Measurement buffers of one probe node besides one per GPU and the store segment: the put's object,
its copy read back, and the link's object read back on the trainer node."""


def probe_segment_bytes(objects: int, object_bytes: int) -> int:
    """The Mooncake segment that holds ``objects`` objects of ``object_bytes`` with no eviction: their
    bytes over :data:`PROBE_EVICTION_WATERMARK`, plus :data:`PROBE_SEGMENT_SLACK_BYTES`. A segment of
    exactly the objects' bytes has the master evict one of them before it is read (four 1 GiB objects
    in 4.06 GiB at a 95% watermark did)."""
    return math.ceil(objects * object_bytes / PROBE_EVICTION_WATERMARK) + PROBE_SEGMENT_SLACK_BYTES


@dataclass(frozen=True)
class MemoryRequest:
    """The ``--mem`` of one component's nodes."""

    component: str
    plan_parts: dict[str, int]
    """The plan's host memory of the node, by use (streamed experts, Mooncake segment share)."""
    margin_parts: dict[str, int]
    """The margin, by use (process allowances, Mooncake local buffers, commit staging)."""
    explicit_gib: int | None
    """``job.<component>.mem_gib`` when the recipe sets it."""

    @property
    def plan_bytes(self) -> int:
        """The plan's host-memory figure of the node."""
        return sum(self.plan_parts.values())

    @property
    def needed_bytes(self) -> int:
        """The plan's figure plus the margin."""
        return self.plan_bytes + sum(self.margin_parts.values())

    @property
    def needed_gib(self) -> int:
        """``needed_bytes`` in whole GiB, rounded up."""
        return math.ceil(self.needed_bytes / GIB)

    @property
    def requested_gib(self) -> int:
        """What ``--mem`` asks: the recipe's ``mem_gib``, else the plan's figure plus the margin."""
        return self.explicit_gib if self.explicit_gib is not None else self.needed_gib

    def describe(self) -> str:
        """One line: the request and every part of it."""
        parts = " + ".join(f"{format_bytes(v)} {k}" for k, v in {**self.plan_parts, **self.margin_parts}.items() if v)
        how = (
            f"job.{self.component}.mem_gib; the plan counts {self.needed_gib} GiB"
            if self.explicit_gib is not None
            else "derived"
        )
        return f"--mem={self.requested_gib}G per node ({how}: {parts})"


def memory_fixes(recipe: Recipe, component: str) -> list[str]:
    """What lowers the ``--mem`` of one ``component`` node, or gets a node that allows it: only what acts
    on that node (the Mooncake segment moves only between the nodes; experts stream only on capture)."""
    placement = recipe.transport.segment_placement
    if component == "capture":
        fixes = (
            ["stream fewer experts (raise capture.expert_streaming.gpu_budget_bytes)"]
            if (recipe.capture.expert_streaming.enabled)
            else []
        )
        if placement != "trainer":
            fixes.append(
                "move the Mooncake segment to the trainer node (transport.segment_placement: trainer, or split), "
                "or shrink it (transport.global_segment_bytes)"
            )
    else:
        fixes = [f"fewer ranks per trainer node (job.trainer.tasks_per_node, now {recipe.job.trainer.tasks_per_node})"]
        if placement != "capture":
            fixes.append(
                f"keep the Mooncake segment on the capture node (transport.segment_placement: capture, now {placement}),"
                " or shrink it (transport.global_segment_bytes)"
            )
    fixes.append(f"use {component} nodes with more memory (a partition or constraint: job.{component}.constraint)")
    return fixes


def component_processes(recipe: Recipe, component: str) -> int:
    """Processes of one component on one node: one per GPU or per task, whichever is more."""
    res = getattr(recipe.job, component)
    return max(res.tasks_per_node, res.gpus_per_node)


def memory_request(recipe: Recipe, component: str) -> MemoryRequest:
    """The ``--mem`` of ``component`` (``capture`` or ``trainer``) from the plan's host-memory figure."""
    needs = host_needs_per_node(recipe, streamed_expert_host_bytes(recipe))[component]
    plan_parts = {name.split(" (")[0]: value for name, value in needs.items()}
    sample = largest_sample(recipe)
    processes = component_processes(recipe, component)
    clients = 1 if component == "capture" else getattr(recipe.job, component).tasks_per_node
    margin = {
        f"for {processes} process(es) x ({format_bytes(PROCESS_ALLOWANCE_BYTES)} allowance + one "
        f"{format_bytes(sample.total_bytes)} sample)": processes * (PROCESS_ALLOWANCE_BYTES + sample.total_bytes),
        f"for {clients} Mooncake client(s) x {format_bytes(recipe.transport.local_buffer_bytes)} local buffer "
        "(transport.local_buffer_bytes)": clients * recipe.transport.local_buffer_bytes,
    }
    if component == "capture":
        slots = commit_staging_slots(recipe)
        margin[f"commit staging ({slots} slot(s))"] = slots * sample.feature_bytes
    return MemoryRequest(component, plan_parts, margin, getattr(recipe.job, component).mem_gib)


def node_memory_gib(recipe: Recipe, probe: bool = False) -> dict[str, int]:
    """The ``--mem`` of each node kind the job asks for, in GiB: ``capture`` and ``trainer``, or with
    ``job.layout: one_node`` the one node both share (``one node``: the sum of the two requests)."""
    request = probe_memory_request if probe else memory_request
    gib = {component: request(recipe, component).requested_gib for component in ("capture", "trainer")}
    return {"one node": sum(gib.values())} if recipe.job.layout == "one_node" else gib


def eval_memory_request(recipe: Recipe) -> MemoryRequest:
    """The ``--mem`` of the eval job's one node: the target served as capture serves it (one process
    per GPU, the streamed experts of every GPU in host memory) with the draft, and no Mooncake.
    ``job.capture.mem_gib`` wins when set: it is the operator's figure for that kind of node."""
    streamed = streamed_expert_host_bytes(recipe)
    processes = component_processes(recipe, "capture")
    margin = {
        f"for {processes} process(es) x {format_bytes(PROCESS_ALLOWANCE_BYTES)} allowance": processes
        * PROCESS_ALLOWANCE_BYTES
    }
    plan_parts = {"streamed experts": streamed} if streamed else {}
    return MemoryRequest("capture", plan_parts, margin, recipe.job.capture.mem_gib)


def probe_measure_bytes(recipe: Recipe) -> int:
    """Bytes each probe measurement moves: the largest sample, within :data:`PROBE_MEASURE_BYTES_RANGE`."""
    low, high = PROBE_MEASURE_BYTES_RANGE
    return min(high, max(low, largest_sample(recipe).total_bytes))


def probe_memory_request(recipe: Recipe, component: str) -> MemoryRequest:
    """The ``--mem`` of one node of the probe job: a small allowance per task and the buffers the
    probe measures with (one per GPU for the host-to-device copies, :data:`PROBE_BUFFERS` more), never
    the job's streamed experts or Mooncake segment."""
    res = getattr(recipe.job, component)
    size = probe_measure_bytes(recipe)
    buffers = res.gpus_per_node + PROBE_BUFFERS
    margin = {
        f"for {res.tasks_per_node} probe task(s) x {format_bytes(PROBE_PROCESS_ALLOWANCE_BYTES)}": res.tasks_per_node
        * PROBE_PROCESS_ALLOWANCE_BYTES,
        f"{buffers} measurement buffer(s) x {format_bytes(size)}": buffers * size,
    }
    if component == "capture":  # the link's objects, in a segment that never evicts them
        margin[f"the link's Mooncake segment for {PROBE_LINK_OBJECTS} x {format_bytes(size)}"] = probe_segment_bytes(
            PROBE_LINK_OBJECTS, size
        )
    return MemoryRequest(component, {}, margin, None)
