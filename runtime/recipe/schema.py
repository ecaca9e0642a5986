"""The recipe schema: every knob of a run, typed, with a default, a unit in its name and a docstring.

This module is shared by the login-node launcher and by the runtime inside the allocation, so it
imports nothing heavier than pydantic. Field-level checks live here; checks that relate several
fields live in :mod:`runtime.recipe.checks` so that their messages can name both fields.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from runtime.recipe.units import ByteSize
from runtime.user_errors import SECRET_NAME, credentials_in

__all__ = ["SECRET_NAME", "credentials_in"]


def _stringify_scalars(value: Any) -> Any:
    """Environment values are strings; let ``--set job.env.X=600`` mean ``"600"``."""
    if isinstance(value, dict):
        return {
            k: (str(v).lower() if isinstance(v, bool) else str(v)) if isinstance(v, int | float | bool) else v
            for k, v in value.items()
        }
    return value


MAX_TIME_LIMIT_MIN = 60 * 24 * 366
"""A year: longer limits are typos (Slurm sites cap jobs at days or weeks)."""


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RESERVED_ENV_NAMES = frozenset(
    {
        # runtime/shared/contracts.py's ENV_* (tests/test_hardening_recipes.py keeps the two equal)
        "DSPARK_JOB_DIR", "DSPARK_RECIPE", "DSPARK_COMPONENT", "DSPARK_TASK_RANK", "DSPARK_REQUEUE_COUNT",
        "DSPARK_BIND_ADDRESS", "DSPARK_CAPTURE_HOST", "DSPARK_MOONCAKE_MASTER", "DSPARK_MOONCAKE_METADATA",
        "DSPARK_RDMA_DEVICES", "MC_TCP_BIND_ADDRESS", "MC_TRANSFER_TIMEOUT", "DSPARK_PARENT_PID",
        "DSPARK_SLURM_JOB_ID",
        # torch.distributed's rendezvous (launcher/environment.py RENDEZVOUS_VARIABLES), and PATH
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
        "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS", "PATH",
    }
)  # fmt: skip
"""Environment names a recipe may not set: the launcher sets them (the environment contract would
silently override the recipe's value), and an empty PATH breaks every command."""


def _refuse_secrets(value: dict[str, str]) -> dict[str, str]:
    """A recipe is a plain file copied into every job folder (``recipe.resolved.json``): credentials
    never go in it; the components inherit them from the submitting shell's environment. Names must
    be environment variable names, and not the ones the launcher sets itself (the environment
    contract would silently override them) or PATH (an empty one breaks every command)."""
    bad = [name for name in value if not _ENV_NAME.fullmatch(str(name))]
    if bad:
        raise ValueError(
            f"{bad[0]!r} is not an environment variable name. Fix: use letters, digits and '_', not starting "
            "with a digit"
        )
    reserved = sorted(n for n in value if n in RESERVED_ENV_NAMES or n.startswith("SLURM_"))
    if reserved:
        raise ValueError(
            f"{', '.join(reserved)}: the launcher sets these itself (the environment contract) or every command "
            "needs them. Fix: remove them; change the recipe field the variable comes from instead"
        )
    secret = sorted(name for name in value if SECRET_NAME.search(name))
    if secret:
        names = ", ".join(secret)
        raise ValueError(
            f"{names} looks like a credential; recipes and their resolved copies are plain files, so credentials "
            f"never go in job.env. Fix: remove {names} from the recipe (and --set) and export it in the "
            "submitting shell: both components inherit it from there"
        )
    return value


EnvironmentMapping = Annotated[dict[str, str], BeforeValidator(_stringify_scalars), AfterValidator(_refuse_secrets)]
"""A name -> value mapping of environment variables; numbers and booleans become strings;
credential-looking names are refused."""


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, docstrings become descriptions."""

    # allow_inf_nan=False: lr: .inf or 1e400 (which parses to inf) is refused at load time.
    # frozen=True: a section handed to a part is that part's settings; no part can change them under another.
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_default=True, allow_inf_nan=False, frozen=True
    )

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        # pydantic's lax mode reads `micro_batch_size: true` as 1: a YAML boolean where a number
        # belongs is a mistake, never a count. Handing the field its spelling makes the number
        # check fail on that field, with its dotted path.
        if isinstance(data, dict):
            for name, value in list(data.items()):
                info = cls.model_fields.get(str(name))
                if isinstance(value, bool) and info is not None and _wants_number_not_bool(info.annotation):
                    data = {**data, name: str(value).lower()}
                elif isinstance(value, list) and info is not None and _wants_numbers(info.annotation):
                    # [true, 3, 5] for layer ids read as [1, 3, 5]; the same refusal, per item
                    data = {**data, name: [str(v).lower() if isinstance(v, bool) else v for v in value]}
        return data


def _wants_numbers(annotation: Any) -> bool:
    """A list of numbers (``list[int]``, optional or not), whose items are never booleans."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for option in typing.get_args(annotation) if union else (annotation,):
        if typing.get_origin(option) is list:
            (item,) = typing.get_args(option) or (Any,)
            if typing.get_origin(item) is Annotated:
                item = typing.get_args(item)[0]
            if _wants_number_not_bool(item):
                return True
    return False


def _wants_number_not_bool(annotation: Any) -> bool:
    options = set(typing.get_args(annotation)) if typing.get_args(annotation) else {annotation}
    return bool(options & {int, float}) and bool not in options


MAX_EPOCHS = 10_000
MIN_RATE = 1e-3
"""The smallest throughput a plan figure may give (GB/s or TFLOP/s): below it is a typo, and the
plan's times would overflow."""
MAX_SEED = 2**63 - 1
"""The largest seed torch and numpy take (a 64-bit signed integer)."""
JOB_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
"""A job name (used with ``fullmatch``: a ``$`` anchor would let a trailing newline through)."""

_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\x85\u2028\u2029\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
"""Characters no batch script line may hold: ASCII controls, Unicode line and paragraph separators and
NEL (a reader splitting lines sees a new line there), zero-width and bidirectional controls (a reviewer
of the script would read another text than the shell runs)."""
_SBATCH_KEY = re.compile(r"[A-Za-z][A-Za-z0-9-]*")
_PLAIN_COMMAND = re.compile(r"[A-Za-z0-9_./+@%:,=][A-Za-z0-9_./+@%:,=-]*")
"""A command name or path; never a leading ``-`` (it would be read as an option of srun)."""
LAUNCHER_SBATCH_OPTIONS: dict[str, str] = {
    "job-name": "job.name",
    "partition": "job.partition",
    "account": "job.account",
    "qos": "job.qos",
    "time": "job.time_limit_min",
    "nodes": "job.COMPONENT.nodes",
    "ntasks": "job.COMPONENT.tasks_per_node",
    "ntasks-per-node": "job.COMPONENT.tasks_per_node",
    "cpus-per-task": "job.COMPONENT.cpus_per_task",
    "gpus": "job.COMPONENT.gpus_per_node",
    "gpus-per-node": "job.COMPONENT.gpus_per_node",
    "gpus-per-task": "job.COMPONENT.gpus_per_node",
    "gres": "job.COMPONENT.gpus_per_node",
    "mem": "job.COMPONENT.mem_gib",
    "mem-per-cpu": "job.COMPONENT.mem_gib",
    "mem-per-gpu": "job.COMPONENT.mem_gib",
    "exclusive": "job.COMPONENT.exclusive",
    "constraint": "job.COMPONENT.constraint",
    "signal": "job.signal_delay_s",
    "requeue": "job.max_requeues",
    "no-requeue": "job.max_requeues",
    "open-mode": "the launcher (logs are appended across requeues)",
    "output": "job.runs_dir (the job folder's logs/)",
    "error": "job.runs_dir (the job folder's logs/)",
    "input": "the launcher",
    "chdir": "the launcher (the job runs in the repository)",
    "export": "job.env (variables) or the submitting shell (secrets)",
    "export-file": "job.env",
    "dependency": "the launcher (the eval job's afterok)",
    "array": "the launcher (one hetjob per run)",
    "het-group": "the launcher",
    "wrap": "the launcher",
}
"""sbatch options the launcher sets itself, with the recipe field that sets each: ``extra_sbatch`` may not
name them (nor a prefix of them, which sbatch takes as the option), since a second ``#SBATCH`` line of
the same option silently wins over the plan's value."""
_HOST_OR_INTERFACE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _one_line(value: str) -> str:
    """A value written into a batch script line: no newline, NUL or other control character (a newline
    would start a new ``#SBATCH`` line or shell command of its own)."""
    found = _CONTROL.search(value)
    if found:
        raise ValueError(
            f"holds the control character {found.group(0)!r} (a control, a line separator or an invisible direction "
            "mark): a batch script line would break at it or read otherwise than it runs. "
            "Fix: write the value on one line, without control characters"
        )
    return value


def _sbatch_key(value: str) -> str:
    if not _SBATCH_KEY.fullmatch(value):
        raise ValueError(
            "is not an sbatch option name (it becomes #SBATCH --NAME=VALUE). Fix: use the option's "
            "long name without the dashes, e.g. mail-user"
        )
    taken = [option for option in LAUNCHER_SBATCH_OPTIONS if option == value or option.startswith(value)]
    if taken:
        option = value if value in taken else taken[0]
        raise ValueError(
            f"{value!r} is sbatch's --{option}, which the launcher sets itself from "
            f"{LAUNCHER_SBATCH_OPTIONS[option]}: a second #SBATCH line would silently override the plan's value. "
            "Fix: set it through that field, or remove it from extra_sbatch"
        )
    return value


def _plain_command(value: str) -> str:
    if not _PLAIN_COMMAND.fullmatch(value):
        raise ValueError(
            "is not a plain command name or path (a leading -, which srun would read as its own option, spaces, "
            "quotes, $, ; and other shell syntax are refused: it starts every component's process). Fix: give "
            "python3 or a path such as "
            "/opt/env/bin/python3; activate an environment in job.setup instead"
        )
    return value


def _runs_folder(value: str) -> str:
    _one_line(value)
    if not value.strip():
        raise ValueError("is empty: job folders would land in the repository root. Fix: name a folder, e.g. runs")
    if value.startswith("~") and not (value == "~" or value.startswith("~/")):
        raise ValueError(
            "names another user's home folder; job folders go into your own. Fix: write ~/FOLDER or an "
            "absolute path you own"
        )
    return value


def _bind_address(value: str) -> str:
    import ipaddress

    if value == "auto":
        return value
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not _HOST_OR_INTERFACE.fullmatch(value):
            raise ValueError(
                "is not an address. Fix: write auto, an IP address (10.0.0.5) or a host or interface name (ib0)"
            ) from None
    return value


OneLine = Annotated[str, AfterValidator(_one_line)]
"""Text that goes into one line of a batch script."""
SbatchKey = Annotated[str, AfterValidator(_sbatch_key)]
"""An ``#SBATCH --NAME`` option name."""


# ----------------------------------------------------------------------------------------------
# job: the Slurm side
# ----------------------------------------------------------------------------------------------


class ComponentResources(Section):
    """Resources of one het group (one component) of the Slurm job."""

    nodes: int = Field(1, ge=1)
    """Nodes for this component."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs requested per node (gres gpu)."""
    tasks_per_node: int = Field(1, ge=1)
    """Tasks (processes) per node; the trainer runs one rank per task."""
    cpus_per_task: int = Field(1, ge=1)
    """CPU cores per task."""
    mem_gib: int | None = Field(None, ge=1)
    """Memory per node in GiB (``--mem``); null derives it from the plan's host memory of the node
    plus a stated margin (``--plan`` shows it; runtime/recipe/fit/slurm_request.py). Set below what
    the plan counts, the recipe is refused."""
    exclusive: bool = False
    """Request whole nodes (``--exclusive``)."""
    constraint: OneLine | None = None
    """Slurm ``--constraint`` feature expression."""
    extra_sbatch: dict[SbatchKey, OneLine] = Field(default_factory=dict)
    """Further ``#SBATCH --key=value`` lines for this component only."""
    srun_args: list[OneLine] = Field(default_factory=list)
    """Extra arguments for this component's ``srun`` line."""


class JobSection(Section):
    """Slurm job settings shared by both components."""

    name: str = Field(..., min_length=1, max_length=64)
    """Job name; also the default Mooncake store id and the run folder name (letters, digits, ``_.-``,
    not starting with a dot)."""

    @field_validator("name")
    @classmethod
    def _name_is_one_folder(cls, value: str) -> str:
        if not JOB_NAME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a plain folder name (it becomes runs/<name>/). Fix: use letters, digits, "
                "'_', '.' and '-', starting with a letter, digit or '_'"
            )
        return value

    partition: OneLine | None = None
    """Slurm partition; null uses the cluster default."""
    account: OneLine | None = None
    """Slurm account; null uses the user's default. Never put credentials here."""
    qos: OneLine | None = None
    """Slurm quality of service."""
    time_limit_min: int = Field(60, ge=1, le=MAX_TIME_LIMIT_MIN)
    """Wall-clock limit of the whole job in minutes."""
    signal_delay_s: int = Field(120, ge=10)
    """Seconds before the time limit at which Slurm sends USR2 so the job can requeue itself."""
    max_requeues: int = Field(3, ge=0)
    """How many time-outs or preemptions may requeue the job before it gives up."""
    runs_dir: Annotated[str, AfterValidator(_runs_folder)] = "runs"
    """Folder (relative to the repository unless absolute; ``~/`` is your home) holding one folder per
    submitted job."""
    python: Annotated[str, AfterValidator(_plain_command)] = "python3"
    """Python interpreter used inside the allocation: a command name or a path, no shell syntax."""
    setup: list[OneLine] = Field(default_factory=list)
    """Shell lines run before each component starts (module loads, venv or conda activation)."""
    container_image: OneLine | None = None
    """Container image for pyxis/enroot (``srun --container-image``); null runs on the host."""
    container_mounts: list[OneLine] = Field(default_factory=list)
    """``--container-mounts`` entries, ``src:dst`` each."""
    env: EnvironmentMapping = Field(default_factory=dict)
    """Extra environment variables for both components (never credentials: those come from the
    submitting shell's environment)."""
    stop_grace_s: int = Field(30, ge=1, le=3600)
    """Seconds every task of a component gets between SIGTERM and SIGKILL when the job stops (the
    trainer checkpoints at its next step boundary in that time); all tasks are signalled at once."""
    master_port: int = Field(29500, ge=1024, le=65535)
    """TCP port of the trainer's torch.distributed rendezvous on its first node."""
    layout: Literal["separate_nodes", "one_node"] = "separate_nodes"
    """Where the two components run. ``separate_nodes``: one heterogeneous job, capture (het group 0)
    and trainer (het group 1) each on nodes of their own. ``one_node``: one plain job on one node whose
    GPUs, cores and memory both components share (a node with one GPU); it asks for the larger of the
    two GPU and CPU counts and the sum of the two memory requests, and starts each component as a
    step that overlaps the other (``srun --overlap``)."""
    capture: ComponentResources = Field(default_factory=lambda: ComponentResources(gpus_per_node=8, cpus_per_task=32))
    """Het group 0: Mooncake master, capture engine and producer."""
    trainer: ComponentResources = Field(
        default_factory=lambda: ComponentResources(gpus_per_node=4, tasks_per_node=4, cpus_per_task=16)
    )
    """Het group 1: the FSDP2 trainer ranks."""


# ----------------------------------------------------------------------------------------------
# capture
# ----------------------------------------------------------------------------------------------


class SpecialTokens(Section):
    """Special token ids of the target tokenizer."""

    bos_id: int | None = Field(None, ge=0)
    """Beginning-of-sequence token id."""
    eos_id: int | None = Field(None, ge=0)
    """End-of-sequence token id."""
    pad_id: int = Field(0, ge=0)
    """Padding token id (used only inside padded engine batches, never stored)."""


class SGLangSettings(Section):
    """Settings of the patched SGLang server used by ``capture.engine: sglang``."""

    patch_target: str = "kimi_k3_dspark_sglang_0.5.23"
    """Name (or alias) of the patch target in ``patches/sglang/MANIFEST.yaml``."""
    host: str = "127.0.0.1"
    """Address the server listens on; the producer runs on the same node."""
    port: int = Field(30000, ge=1024, le=65535)
    """HTTP port of the server."""
    tp_size: int = Field(8, ge=1)
    """Tensor parallel degree."""
    mem_fraction_static: float = Field(0.76, gt=0, lt=1)
    """Fraction of GPU memory for weights and KV cache."""
    context_length: int = Field(66048, ge=1)
    """Maximum context length the server accepts."""
    max_running_requests: int = Field(1, ge=1)
    """Concurrent requests in the server."""
    max_total_tokens: int = Field(66048, ge=1)
    """Token capacity of the KV pool."""
    attention_backend: str = "trtllm_mla"
    """SGLang ``--attention-backend``."""
    moe_runner_backend: str = "marlin"
    """SGLang ``--moe-runner-backend``."""
    mamba_radix_cache_strategy: Literal["auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"] = "extra_buffer"
    """Mamba/linear-attention radix cache strategy (``--mamba-radix-cache-strategy``)."""
    max_mamba_cache_size: int = Field(5, ge=1)
    """Mamba state cache slots."""
    disable_cuda_graph: bool = True
    """CUDA graphs off for decode and prefill (``--cuda-graph-backend-{decode,prefill} disabled``;
    prefill-only capture gains nothing from them)."""
    chunked_prefill_size: int = -1
    """Chunked prefill size; -1 turns chunking off so a sample is one prefill."""
    skip_tokenizer_init: bool = True
    """The producer sends token ids; the server needs no tokenizer."""
    trust_remote_code: bool = True
    """Allow the model's own code from the checkpoint folder."""
    capture_sink: Literal["mooncake", "discard"] = "mooncake"
    """Where the patched server's sink puts each capture (``--dspark-capture-sink``): ``mooncake``
    commits it to the store; ``discard`` only checks it and reports keys, shapes and dtypes (the
    first run on new hardware, before the data plane is involved)."""
    dist_init_port: int = Field(20000, ge=1024, le=65535)
    """Port of SGLang's multi-node rendezvous on the first capture node (``--dist-init-addr``), used
    when ``job.capture.nodes`` > 1 (TP across nodes)."""
    health_timeout_s: float = Field(3600.0, gt=0)
    """How long to wait for the server to become healthy (loading 1.5 TB takes a while)."""
    health_poll_interval_s: float = Field(5.0, gt=0)
    """Seconds between health probes while the server starts."""
    request_timeout_s: float = Field(900.0, gt=0)
    """Timeout of one capture request."""
    request_retries: int = Field(2, ge=0)
    """Retries of a capture request that failed in transit (connection refused or reset, HTTP 5xx);
    a capture is an idempotent upsert, so a retry is safe. Refusals (HTTP 4xx, a sink error) are
    not retried."""
    retry_backoff_s: float = Field(5.0, gt=0)
    """First retry delay; doubles on each retry."""
    shutdown_timeout_s: float = Field(60.0, gt=0)
    """Grace period between SIGTERM and SIGKILL when the engine stops the server."""
    log_tail_lines: int = Field(40, ge=1)
    """Lines of the server log quoted in an error when the server fails to start or dies."""
    expert_offload: Literal["none", "paged_experts", "cpu_offload"] = "none"
    """Serve with routed experts in host memory: ``paged_experts`` (``--enable-paged-experts``) or
    ``cpu_offload`` (``--cpu-offload-gb``). SGLang 0.5.23 supports neither for K3 at TP8 (see
    patches/sglang/README.md); the memory plan says why."""
    cpu_offload_gib_per_gpu: int = Field(0, ge=0)
    """``cpu_offload``: GiB of weights each GPU keeps in pinned host memory (``--cpu-offload-gb``)."""
    paged_experts_num_resident: int | None = Field(None, ge=1)
    """``paged_experts``: routed experts per MoE layer kept on the GPU (``--paged-experts-num-resident``)."""
    extra_args: list[str] = Field(default_factory=list)
    """Further ``sglang.launch_server`` arguments, verbatim."""
    device: Literal["cuda", "cpu"] = "cuda"
    """Where the server computes (``--device``): ``cuda`` on GPU nodes; ``cpu`` serves a tiny target
    without a GPU (tests, CI), with ``tp_size`` 1 and no GPUs requested for the capture component."""
    python: str | None = None
    """Interpreter that runs the server (relative to the repository unless absolute), e.g. the
    capture venv ``.cache/sgl-venv/bin/python`` that ``tools/bootstrap_sglang`` builds; the patch
    check looks at that interpreter's SGLang. Null: the capture component's own interpreter."""
    library_dirs: list[str] = Field(default_factory=list)
    """Folders put in front of the server's ``LD_LIBRARY_PATH`` (relative to the repository unless
    absolute). For CPU test servers only: ``.cache/sgl-venv/cuda-stub`` holds the stub
    ``libcuda.so.1`` that lets the kernel package load without a GPU driver; never on GPU nodes."""
    server_env: EnvironmentMapping = Field(default_factory=dict)
    """Extra environment variables of the server process only (e.g. ``SGLANG_USE_CPU_ENGINE: 1``
    for a CPU server); the producer does not see them."""


class ExpertStreamingSettings(Section):
    """Routed experts kept in host memory and streamed into HBM layer by layer, a copy stream ahead
    of the compute (runtime/moe/streaming.py). For targets whose weights do not fit the capture
    GPUs (Kimi K3 on 8 x H200). Give exactly one of ``gpu_budget_bytes`` and ``resident_fraction``."""

    enabled: bool = False
    """Stream routed experts from host memory (prefill-only capture)."""
    gpu_budget_bytes: ByteSize | None = None
    """Routed-expert bytes one GPU may hold: the resident MoE layers plus the
    ``prefetch_layers + 1`` streaming buffers; layers beyond it live in host memory. A budget
    that cannot hold the buffers is refused."""
    resident_fraction: float | None = Field(None, ge=0, le=1)
    """Instead of a budget: the share of MoE layers whose experts stay resident (0 streams all;
    the tests use it to force most experts to the host)."""
    prefetch_layers: int = Field(1, ge=1)
    """How many streamed layers ahead the copy stream runs (buffers = this + 1)."""
    pinned: bool = True
    """Keep the streamed experts in pinned (page-locked) host memory: pageable memory copies at a
    fraction of the PCIe rate and cannot overlap with compute."""


class LinearAttnConfig(Section):
    """The target config's ``linear_attn_config`` (Kimi Linear / K3), under its own names. Layer
    numbers are 1-based as the config writes them: SGLang 0.5.23 (``configs/kimi_linear.py``,
    ``is_kda_layer``) takes 0-based layer i as KDA linear attention when ``i + 1`` is in
    ``kda_layers``, and every other layer as full (MLA) attention."""

    kda_layers: list[int]
    """1-based layers with KDA linear attention."""
    full_attn_layers: list[int]
    """1-based layers with full MLA attention (SGLang reads them as every layer not in ``kda_layers``;
    the recipe checks that the two lists say the same)."""
    num_heads: int = Field(..., ge=1)
    """KDA heads."""
    head_dim: int = Field(..., ge=1)
    """KDA key and value head size."""


class TargetAttention(Section):
    """The target's attention shape, copied from its ``config.json`` (K3: ``text_config``) under the
    same names; the plan counts the prefill's attention FLOPs from it. A GQA target without MLA:
    ``qk_nope_head_dim`` = ``v_head_dim`` = ``head_dim`` and ``qk_rope_head_dim`` 0."""

    num_attention_heads: int = Field(..., ge=1)
    """Query heads of a full-attention layer."""
    qk_nope_head_dim: int = Field(..., ge=0)
    """MLA: per-head query/key size without rotary embedding."""
    qk_rope_head_dim: int = Field(0, ge=0)
    """MLA: per-head query/key size with rotary embedding."""
    v_head_dim: int = Field(..., ge=1)
    """Per-head value size."""
    linear_attn_config: LinearAttnConfig | None = None
    """Hybrid targets: which layers are linear attention; null: every layer is full attention."""


class CaptureSection(Section):
    """The capture component: target model, engine and producer."""

    engine: Literal["sglang", "embedded"] = "embedded"
    """``sglang``: patched SGLang server (production); ``embedded``: in-process transformers."""
    target_path: str
    """Local folder of the target checkpoint (Hugging Face layout)."""
    target_revision: str | None = None
    """Revision (commit) of the target checkpoint, recorded in every sample's meta."""
    num_target_layers: int = Field(..., ge=2)
    """Decoder layers of the target."""
    hidden_size: int = Field(..., ge=1)
    """Hidden size H of the target."""
    vocab_size: int = Field(..., ge=2)
    """Vocabulary size of the target (and of the draft's frozen embedding / lm_head)."""
    aux_layer_ids: list[int] = Field(..., min_length=1)
    """Decoder layers whose outputs feed the draft, in concatenation order. Layer id i is
    HF ``hidden_states[i + 1]``; the last decoder layer is not allowed."""
    special_tokens: SpecialTokens = Field(default_factory=SpecialTokens)
    """Special token ids of the target tokenizer."""
    target_weight_bytes: ByteSize | None = None
    """Size of the target's weights as served (K3 in MXFP4: about 1.56 TB); the plan checks it
    against the capture node's accelerator memory. Null skips that check."""
    target_active_params: float | None = Field(None, gt=0)
    """Parameters active per token (for the plan's capture throughput model); null skips it."""
    routed_expert_weight_bytes: ByteSize | None = None
    """The routed experts' share of ``target_weight_bytes`` (K3: about 1.45 TB of the 1.56 TB): what
    expert offload could keep in host memory. Null: the plan does not size offload."""
    target_attention: TargetAttention | None = None
    """The target's attention layout (hybrid linear / full attention), for the plan's prefill time;
    null: attention is not counted (the plan says so)."""
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the embedded engine's forward (float32 gives exact CPU tests)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the embedded engine runs; auto picks CUDA when present."""
    batch_size: int = Field(1, ge=1)
    """Samples per embedded-engine forward (padded with attention masks, never mixed)."""
    engines_per_node: int | None = Field(None, ge=1)
    """Data-parallel embedded engines on the capture node; null: one per GPU, or one on CPU."""
    commit_staging_slots: int | None = Field(None, ge=0)
    """Embedded engine: samples staged in page-locked host memory or being committed while the next
    forward runs (each slot is pinned at the recipe's largest ``hs`` + ``lhs`` size, so this bounds
    the pipeline's host memory). Null: one batch (``batch_size`` x replicas); 0: no pipeline, each
    sample is committed before the next forward starts."""
    expert_parallel: int = Field(1, ge=1)
    """Expert-parallel degree of the embedded engine for MoE targets."""
    moe_exchange: Literal["nccl", "deepep", "mooncake"] = "nccl"
    """MoE dispatch/combine backend when ``expert_parallel > 1``."""
    num_moe_layers: int | None = Field(None, ge=1)
    """Decoder layers with routed experts (Kimi K3: 92 of 93, the first is dense); null: all
    ``num_target_layers``. The plan sizes expert streaming per layer from it."""
    expert_streaming: ExpertStreamingSettings = Field(default_factory=ExpertStreamingSettings)
    """Routed experts streamed from host memory (see :class:`ExpertStreamingSettings`)."""
    owns_master: bool = True
    """The capture component starts the Mooncake master on its node."""
    inject_nan_at_g: int | None = Field(None, ge=0)
    """Smoke-gate self-test only: write NaN into the ``hs`` of sample g, to prove the gate stops a
    non-finite update (refused outside ``--smoke``; embedded engine only)."""
    progress_interval_s: float = Field(30.0, gt=0)
    """Seconds between producer progress lines in a non-TTY log."""
    sglang: SGLangSettings = Field(default_factory=SGLangSettings)
    """Server settings for ``engine: sglang``."""

    def effective_commit_staging_slots(self, replicas: int) -> int:
        """``commit_staging_slots``, or one batch of ``replicas`` engines when it is null."""
        if self.commit_staging_slots is not None:
            return self.commit_staging_slots
        return self.batch_size * max(1, replicas)


# ----------------------------------------------------------------------------------------------
# transport
# ----------------------------------------------------------------------------------------------


class TransportSection(Section):
    """Mooncake store, master and the producer window."""

    protocol: Literal["tcp", "rdma"] = "tcp"
    """Mooncake transfer protocol."""
    rdma_devices: list[str] = Field(default_factory=list)
    """RDMA device names (``mlx5_0`` ...) for ``protocol: rdma``."""
    bind_address: Annotated[str, AfterValidator(_bind_address)] = "auto"
    """Address every Mooncake client and the master bind to: ``auto`` is the node's routable
    address (its Slurm node name resolved), loopback in ``--local`` mode; or an explicit IP."""
    master_rpc_port: int = Field(50051, ge=1024, le=65535)
    """RPC port of ``mooncake_master`` on the capture node."""
    metadata_http_port: int = Field(8080, ge=1024, le=65535)
    """Port of the master's built-in HTTP metadata server."""
    metrics_port: int = Field(9003, ge=1024, le=65535)
    """Prometheus metrics port of the master."""
    global_segment_bytes: ByteSize = 2 * 2**30
    """Memory the store holds samples in (on the node(s) ``segment_placement`` names)."""
    segment_placement: Literal["capture", "trainer", "split"] = "capture"
    """Where the sample segment lives: ``capture`` (the producer mounts it; puts are local
    copies), ``trainer`` (trainer rank 0 mounts it: the trainer node's idle host memory, when the
    capture node's holds streamed experts; the producer's puts cross the network), or ``split``
    (half on each; Mooncake places each sample in either). The plan checks each node's host memory."""
    local_buffer_bytes: ByteSize = 256 * 2**20
    """Registered local buffer of each client (staging for put/get)."""
    store_cap_bytes: ByteSize = 1 * 2**30
    """Bytes the store may hold before the master evicts: the master's eviction high-watermark
    ratio is ``store_cap_bytes / global_segment_bytes``."""
    kv_lease_ttl_s: int = Field(300, ge=1)
    """Master ``--default_kv_lease_ttl``: covers a multi-GiB object in flight."""
    transfer_timeout_s: int = Field(300, ge=1)
    """Clients' ``MC_TRANSFER_TIMEOUT``."""
    high_watermark_samples: int = Field(..., ge=1)
    """The producer pauses when this many samples are resident."""
    low_watermark_samples: int = Field(..., ge=1)
    """The producer resumes when resident samples drop below this."""
    high_watermark_bytes: ByteSize
    """The producer pauses when resident bytes reach this."""
    low_watermark_bytes: ByteSize
    """The producer resumes when resident bytes drop below this."""
    idle_timeout_s: float = Field(1800.0, gt=0)
    """A trainer rank waiting this long for one sample fails, naming the sample and the
    producer's last heartbeat age."""
    heartbeat_interval_s: float = Field(10.0, gt=0)
    """Seconds between producer heartbeats."""
    store_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$")
    """Key prefix of this run in the store; null uses ``job.name``."""
    max_retries: int = Field(5, ge=0)
    """Retries of a transient put/get failure."""
    retry_backoff_s: float = Field(0.5, gt=0)
    """First retry delay; doubles on each retry."""
    connect_timeout_s: float = Field(300.0, gt=0)
    """How long a Mooncake client waits for the master to answer before it fails (the trainer may
    start before the capture node's master is up)."""
    client_ttl_s: int = Field(10, ge=1)
    """Master ``--client_ttl``: seconds a silent client's segment stays mounted; after a producer
    crash its samples disappear from the store this long after its last heartbeat."""
    poll_interval_s: float = Field(0.2, gt=0)
    """How often a waiting trainer rank or a paused producer looks at the store again."""
    wait_log_interval_s: float = Field(30.0, gt=0)
    """Seconds between "still waiting" lines of a trainer rank waiting for a sample (or a producer
    waiting for the cursor)."""
    verify_checksums: bool = True
    """Trainer ranks check each field's CRC-32 against the sample's ``meta`` (about 4 GiB/s per core)."""


# ----------------------------------------------------------------------------------------------
# trainer
# ----------------------------------------------------------------------------------------------


class RopeScaling(Section):
    """RoPE scaling of the draft (YaRN for K3)."""

    type: Literal["yarn", "linear", "dynamic"] = "yarn"
    """Scaling type."""
    factor: float = Field(1.0, ge=1.0)
    """Context extension factor."""
    original_max_position_embeddings: int = Field(4096, ge=1)
    """Positions the base RoPE was trained for."""
    beta_fast: float = 32.0
    """YaRN high-frequency boundary (rotations)."""
    beta_slow: float = 1.0
    """YaRN low-frequency boundary (rotations)."""


class MLAConfig(Section):
    """Multi-head latent attention of the draft's layers (``trainer.draft.attention: mla``), in the
    compressed-latent form of DeepSeek-V2 and the K3 MLA drafters: queries through a low-rank
    ``q_a_proj -> q_a_layernorm -> q_b_proj`` (Q-LoRA), keys and values through one shared latent
    ``kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj`` plus a single rotary key head, and an optional
    sigmoid output gate (``g_proj``) on each head's output before ``o_proj``."""

    q_lora_rank: int | None = Field(..., ge=1)
    """Rank of the query compression (null: one ``q_proj`` from the hidden state)."""
    kv_lora_rank: int = Field(..., ge=1)
    """Width of the compressed key/value latent."""
    qk_nope_head_dim: int = Field(..., ge=1)
    """Per-head query/key dimension without rotary position (decompressed from the latent)."""
    qk_rope_head_dim: int = Field(..., ge=2)
    """Per-head query dimension with rotary position; the key's rotary part is one head shared by all."""
    v_head_dim: int = Field(..., ge=1)
    """Per-head value dimension."""
    use_output_gate: bool = True
    """``sigmoid(g_proj(x))`` multiplies each head's output before ``o_proj`` (K3's gated MLA)."""
    rope_interleave: bool = True
    """Rotate interleaved channel pairs (DeepSeek's layout), not the two halves of the rotary part."""

    @field_validator("qk_rope_head_dim")
    @classmethod
    def _even_rope(cls, value: int) -> int:
        if value % 2:
            raise ValueError(f"is {value}: rotary dimensions come in pairs. Fix: give an even number, e.g. 64")
        return value


class KDAConfig(Section):
    """Kimi Delta Attention of the draft's ``kda`` layers: a gated delta-rule recurrence run over each
    proposal block on its own (its state starts empty at every block, so no block sees another's slots),
    reading no target context: in a hybrid draft the ``mla``/``gqa`` layers bring the context in."""

    num_heads: int = Field(..., ge=1)
    """Heads of the recurrence."""
    head_dim: int = Field(..., ge=1)
    """Key, query and value width per head (the state is head_dim x head_dim)."""
    short_conv_kernel_size: int = Field(4, ge=1)
    """Causal depthwise convolution (no bias, then SiLU) on q, k and v, over the slots of one block."""
    gate_lower_bound: float | None = Field(-5.0, lt=0)
    """The forget gate's log-decay per channel is ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``;
    null: ``-exp(A_log) * softplus(f + dt_bias)``."""
    use_full_rank_gate: bool = True
    """The output gate as one ``g_proj`` (full rank), else ``g_b_proj(g_a_proj(x))``."""


class DraftConfig(Section):
    """The DSpark draft: Qwen3-style decoder layers plus Markov and confidence heads."""

    num_layers: int = Field(..., ge=1)
    """Draft decoder layers."""
    hidden_size: int = Field(..., ge=1)
    """Draft hidden size (equal to the target's: the frozen embedding and lm_head are shared)."""
    num_attention_heads: int = Field(..., ge=1)
    """Query heads."""
    num_key_value_heads: int = Field(..., ge=1)
    """Key/value heads (GQA)."""
    head_dim: int = Field(..., ge=1)
    """Dimension of one head."""
    intermediate_size: int = Field(..., ge=1)
    """MLP intermediate size (SiLU gated)."""
    rms_norm_eps: float = Field(1e-5, gt=0)
    """RMSNorm epsilon."""
    attention_bias: bool = False
    """Bias on the q/k/v/o projections."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base."""
    rope_scaling: RopeScaling | None = None
    """RoPE scaling; null for plain RoPE."""
    max_position_embeddings: int = Field(..., ge=1)
    """Longest position the draft supports."""
    block_size: int = Field(7, ge=2)
    """Slots per block: slot 0 is the anchor token, the rest are mask tokens."""
    mask_token_id: int = Field(..., ge=0)
    """Token id embedded in slots 1..block_size-1."""
    markov_rank: int = Field(256, ge=1)
    """Rank r of the Markov head."""
    markov_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    """Markov head variant."""
    confidence_head: bool = True
    """Train the confidence head."""
    confidence_uses_markov_embedding: bool = True
    """Feed the confidence head ``[post-norm hidden; W1[prev token]]``."""
    attention: Literal["gqa", "mla"] = "gqa"
    """Every layer's attention: ``gqa`` (``num_attention_heads``/``num_key_value_heads``/``head_dim``) or
    ``mla`` (its shape in ``mla``; ``num_attention_heads`` heads)."""
    mla: MLAConfig | None = None
    """The latent attention's shape, required when a layer is ``mla``."""
    layers: list[Literal["gqa", "mla", "kda"]] | None = None
    """The attention of each layer, in order (``[kda, kda, mla, kda, kda]``: the K3 KDA+MLA hybrid); null:
    every layer ``attention``."""
    kda: KDAConfig | None = None
    """The delta-rule recurrence's shape, required when a layer is ``kda``."""

    @property
    def layer_attentions(self) -> tuple[str, ...]:
        """Each layer's attention (``layers``, or ``attention`` for every layer)."""
        return tuple(self.layers) if self.layers is not None else (self.attention,) * self.num_layers

    @model_validator(mode="after")
    def _layer_shapes_given(self) -> DraftConfig:
        kinds = self.layer_attentions
        if self.layers is not None and len(self.layers) != self.num_layers:
            raise ValueError(
                f"layers lists {len(self.layers)} attentions for num_layers {self.num_layers}. Fix: one per layer"
            )
        if "mla" in kinds and self.mla is None:
            raise ValueError(
                "attention is mla, but trainer.draft.mla is not set. Fix: give its shape, e.g. mla: {q_lora_rank: "
                "1536, kv_lora_rank: 512, qk_nope_head_dim: 128, qk_rope_head_dim: 64, v_head_dim: 128}"
            )
        if "kda" in kinds and self.kda is None:
            raise ValueError(
                "a layer is kda, but trainer.draft.kda is not set. Fix: give its shape, e.g. kda: {num_heads: 96, "
                "head_dim: 128}"
            )
        if set(kinds) == {"kda"}:
            raise ValueError(
                "every layer is kda, and kda reads no target context: the draft would never see the target. Fix: make "
                "at least one layer mla or gqa (the K3 hybrid: [kda, kda, mla, kda, kda])"
            )
        return self


class OptimizerConfig(Section):
    """AdamW over fp32 master weights."""

    lr: float = Field(..., gt=0, le=1.0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas, each in [0, 1)."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in value):
            raise ValueError(
                f"betas {list(value)} are outside [0, 1) (AdamW refuses them at trainer start). Fix: use values "
                "such as [0.9, 0.95]"
            )
        return value

    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient-norm clipping threshold."""


class ScheduleConfig(Section):
    """Learning-rate schedule."""

    type: Literal["constant", "constant_with_warmup", "linear", "cosine", "wsd"] = "constant"
    """Schedule shape; resuming with another type is an error."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps from 0 (ignored by ``constant``)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Floor of cosine / linear / wsd decay as a fraction of the peak."""
    decay_steps: int | None = Field(None, ge=1)
    """Steps of the final decay for ``wsd``; null: 10% of the run."""
    total_steps: int | None = Field(None, ge=1)
    """Steps the decay spans; null derives it from epochs, data rows and the global batch."""


class LossConfig(Section):
    """DSpark loss."""

    ce_weight: float = Field(0.1, ge=0)
    """Weight of the cross-entropy term."""
    l1_weight: float = Field(0.9, ge=0)
    """Weight of the full L1 distance between draft and target distributions."""
    confidence_weight: float = Field(1.0, ge=0)
    """Weight of the confidence BCE term."""
    num_anchors: int = Field(512, ge=1)
    """Anchors (blocks) sampled per sequence."""
    loss_decay_gamma: float = Field(4.0, gt=0)
    """Slot weight ``exp(-k / gamma)``."""
    objective_chunk_blocks: int = Field(128, ge=1)
    """Blocks per chunk of the vocabulary-sized terms."""


class CheckpointConfig(Section):
    """Checkpoints."""

    every_steps: int = Field(8, ge=1)
    """Save every this many optimizer steps (and at the end)."""
    keep_last: int = Field(3, ge=1)
    """Complete checkpoints kept; older ones are removed."""
    dir: str | None = None
    """Checkpoint folder; null: ``checkpoints/`` inside the job folder."""
    resume_from: str | None = None
    """Full resume: a checkpoint path or ``auto`` (the newest in ``dir``)."""
    init_from: str | None = None
    """Weights-only warm start from a checkpoint path (optimizer, schedule, counters, RNG fresh)."""
    export_safetensors: bool = True
    """Also export the final draft as safetensors + config for SGLang's DSpark loader."""


class FeatureCacheConfig(Section):
    """Capture once, train many epochs: the trainer node keeps every sample it reads in the first
    epoch on its local disk, and later epochs read them from there.

    The producer then captures epoch 0 only, plus any later sample a trainer rank asks for (its
    cache entry is missing or corrupt: a requeue onto another node, a wiped disk). The entries are
    keyed by the data row and by a digest of everything that determines the features (target,
    revision, aux layers, hidden size, engine, data SHA-256, max length): a cache written for
    another target or data file is never read."""

    enabled: bool = False
    """Keep first-epoch samples on the trainer node's local disk and read later epochs from it."""
    dir: str | None = None
    """Cache folder on the trainer node's local disk (NVMe), e.g. ``/local/nvme/dspark_cache``;
    ``${VAR}`` is taken from the trainer's environment (``${SLURM_TMPDIR}``); relative paths are
    relative to the repository. Needs room for every row at its captured size (``--plan`` says how much)."""
    lookahead_steps: int = Field(2, ge=1)
    """How many optimizer steps ahead a trainer rank checks its cache and asks the producer for
    the samples it lacks (the producer captures them before the rank needs them)."""


class MetricsConfig(Section):
    """Where metrics go besides ``metrics.jsonl``."""

    tensorboard: bool = True
    """Write TensorBoard event files into the job folder."""
    wandb_project: str | None = None
    """Weights & Biases project; the key comes from ``WANDB_API_KEY`` in the environment only."""
    wandb_entity: str | None = None
    """Weights & Biases entity."""


class TrainerSection(Section):
    """The DSpark trainer."""

    seed: int = Field(0, ge=-MAX_SEED - 1, le=MAX_SEED)
    """Seed of model init, anchors and every other trainer RNG."""
    prompt_seed: int | None = Field(None, ge=0, le=MAX_SEED)
    """Seed of the prompt order alone; null uses ``seed``."""
    micro_batch_size: int = Field(1, ge=1)
    """Samples per rank per micro-step."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-steps per optimizer step."""
    global_batch_size: int = Field(..., ge=1)
    """Samples per optimizer step: must equal micro_batch x accumulation x trainer ranks."""
    epochs: int = Field(1, ge=1, le=MAX_EPOCHS)
    """Passes over the prompt set (at most 10,000: more is a typo, and sample keys hold g in 12 digits)."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many optimizer steps (null: run all epochs)."""
    log_every_steps: int = Field(10, ge=1)
    """Progress line every this many steps."""
    max_consecutive_skips: int = Field(3, ge=1)
    """Non-finite updates skipped in a row before the run aborts."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Trainer device; auto picks CUDA when present."""
    param_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype of the draft under FSDP2 (master weights stay fp32)."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Gradient reduction dtype."""
    attention_backend: Literal["auto", "flex", "sdpa"] = "auto"
    """auto: flex_attention with a block mask on GPU, SDPA with an explicit mask on CPU."""
    compile_regions: Literal["auto", "on", "off"] = "auto"
    """torch.compile the decoder layers, the context projection and the loss chunks' elementwise
    work, and run the Markov-bias matmuls on tensor cores when the compute dtype is 16-bit.
    auto: on for a CUDA trainer, off on CPU (CPU numerics stay those of eager PyTorch; compiling
    on a CPU costs minutes)."""
    sample_source: Literal["mooncake", "files"] = "mooncake"
    """Where trainer ranks get samples: ``mooncake`` (the data plane; the default) or ``files`` (a
    folder of per-sample safetensors files written by tests or tools, no capture component)."""
    sample_dir: str | None = None
    """Folder of ``{g:012d}.safetensors`` samples for ``sample_source: files`` (relative to the
    repository unless absolute)."""
    embed_tensor_name: str = "model.embed_tokens.weight"
    """Name of the frozen token embedding in the target checkpoint."""
    lm_head_tensor_name: str = "lm_head.weight"
    """Name of the frozen lm_head in the target checkpoint."""
    draft: DraftConfig
    """Draft architecture."""
    optimizer: OptimizerConfig
    """Optimizer."""
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """Loss weights and sampling."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpointing."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """Metrics sinks."""
    feature_cache: FeatureCacheConfig = Field(default_factory=FeatureCacheConfig)
    """Node-local feature cache: capture each row once, train many epochs."""

    @property
    def effective_prompt_seed(self) -> int:
        """``prompt_seed``, or ``seed`` when it is not set."""
        return self.seed if self.prompt_seed is None else self.prompt_seed


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------


class DataSection(Section):
    """The pre-tokenized training data."""

    train_path: str
    """Pre-tokenized JSONL (``{id, input_ids, loss_mask}`` per line), relative to the repository
    unless absolute."""
    expected_sha256: str = Field(..., pattern=r"^([0-9a-f]{64}|manifest)$")
    """SHA-256 of ``train_path``; the launcher refuses to submit on a mismatch. ``manifest`` takes
    the SHA-256 recorded in the manifest that ``tools/prepare_data`` wrote beside the file."""
    num_rows: int | None = Field(None, ge=1)
    """Expected row count (checked by ``tools/verify_data``)."""
    max_length: int = Field(..., ge=2)
    """Longest sequence in tokens (rows were truncated to it)."""
    chat_path: str | None = None
    """Source chat JSONL that ``tools/prepare_data`` tokenizes into ``train_path``."""
    prepare_commands: list[str] = Field(default_factory=list)
    """Shell commands, run from the repository root on the submitting machine before the launcher
    checks anything, when ``capture.target_path`` or ``train_path`` does not exist yet (for the tiny
    recipe: build the tiny target, then tokenize its data). Each must be idempotent."""


# ----------------------------------------------------------------------------------------------
# eval: judging a trained draft under speculative decoding
# ----------------------------------------------------------------------------------------------


class EvalSet(Section):
    """One eval set: a JSONL file of prompts, pinned by its SHA-256."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
    """Short name, used in results and tables (letters, digits, ``_.-``)."""
    path: str
    """JSONL, one prompt per line: ``{"id", "conversations": [{role, content}, ...]}`` (rendered with
    the target tokenizer's chat template and its generation prompt; a trailing assistant turn is
    dropped) or ``{"id", "input_ids": [...]}`` (used as is). Relative to the repository unless absolute."""
    sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$")
    """SHA-256 of the file; the eval refuses a file that differs."""
    max_prompts: int | None = Field(None, ge=1)
    """Use only the first this many prompts (null: all)."""


class EvalSection(Section):
    """Speculative-decoding evaluation of a trained draft (``python3 -m launcher eval JOB``)."""

    sets: list[EvalSet] = Field(..., min_length=1)
    """Eval sets, each reported on its own and together."""
    max_new_tokens: int = Field(256, ge=1)
    """Tokens generated per prompt at most (generation also stops at a stop token)."""
    temperatures: list[float] = Field(default_factory=lambda: [0.0], min_length=1)
    """Sampling temperatures; 0 is greedy verification (longest matching prefix plus the target's
    token), above 0 the rejection rule of speculative sampling. Each is a separate pass."""
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """Tokens that end a generation besides ``capture.special_tokens.eos_id`` (e.g. end of turn)."""
    batch_size: int = Field(1, ge=1)
    """Prompts in flight at once on the SGLang route (concurrent requests). The embedded decoder
    decodes one prompt at a time."""
    seed: int = Field(0, ge=-MAX_SEED - 1, le=MAX_SEED)
    """Seed of the sampled passes and of the untrained comparison draft's initialisation."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the embedded eval runs: ``auto`` is the first GPU when there is one."""
    compare_untrained: bool = True
    """Also evaluate an untrained draft of the same shape (its floor) in the same run."""
    time_limit_min: int = Field(60, ge=1, le=MAX_TIME_LIMIT_MIN)
    """Slurm time limit of the eval job (``python3 -m launcher eval JOB`` without ``--local``)."""
    route: Literal["auto", "embedded", "sglang"] = "auto"
    """How the target decodes: ``embedded`` (our speculative decoder over the transformers target,
    on one device), ``sglang`` (SGLang serving the exported draft with ``--speculative-algorithm
    DSPARK``, GPU only), ``auto`` (the capture engine's: ``capture.engine``)."""
    sglang_verify_mode: Literal["static", "cap-accept", "compact"] = "cap-accept"
    """``SGLANG_RAGGED_VERIFY_MODE`` of the SGLang route: ``cap-accept`` and ``compact`` size each
    request's verify from the draft's confidence head (so the head is used); ``static`` verifies whole
    blocks and ignores it."""
    request_timeout_s: float = Field(1800.0, gt=0)
    """Longest wait for one prompt's answer on the SGLang route."""
    after_training: bool = False
    """Evaluate the final draft when training ends. A ``--local`` run evaluates it on this machine and
    ends with the table (trained against untrained acceptance, speed against the target alone); a
    Slurm submission also submits the eval job with ``--dependency=afterok`` on the training job."""
    checkpoint_prompts: int = Field(0, ge=0)
    """During a ``--local`` run, decode this many prompts of the first eval set greedily with every
    checkpoint as the trainer writes it (in a low-priority process beside the run, off the trainer's
    path), for the acceptance-over-steps plot beside the trainer's tau; 0: off."""

    @field_validator("temperatures")
    @classmethod
    def _temperatures_not_negative(cls, value: list[float]) -> list[float]:
        if any(t < 0 for t in value):
            raise ValueError(f"temperatures {value} include a negative value. Fix: use 0 (greedy) or a positive value")
        return value

    @model_validator(mode="after")
    def _set_names_unique(self) -> EvalSection:
        names = [s.name for s in self.sets]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"eval set names {duplicates} appear more than once. Fix: give each set its own name")
        return self


# ----------------------------------------------------------------------------------------------
# plan: hardware assumptions of the launcher's --plan (nothing at run time reads these)
# ----------------------------------------------------------------------------------------------


class PlanSection(Section):
    """Hardware assumptions behind ``--plan``'s memory and throughput model. Stated, not measured
    at plan time: change them to your site's numbers."""

    accelerator: str = "H200"
    """Name of the accelerator, for the report."""
    accelerator_memory_bytes: ByteSize = 141 * 10**9
    """Memory of one accelerator (H200: 141 GB)."""
    accelerator_peak_tflops: float = Field(795.0, ge=MIN_RATE)
    """Dense bf16 matmul rate of one accelerator (795 TFLOP/s measured on our H200)."""
    capture_efficiency: float = Field(0.35, gt=0, le=1)
    """Fraction of the peak a long prefill of the target reaches."""
    train_mfu: float = Field(0.45, gt=0, le=1)
    """Model FLOP utilisation the trainer reaches."""
    link_gbps: float = Field(100.0, ge=MIN_RATE)
    """Capture-to-trainer network speed in Gbit/s."""
    link_efficiency: float = Field(0.7, gt=0, le=1)
    """Fraction of the link a Mooncake transfer reaches."""
    store_put_gbps: float = Field(5.2, ge=MIN_RATE)
    """GB/s of the capture side's commit: a Mooncake put into the producer's own segment, a local
    copy (5.2 GB/s measured on our H200 host for a 5.25 GiB sample)."""
    capture_host_memory_bytes: ByteSize = 2 * 2**40
    """Host memory of the capture node (holds its share of the Mooncake segment and the streamed
    experts of every GPU)."""
    trainer_host_memory_bytes: ByteSize = 2 * 2**40
    """Host memory of one trainer node (holds its share of the Mooncake segment, if any)."""
    pcie_h2d_bytes_per_s: ByteSize = 50 * 10**9
    """Pinned host-to-device copy rate of one GPU's PCIe link (55 GB/s measured on our H200)."""
    expert_compute_tflops: float = Field(500.0, ge=MIN_RATE)
    """Rate of the routed-expert compute (dequant-once MXFP4 + grouped GEMM) at a long prefill:
    531 TFLOP/s measured at 64K tokens per GPU on our H200 (tools/bench/moe.py)."""
    trainer_local_disk_bytes: ByteSize = 28 * 10**12
    """Free local disk (NVMe) of one trainer node for ``trainer.feature_cache`` (8-GPU nodes often
    carry 8 x 3.84 TB NVMe drives; an assumption: set your site's number)."""
    attention_tflops: float = Field(600.0, ge=MIN_RATE)
    """Rate of causal full attention in a long prefill (MLA-like heads: qk 192, v 128, at 64K): 601
    TFLOP/s measured on our H200 with PyTorch's SDPA (torch 2.11; 80% of a bf16 matmul in the same
    run; compiled flex attention reached 314). ``python3 -m tools.bench.attention`` measures it on
    yours. SGLang's own MLA prefill kernel was not measured."""
    linear_attention_tflops: float = Field(100.0, ge=MIN_RATE)
    """Rate of the KDA linear-attention kernels (chunked delta rule, Triton) in a long prefill. An
    assumption: these kernels reach far less of the peak than matmuls; not measured here."""
    cache_read_gbps: float = Field(20.0, ge=MIN_RATE)
    """GB/s at which the trainer node's ranks together read the feature cache from local disk (an
    assumption for an NVMe RAID, not measured on our machines: measure yours with ``fio`` or ``dd``)."""
    slurm_max_mem_per_node_gib: int | None = Field(None, ge=1)
    """The most memory one node may be given (``--mem``) at this site: Slurm's MaxMemPerNode, or
    the nodes' RealMemory (``scontrol show node``). Each component requests the plan's host memory
    of its node plus a margin (runtime/recipe/fit/slurm_request.py); a request above this cap is
    refused at load time with both numbers. Null: no cap known (Slurm refuses what no node has)."""


# ----------------------------------------------------------------------------------------------
# the recipe
# ----------------------------------------------------------------------------------------------


class Recipe(Section):
    """One training run. The resolved form of this is the only thing the runtime reads."""

    description: str = ""
    """Free text: what this run is for."""
    job: JobSection
    """Slurm job."""
    capture: CaptureSection
    """Capture component."""
    transport: TransportSection
    """Mooncake transport and flow control."""
    trainer: TrainerSection
    """Trainer component."""
    data: DataSection
    """Training data."""
    plan: PlanSection = Field(default_factory=PlanSection)
    """Hardware assumptions of ``--plan``."""
    eval: EvalSection | None = None
    """Speculative-decoding evaluation of the trained draft; null: the recipe has none."""
    smoke: dict[str, Any] = Field(default_factory=dict)
    """Overlay applied by ``--smoke``: same structure as the recipe, deep-merged over it."""

    @property
    def trainer_world_size(self) -> int:
        """Trainer ranks: nodes x tasks per node of the trainer het group."""
        return self.job.trainer.nodes * self.job.trainer.tasks_per_node

    @property
    def store_id(self) -> str:
        """Key prefix of this run in Mooncake."""
        return self.transport.store_id or self.job.name

    @property
    def num_aux_layers(self) -> int:
        """Number of captured auxiliary layers."""
        return len(self.capture.aux_layer_ids)


def top_level_sections() -> tuple[type[Section], ...]:
    """The section types directly under the recipe's root (``job``, ``capture``, ``trainer``, ...).

    Each holds the settings of many parts: a part takes its own leaf section (``trainer.draft``,
    ``trainer.schedule``, ...), never one of these."""
    found: list[type[Section]] = []
    for field in Recipe.model_fields.values():
        for candidate in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(candidate, type) and issubclass(candidate, Section):
                found.append(candidate)
    return tuple(found)
