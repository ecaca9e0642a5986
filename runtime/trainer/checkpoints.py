"""Checkpoints.

Layout of ``checkpoint_dir``::

    step_00000008/            one complete checkpoint
        dcp/                  torch.distributed.checkpoint: {"model": ..., "optim": ...}, sharded
        trainer_state.json    step, cursor, epoch, schedule, RNG, digests, world size, weights hash,
                              and the size and SHA-256 of every dcp/ file
        trainer_state.json.sha256   the state file's own SHA-256 (runtime/shared/checkpoint_integrity.py)
    latest -> step_00000008   symlink to the newest complete checkpoint
    .tmp-step_00000016/       a save in progress (renamed when complete; stale ones are removed)

A checkpoint is complete once its folder has its final name, and it gets that name only after
every rank finished writing and ``trainer_state.json`` is in place: a crash mid-save leaves a
``.tmp-*`` folder and the previous checkpoints untouched. After each save the newest ``keep_last``
complete checkpoints are kept and older ones removed.

Starting (see :func:`plan_start`): ``resume_from`` (a path or ``auto``) restores everything;
``init_from`` restores the weights only. A trainer restarted inside the same job (Slurm requeue,
preemption) finds its own newest checkpoint in ``checkpoint_dir`` and resumes from it even when
the resolved recipe names neither.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from runtime.files import atomic_write_text, is_disk_full
from runtime.shared import checkpoint_integrity
from runtime.shared.checkpoint_folders import (
    LATEST,
    SEQUENTIAL_HASH_SCHEME,
    STATE_FILE,
    STEP_PREFIX,
    complete_checkpoints,
    find_latest,
    is_complete,
    step_dir_name,
)
from runtime.trainer.distributed import barrier, gather_objects
from runtime.trainer.state_hash import HASH_SCHEME, KNOWN_HASH_SCHEMES, state_dict_sha256
from runtime.user_errors import UserError

STATE_FORMAT = "dspark-trainer-state/1"
WRITE_THREADS = 4
"""Files each rank writes at once (DCP's ``thread_count``): one writer thread wrote the K3 draft's
25 GiB at 0.49 GB/s on the H200 host, a plain write of the same bytes ran at 1.85 GB/s."""
DCP_DIR = "dcp"
TMP_PREFIX = ".tmp-"

log = logging.getLogger("dspark.trainer.checkpoints")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used; the message names both values and the fix."""


def resolve_checkpoint_path(value: str, checkpoint_dir: Path, field: str) -> Path:
    """A ``resume_from``/``init_from`` value as a complete checkpoint folder.

    Accepts ``auto`` (newest in ``checkpoint_dir``), a checkpoint folder, or a folder of checkpoints
    (its newest). Raises :class:`CheckpointError` naming ``field`` when nothing usable is there.
    """
    if value == "auto":
        found = find_latest(checkpoint_dir)
        if found is None:
            raise CheckpointError(f"{field} is 'auto' but {checkpoint_dir} holds no complete checkpoint")
        return found
    path = Path(os.path.expandvars(os.path.expanduser(value)))
    if is_complete(path):
        return path
    if path.is_dir():
        found = find_latest(path)
        if found is not None:
            return found
    raise CheckpointError(
        f"{field} is {value!r}: no complete checkpoint there (a folder named {STEP_PREFIX}NNNNNNNN with "
        f"{STATE_FILE}, or a folder holding such checkpoints); fix: point {field} at one"
    )


def read_state(path: Path) -> dict[str, Any]:
    """``trainer_state.json`` of a checkpoint; a broken one is a :class:`CheckpointError` naming it."""
    state_file = path / STATE_FILE
    try:
        state = json.loads(state_file.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{state_file} is unreadable ({exc}); this checkpoint cannot be used. Fix: resume from an older "
            f"checkpoint ({_older_hint(path)}), or move {path} away"
        ) from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{state_file}: format {found!r}, expected {STATE_FORMAT!r}")
    return state


def _older_hint(path: Path) -> str:
    older = [p.name for p in complete_checkpoints(path.parent) if p.name < path.name]
    return f"older ones here: {', '.join(older)}" if older else f"none older in {path.parent}"


def shared_file_digests(folder: Path) -> dict[str, dict[str, Any]]:
    """:func:`file_digests` of ``folder`` with the reading shared by every rank (collective, after the
    files are on disk): the files, largest first, go to the rank with the fewest bytes so far, and
    every rank gets the whole table. At K3 size rank 0 alone read 25 GiB back at a stop."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return file_digests(folder)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    files = sorted((p for p in folder.rglob("*") if p.is_file()), key=lambda p: (-p.stat().st_size, str(p)))
    loads = [0] * world
    mine = []
    for file in files:
        owner = loads.index(min(loads))
        loads[owner] += file.stat().st_size
        if owner == rank:
            mine.append(file)
    own = checkpoint_integrity.digests_of(folder, mine)
    table: dict[str, dict[str, Any]] = {}
    for part in gather_objects(own, world):
        table.update(part)
    return dict(sorted(table.items()))


def file_digests(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file under ``folder``, by relative path, on several threads
    (:func:`runtime.shared.checkpoint_integrity.file_digests`)."""
    return checkpoint_integrity.file_digests(folder)


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check that checkpoint ``path`` is whole and return its state (rank 0 does this; see the loop):
    ``trainer_state.json`` against its seal, every ``dcp/`` file against the state's records (see
    runtime/shared/checkpoint_integrity.py). A refusal is a :class:`CheckpointError` naming the file and
    the previous checkpoint; a legacy checkpoint (from before the seal) is accepted with one log line."""
    try:
        checkpoint_integrity.verify_whole(path, "resume", note=lambda line: print(f"[trainer] {line}", flush=True))
    except checkpoint_integrity.CheckpointIntegrityError as exc:
        raise CheckpointError(str(exc)) from None
    return read_state(path)


# ----------------------------------------------------------------------------------------------
# RNG
# ----------------------------------------------------------------------------------------------


def rng_state() -> dict[str, str | None]:
    """This rank's torch RNG states, base64."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "cuda": base64.b64encode(cuda.numpy().tobytes()).decode() if cuda is not None else None,
    }


def restore_rng(state: dict[str, str | None]) -> None:
    """Restore what :func:`rng_state` recorded."""
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"] or "")), dtype=torch.uint8))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"] or "")), dtype=torch.uint8))


# ----------------------------------------------------------------------------------------------
# hashing
# ----------------------------------------------------------------------------------------------


def flat_tensors(nested: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor of a nested state dict (optimizer state), keyed by its dotted path."""
    if isinstance(nested, torch.Tensor):
        return {prefix: nested}
    items = nested.items() if isinstance(nested, dict) else enumerate(nested) if isinstance(nested, list) else ()
    found: dict[str, Any] = {}
    for key, value in items:
        found.update(flat_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


def optimizer_sha256(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheme: str = HASH_SCHEME) -> str:
    """SHA-256 of the optimizer state (moments and step counts; collective like the weights hash)."""
    return state_dict_sha256(flat_tensors(get_state_dict(model, optimizer)[1]), scheme)


def model_sha256(model: torch.nn.Module, scheme: str = HASH_SCHEME) -> str:
    """SHA-256 of the model's (fp32 master) weights."""
    return state_dict_sha256(get_model_state_dict(model), scheme)


# ----------------------------------------------------------------------------------------------
# save / load
# ----------------------------------------------------------------------------------------------


@dataclass
class SavedCheckpoint:
    """What :func:`save_checkpoint` wrote."""

    path: Path
    weights_sha256: str
    phase_s: dict[str, float] = field(default_factory=dict)
    """This rank's seconds in each part of the save, in order (:data:`SAVE_PHASES`); they add up to the
    whole save, less the first barrier."""


SAVE_PHASES = (
    "state dict + DCP write",
    "file digests (read back)",
    "weights hash",
    "optimizer hash",
    "state file + rename",
)
"""The parts of :func:`save_checkpoint`, in the order it does them."""


def save_checkpoint(
    checkpoint_dir: Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    rng_states: list[dict[str, Any]],
    keep_last: int,
    is_main: bool,
) -> SavedCheckpoint:
    """Write checkpoint ``step`` (collective: every rank calls it). ``state`` is the trainer state
    (without RNG and hash, which this adds); ``rng_states`` holds every rank's, gathered."""
    final = checkpoint_dir / step_dir_name(step)
    tmp = checkpoint_dir / f"{TMP_PREFIX}{step_dir_name(step)}"
    try:
        if is_main:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
            for stale in checkpoint_dir.glob(f"{TMP_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        barrier()
        phase_s: dict[str, float] = {}
        clock = time.perf_counter()

        def phase_done(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            phase_s[name] = now - clock
            clock = now

        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save(
            {"model": model_state, "optim": optim_state},
            storage_writer=FileSystemWriter(tmp / DCP_DIR, thread_count=WRITE_THREADS),
        )
        barrier()  # every rank's files and the metadata are on disk
        phase_done(SAVE_PHASES[0])
        # read back from disk, each rank a share: a resume checks these before it trusts a byte
        files = shared_file_digests(tmp / DCP_DIR)
        phase_done(SAVE_PHASES[1])
        weights_hash = state_dict_sha256(model_state)
        phase_done(SAVE_PHASES[2])
        optim_hash = state_dict_sha256(flat_tensors(optim_state))
        phase_done(SAVE_PHASES[3])
        if is_main:
            payload = {
                "format": STATE_FORMAT,
                **state,
                "rng": rng_states,
                "weights_sha256": weights_hash,
                "optimizer_sha256": optim_hash,
                "hash_scheme": HASH_SCHEME,
                "files": files,
                "saved_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "torch_version": torch.__version__,
            }
            text, _ = checkpoint_integrity.seal_json(payload)
            atomic_write_text(tmp / STATE_FILE, text)
            checkpoint_integrity.write_seal(tmp, text.encode())  # the state's own hash: an edit is refused
            if final.exists():  # the same step saved again after a restart: replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            _point_latest(checkpoint_dir, final.name)
            _prune(checkpoint_dir, keep_last)
        barrier()
        phase_done(SAVE_PHASES[4])
    except (OSError, RuntimeError, CheckpointException) as exc:
        # torch.save on a full disk may fail as "unexpected pos" rather than ENOSPC: judge by the space
        tensors = flat_tensors(dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True)))
        need = max(
            sum(t.numel() * t.element_size() for t in tensors.values()),
            _size_of(complete_checkpoints(checkpoint_dir)[-1:]),
        )
        shutil.rmtree(tmp, ignore_errors=True)  # no half-written checkpoint left behind
        free = shutil.disk_usage(checkpoint_dir).free if checkpoint_dir.exists() else 0
        if not (_is_disk_full(exc) or free < need):
            raise
        message = (
            f"disk full at {checkpoint_dir} while saving {final.name}: need about {need} bytes, {free} free; "
            "the previous checkpoints are intact. Fix: free space there, or set "
            "trainer.checkpoint.dir to a larger filesystem (and lower trainer.checkpoint.keep_last)"
        )
        raise CheckpointError(message) from None  # said once, by the trainer's refusal (runtime/shared/refusal.py)
    return SavedCheckpoint(path=final, weights_sha256=weights_hash, phase_s=phase_s)


def _is_disk_full(exc: BaseException) -> bool:
    # DCP wraps each rank's failure in a CheckpointException (a BaseException) with the cause's text
    return is_disk_full(exc) or ("No space left on device" in str(exc) or "Disk quota exceeded" in str(exc))


def _size_of(paths: list[Path]) -> int:
    return sum(f.stat().st_size for p in paths for f in p.rglob("*") if f.is_file())


def _point_latest(checkpoint_dir: Path, name: str) -> None:
    link = checkpoint_dir / LATEST
    tmp = checkpoint_dir / f"{TMP_PREFIX}{LATEST}{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(name, tmp)
    os.replace(tmp, link)


def _prune(checkpoint_dir: Path, keep_last: int) -> None:
    removed = []
    for old in complete_checkpoints(checkpoint_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
        removed.append(old.name)
    if removed:
        # A checkpoint the log announced earlier must not vanish without a word.
        log.info("removed %s (trainer.checkpoint.keep_last is %d)", ", ".join(removed), keep_last)


def _dcp_load(bundle: dict[str, Any], path: Path) -> None:
    try:
        # One process without a process group (the evaluation) loads the checkpoint whole, as meant:
        # DCP warns that it assumes so even when told (no_dist), so that one warning is filtered here.
        single = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is .*single process", category=UserWarning)
            dcp.load(bundle, checkpoint_id=str(path / DCP_DIR), no_dist=single)
    except (Exception, CheckpointException) as exc:  # DCP wraps per-rank failures (a BaseException)
        cause = str(exc).strip().splitlines()
        detail = next((line for line in cause if "size" in line or "shape" in line or "Missing" in line), "")
        raise CheckpointError(
            f"cannot load {path / DCP_DIR}: {detail or (cause[-1] if cause else type(exc).__name__)}. The checkpoint "
            "does not match this draft (trainer.draft differs from the run that wrote it) or its files are "
            "damaged. Fix: resume with the trainer.draft settings it was written with, or start from another "
            "checkpoint"
        ) from exc


def load_full(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Restore model and optimizer from checkpoint ``path`` (collective), then check that what was
    loaded hashes to what ``state`` recorded at save time (weights, and optimizer state when recorded)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    bundle = {"model": model_state, "optim": optim_state}
    _dcp_load(bundle, path)
    set_state_dict(model, optimizer, model_state_dict=bundle["model"], optim_state_dict=bundle["optim"])
    scheme = state.get("hash_scheme", SEQUENTIAL_HASH_SCHEME)
    if scheme not in KNOWN_HASH_SCHEMES:
        raise CheckpointError(
            f"{path / STATE_FILE}: hash_scheme {scheme!r} is not one this trainer knows "
            f"({', '.join(KNOWN_HASH_SCHEMES)}): a newer checkout wrote it. Fix: resume with that checkout, or "
            f"from an older checkpoint ({_older_hint(path)})"
        )
    checks = [("weights", model_sha256(model, scheme), state.get("weights_sha256"))]
    if state.get("optimizer_sha256"):
        checks.append(("optimizer state", optimizer_sha256(model, optimizer, scheme), state["optimizer_sha256"]))
    for what, loaded, recorded in checks:
        if recorded and loaded != recorded:
            raise CheckpointError(
                f"checkpoint {path}: the loaded {what} hash to sha256 {loaded}, but {path / STATE_FILE} recorded "
                f"{recorded}; the checkpoint is corrupt. Fix: resume from an older checkpoint ({_older_hint(path)})"
            )


def load_weights(path: Path, model: torch.nn.Module) -> None:
    """Restore the model's weights only, from one of our checkpoints or from an exported
    safetensors draft (collective)."""
    if is_complete(path):
        model_state = get_model_state_dict(model)
        bundle = {"model": model_state}
        _dcp_load(bundle, path)
        set_model_state_dict(model, bundle["model"])
        return
    from runtime.trainer.export import read_exported_weights

    template = get_model_state_dict(model)
    full = read_exported_weights(path, expected=set(template))
    wrong = [
        f"{name} {tuple(full[name].shape)} (this draft: {tuple(tensor.shape)})"
        for name, tensor in template.items()
        if tuple(full[name].shape) != tuple(tensor.shape)
    ]
    if wrong:
        raise CheckpointError(
            f"trainer.checkpoint.init_from {path}: tensor shapes differ from this recipe's draft: {', '.join(wrong[:4])}"
            f"{'...' if len(wrong) > 4 else ''}; fix: warm-start from a draft with the recipe's trainer.draft settings"
        )
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))


def loaded_weights_sha256(path: Path, model: torch.nn.Module) -> str:
    """Hash of the weights stored in checkpoint ``path``, read back into fresh zeroed tensors laid out
    like ``model``'s (collective; the live model is not touched)."""
    template = get_model_state_dict(model)
    fresh = {name: torch.zeros_like(tensor) for name, tensor in template.items()}
    bundle = {"model": fresh}
    dcp.load(bundle, checkpoint_id=str(path / DCP_DIR))
    return state_dict_sha256(bundle["model"], read_state(path).get("hash_scheme", SEQUENTIAL_HASH_SCHEME))
