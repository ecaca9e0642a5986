"""Every contract between processes, in one module (torch-free; importable from the login node).

- Environment: the names of the variables the launcher hands a component (:data:`ENV_JOB_DIR`, ...).
- Data plane: store keys, the sample fields and their dtypes and shapes with
  the one check every side uses (:func:`sample_problems`), the map from (step, micro-step, rank) to the
  global sample index ``g`` (:func:`step_sample_indices`), and the producer/consumer protocols.
- Smoke gate: the typed records ``capture_gate.json`` and ``trainer_gate.json`` that the capture and
  trainer components write and ``launcher/gate.py`` reads (:class:`CaptureGateRecord`,
  :class:`TrainerGateRecord`).

Torch is imported only for type checking, so this module is cheap to import anywhere.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.files import atomic_write_text
from runtime.user_errors import shell_word

if TYPE_CHECKING:
    import torch

# ----------------------------------------------------------------------------------------------
# environment: launcher -> component
# ----------------------------------------------------------------------------------------------

JOB_FOLDER_SETTING = "job.runs_dir"
"""The setting that moves every job folder (and all a run writes into it) to another file system: the
fix a full disk's message names."""
JOB_RECORD_FILENAME = "job.json"
"""The launcher's record of a job in its folder (mode, recipe source, ...): ``launcher/jobs.py`` writes it."""


def resume_command(job_dir: str | Path, local: bool) -> str:
    """The one command line that resumes a job from its newest checkpoint (every message that tells the
    operator how to go on prints this one): the job's own resolved recipe, its --set overrides included,
    so the resumed run is the same run."""
    return f"python3 -m launcher --resume {shell_word(str(job_dir))}{' --local' if local else ''}"


def probe_again_command(job_dir: str | Path, recipe_source: str, local: bool) -> str:
    """The command that runs a site probe again, with the --set overrides its job was resolved with: a probe
    job trains nothing, so it has nothing to resume."""
    from runtime.recipe.loader import RESOLVED_FILENAME  # the recipe layer imports this module's neighbours

    try:
        overrides = json.loads((Path(job_dir) / RESOLVED_FILENAME).read_text())["overrides"]
        sets = "".join(f" --set {shell_word(str(item))}" for item in overrides)
    except (OSError, ValueError, KeyError, TypeError):
        sets = ""
    return f"python3 -m launcher {shell_word(recipe_source)} --probe{sets}{' --local' if local else ''}"


def resume_command_of(job_dir: Path) -> str:
    """:func:`resume_command` for the job in ``job_dir``, from its ``job.json`` (a component knows only
    its folder; Slurm when the record cannot be read); for a probe job, :func:`probe_again_command`."""
    try:
        record = json.loads((job_dir / JOB_RECORD_FILENAME).read_text())
        local = record.get("mode") == "local"
        if record.get("probe") is True and isinstance(record.get("recipe_source"), str):
            return probe_again_command(job_dir, record["recipe_source"], local)
        return resume_command(job_dir, local)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return resume_command(job_dir, local=False)


def how_to_go_on(job_dir: Path) -> str:
    """``resume with `COMMAND``` for a training job, ``run the probe again with `COMMAND``` for a probe
    (the words every failure line ends with)."""
    command = resume_command_of(job_dir)
    return f"run the probe again with `{command}`" if " --probe" in command else f"resume with `{command}`"


TRAINER_EXIT_STOPPED = 143
"""A trainer rank's exit code after a stop request (SIGTERM): it finished its step, wrote a checkpoint
and left (128 + SIGTERM, what a shell reports for a process SIGTERM ended). The supervisor reads it as
STOPPED with the work kept, not as a failure."""

ENV_JOB_DIR = "DSPARK_JOB_DIR"
"""The job folder (records, logs, checkpoints)."""
ENV_RECIPE = "DSPARK_RECIPE"
"""The resolved recipe file the component reads."""
ENV_COMPONENT = "DSPARK_COMPONENT"
"""``capture`` or ``trainer``."""
ENV_TASK_RANK = "DSPARK_TASK_RANK"
"""Rank of the task within its component."""
ENV_REQUEUE_COUNT = "DSPARK_REQUEUE_COUNT"
"""How often the job was requeued (a requeued trainer resumes from its newest checkpoint)."""
ENV_BIND_ADDRESS = "DSPARK_BIND_ADDRESS"
"""This node's routable address (Mooncake binds to it)."""
ENV_CAPTURE_HOST = "DSPARK_CAPTURE_HOST"
"""Routable address of the capture node."""
ENV_MOONCAKE_MASTER = "DSPARK_MOONCAKE_MASTER"
"""``host:port`` of the Mooncake master's RPC endpoint."""
ENV_MOONCAKE_METADATA = "DSPARK_MOONCAKE_METADATA"
"""URL of the Mooncake master's HTTP metadata server."""
ENV_RDMA_DEVICES = "DSPARK_RDMA_DEVICES"
"""Comma-separated RDMA devices (``transport.protocol: rdma``)."""
ENV_MC_TCP_BIND_ADDRESS = "MC_TCP_BIND_ADDRESS"
"""Mooncake's own variable: the address its TCP transport binds to."""
ENV_MC_TRANSFER_TIMEOUT = "MC_TRANSFER_TIMEOUT"
"""Mooncake's own variable: seconds a transfer may take."""
TRAINER_ENV_NAMES: tuple[str, ...] = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""torch.distributed's rendezvous variables, which only trainer ranks receive (from their own het
group's Slurm variables or the local launcher)."""
ENV_PARENT_PID = "DSPARK_PARENT_PID"
"""The pid of the process that started the component (the ``--local`` supervisor or the Slurm worker):
the component ends itself when that parent is gone (runtime.shared.lifecycle.exit_when_orphaned)."""
ENV_SLURM_JOB_ID = "DSPARK_SLURM_JOB_ID"
"""The het job's leader id, exported by the batch script (every srun task sees the same one)."""
CONTRACT_ENV_NAMES: tuple[str, ...] = (
    ENV_JOB_DIR,
    ENV_RECIPE,
    ENV_COMPONENT,
    ENV_TASK_RANK,
    ENV_BIND_ADDRESS,
    ENV_CAPTURE_HOST,
    ENV_MOONCAKE_MASTER,
    ENV_MOONCAKE_METADATA,
    ENV_MC_TCP_BIND_ADDRESS,
    ENV_MC_TRANSFER_TIMEOUT,
)
"""The variables every component task receives (``ENV_RDMA_DEVICES`` only with RDMA, and
``ENV_REQUEUE_COUNT`` always, but it changes between attempts)."""

# ----------------------------------------------------------------------------------------------
# data plane: keys, fields, the g mapping
# ----------------------------------------------------------------------------------------------

TENSOR_FIELDS: tuple[str, ...] = ("ids", "mask", "hs", "lhs")
"""Tensor fields of one sample, in the order they are written; ``meta`` follows them, last."""
META_FIELD = "meta"
"""The commit marker: a sample exists only once its ``meta`` does."""


def sample_key(store_id: str, g: int, field_name: str) -> str:
    """Store key of one field of sample ``g``: ``{store_id}/s/{g:012d}/{field}``."""
    return f"{store_id}/s/{g:012d}/{field_name}"


def cursor_key(store_id: str) -> str:
    """Store key of the trainer's cursor (first g not consumed by a committed step)."""
    return f"{store_id}/cursor"


def want_key(store_id: str, g: int) -> str:
    """Store key a trainer rank puts to ask the producer for sample ``g`` of a later epoch (with
    ``trainer.feature_cache`` the producer captures later epochs only when asked)."""
    return f"{store_id}/want/{g:012d}"


def heartbeat_key(store_id: str, share: int = 0) -> str:
    """Store key of the producer's heartbeat object (of capture share ``share`` when several
    capture nodes each run a producer; share 0 keeps the plain key)."""
    return f"{store_id}/heartbeat" if share == 0 else f"{store_id}/heartbeat.{share}"


def global_sample_index(
    step: int,
    micro_step: int,
    rank: int,
    index_in_micro_batch: int,
    world_size: int,
    micro_batch_size: int,
    accumulation_steps: int,
) -> int:
    """The fixed map from (optimizer step, micro-step, rank, position in the micro-batch) to g.

    ``g = s*G + (m*world + r)*micro_batch + b`` with ``G = micro_batch * accumulation * world``:
    step ``s`` consumes exactly ``[s*G, (s+1)*G)``, and within a step the samples are dealt to ranks
    round-robin micro-step by micro-step, so every rank's first micro-step is at the front of the
    window (what the producer captures first).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
    if not 0 <= micro_step < accumulation_steps:
        raise ValueError(f"micro_step {micro_step} outside 0..{accumulation_steps - 1}")
    if not 0 <= index_in_micro_batch < micro_batch_size:
        raise ValueError(f"index {index_in_micro_batch} outside 0..{micro_batch_size - 1}")
    global_batch = micro_batch_size * accumulation_steps * world_size
    return step * global_batch + (micro_step * world_size + rank) * micro_batch_size + index_in_micro_batch


def step_sample_indices(
    step: int, rank: int, world_size: int, micro_batch_size: int, accumulation_steps: int
) -> list[int]:
    """The g that ``rank`` consumes in optimizer step ``step``, in micro-step order (the one place
    the trainer and the consumer compute them)."""
    return [
        global_sample_index(step, m, rank, b, world_size, micro_batch_size, accumulation_steps)
        for m in range(accumulation_steps)
        for b in range(micro_batch_size)
    ]


@dataclass
class CapturedSample:
    """One sample as the trainer receives it."""

    g: int
    ids: torch.Tensor
    """int64 [T]"""
    mask: torch.Tensor
    """uint8 [T], 1 on assistant tokens"""
    hs: torch.Tensor
    """bf16 [T, n_aux * H]: aux layer outputs in ``aux_layer_ids`` order"""
    lhs: torch.Tensor
    """bf16 [T, H]: last hidden state after the final norm"""
    meta: dict[str, Any] = field(default_factory=dict)
    """g, epoch, row id, T, H, layer ids, dtypes, shapes, bytes, revision, engine, checksums"""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name, in write order."""
        return {"ids": self.ids, "mask": self.mask, "hs": self.hs, "lhs": self.lhs}


class SampleProducer(Protocol):
    """Producer side of the data plane (the capture component uses only this)."""

    def next_to_capture(self) -> int | None:
        """The next g the window needs, or None while paused (window or byte watermark reached)."""

    def commit(self, g: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Write every tensor field of sample g, then ``meta`` last (idempotent upsert)."""

    def heartbeat(self, stats: dict[str, Any]) -> None:
        """Upsert the producer heartbeat (time, window, rates, errors)."""


class SampleConsumer(Protocol):
    """Consumer side of the data plane (the trainer uses only this)."""

    def fetch(self, g: int, device: torch.device | str | None = None) -> CapturedSample:
        """Wait for sample g (logging what it waits for) and return it, its tensors on ``device``
        (CPU when None); fails after idle_timeout_s."""

    def commit_step(self, step: int) -> None:
        """After optimizer step ``step`` committed: publish the cursor ``(step + 1) * G`` and delete
        the keys this rank consumed in that step."""

    def publish_cursor(self, cursor: int) -> None:
        """Publish the cursor explicitly (a restarted trainer republishes its checkpoint's cursor)."""

    stopping: Callable[[], bool]
    """Set by the trainer: true once it has a stop request (waits on the data plane then give up)."""


# ----------------------------------------------------------------------------------------------
# the sample contract: one definition, one check
# ----------------------------------------------------------------------------------------------

CONTRACT_DTYPES: dict[str, str] = {
    "ids": "int64",
    "mask": "uint8",
    "hs": "bfloat16",
    "lhs": "bfloat16",
}
"""Dtype of every tensor field by its torch name (``getattr(torch, name)``)."""
REQUIRED_META_KEYS: tuple[str, ...] = (
    "g",
    "epoch",
    "row_id",
    "num_tokens",
    "hidden_size",
    "aux_layer_ids",
    "target_revision",
    "engine",
    "fields",
)
"""Keys every sample's ``meta`` carries (the transport adds ``fields``: dtype, shape, bytes, checksums)."""


def dtype_name(dtype: object) -> str:
    """A torch dtype's contract name (``torch.bfloat16`` -> ``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


def contract_shapes(num_tokens: int, num_aux_layers: int, hidden_size: int) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor field of a sample of ``num_tokens`` tokens."""
    return {
        "ids": (num_tokens,),
        "mask": (num_tokens,),
        "hs": (num_tokens, num_aux_layers * hidden_size),
        "lhs": (num_tokens, hidden_size),
    }


def sample_num_tokens(sample: CapturedSample) -> int:
    """T of a sample (-1 when ``ids`` is not one-dimensional)."""
    return int(sample.ids.shape[0]) if sample.ids.ndim == 1 else -1


def field_problems(
    sample: CapturedSample, num_aux_layers: int, hidden_size: int, *, check_dtypes: bool = True
) -> list[str]:
    """Every field of ``sample`` whose dtype (unless ``check_dtypes`` is False) or shape breaks the
    contract, one sentence each."""
    expected = contract_shapes(sample_num_tokens(sample), num_aux_layers, hidden_size)
    problems: list[str] = []
    for name, tensor in sample.tensors().items():
        if check_dtypes and dtype_name(tensor.dtype) != CONTRACT_DTYPES[name]:
            problems.append(
                f"sample g={sample.g}: field {name} has dtype {dtype_name(tensor.dtype)}, expected {CONTRACT_DTYPES[name]}"
            )
        if tuple(tensor.shape) != expected[name]:
            problems.append(
                f"sample g={sample.g}: field {name} has shape {tuple(tensor.shape)}, expected {expected[name]}"
            )
    return problems


def sample_problems(
    sample: CapturedSample, aux_layer_ids: Sequence[int], hidden_size: int, max_length: int
) -> list[str]:
    """Every way ``sample`` breaks the capture contract (empty when it holds): field dtypes and
    shapes, T within ``max_length``, and the meta keys, layer ids and sizes the recipe expects."""
    where = f"sample g={sample.g}"
    tokens = sample_num_tokens(sample)
    problems = field_problems(sample, len(aux_layer_ids), hidden_size)
    if not 1 <= tokens <= max_length:
        problems.append(f"{where}: T={tokens} is outside 1..{max_length} (data.max_length)")
    missing = [key for key in REQUIRED_META_KEYS if key not in sample.meta]
    if missing:
        problems.append(f"{where}: meta lacks {missing}")
    if "aux_layer_ids" in sample.meta and list(sample.meta["aux_layer_ids"]) != list(aux_layer_ids):
        problems.append(
            f"{where}: meta aux_layer_ids {sample.meta['aux_layer_ids']} != capture.aux_layer_ids {list(aux_layer_ids)}"
        )
    if "hidden_size" in sample.meta and sample.meta["hidden_size"] != hidden_size:
        problems.append(f"{where}: meta hidden_size {sample.meta['hidden_size']} != capture.hidden_size {hidden_size}")
    if "num_tokens" in sample.meta and sample.meta["num_tokens"] != tokens:
        problems.append(f"{where}: meta num_tokens {sample.meta['num_tokens']} != T={tokens}")
    return problems


# ----------------------------------------------------------------------------------------------
# smoke gate records: written by the components, read by launcher/gate.py
# ----------------------------------------------------------------------------------------------

CAPTURE_GATE_FILE = "capture_gate.json"
TRAINER_GATE_FILE = "trainer_gate.json"
CaptureStageName = Literal["data", "master", "engine", "capture"]
"""The capture stages of a smoke run, in the order the producer passes them."""


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StageRecord(_Record):
    """One capture stage: passed or not, and what happened."""

    ok: bool
    detail: str


class CaptureGateRecord(_Record):
    """``capture_gate.json``: the capture stages of a smoke run, rewritten after each one."""

    format: Literal["dspark-capture-gate/1"] = "dspark-capture-gate/1"
    stages: dict[CaptureStageName, StageRecord] = Field(default_factory=dict)


class FieldRecord(_Record):
    """Dtype and shape of one tensor field as the trainer received it."""

    dtype: str
    shape: list[int]


class SampleContractRecord(_Record):
    """The capture contract as one trainer rank checked it on every captured sample it received."""

    samples: list[int] = Field(default_factory=list)
    fields: dict[str, FieldRecord] | None = None
    """The first sample's fields."""
    problems: list[str] = Field(default_factory=list)


class RankGateRecord(_Record):
    """One trainer rank's part of the gate."""

    rank: int
    terms_finite: dict[str, bool]
    params_finite_after_update: bool | None = None
    """None until the update was applied and inspected."""
    samples: list[int] = Field(default_factory=list)
    sample_contract: SampleContractRecord = Field(default_factory=SampleContractRecord)


class LossRecord(_Record):
    """The step's loss terms (weighted total and each term)."""

    total: float
    ce: float
    l1: float
    confidence: float


class CheckpointGateRecord(_Record):
    """The smoke step's checkpoint: written, read back, hashed."""

    path: str | None
    weights_sha256: str | None
    reloaded_sha256: str | None
    reload_matches: bool


class TrainerGateRecord(_Record):
    """``trainer_gate.json``: the trainer's smoke step (one update on every rank + checkpoint).

    Written by rank 0 after the step, and on failure too (``passed: false`` with ``problems`` /
    ``error``), so the gate always has a record once the trainer got that far."""

    format: Literal["dspark-trainer-gate/1"] = "dspark-trainer-gate/1"
    passed: bool = False
    step: int | None = None
    """Optimizer steps completed."""
    world_size: int | None = None
    update_finite: bool = False
    """Every rank's terms and the global grad norm were finite."""
    update_applied: bool = False
    """The optimizer applied the update (the guard did not skip it)."""
    grad_norm: float | None = None
    loss: LossRecord | None = None
    ranks: list[RankGateRecord] = Field(default_factory=list)
    problems: list[str] = Field(default_factory=list)
    """What failed, in words (non-finite terms name step, term and ranks)."""
    checkpoint: CheckpointGateRecord | None = None
    export: str | None = None
    """The exported draft folder, once written."""
    error: str | None = None
    """The exception text when the trainer failed before finishing."""


RecordT = TypeVar("RecordT", bound=BaseModel)


def write_record(path: Path, record: BaseModel) -> Path:
    """Write a gate record atomically (NaN stays NaN, as JSON's extension writes it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record.model_dump(mode="python"), indent=2) + "\n", JOB_FOLDER_SETTING)
    return path


def read_record(path: Path, kind: type[RecordT]) -> RecordT | None:
    """Read a gate record back; None when the file does not exist (yet)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return kind.model_validate(json.loads(text))
    except json.JSONDecodeError as exc:
        reason = f"not JSON: {exc}"
    except ValidationError as exc:
        reason = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
    raise ValueError(
        f"{path}: not a valid {kind.__name__} ({reason}); fix: delete it and rerun the smoke job, or check that "
        "the job ran this version of the code"
    )
