"""The evaluation's settings: what each of its parts takes, built once by :mod:`runtime.evaluate.setup`.

Frozen, and free of the recipe: the parts below the entries take these, never the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.capture.sglang_settings import SGLangServerSettings
from runtime.trainer.draft_spec import DraftSpec


@dataclass(frozen=True)
class EvalSetFile:
    """One eval set (``eval.sets[index]``), its path resolved."""

    name: str
    index: int
    """Its place in ``eval.sets`` (messages name the field by it)."""
    path: Path
    sha256: str
    """The SHA-256 the recipe pins the file to."""
    max_prompts: int | None
    """Only the first this many prompts (None: all)."""


@dataclass(frozen=True)
class TargetSettings:
    """The target model the drafts are judged against."""

    path: Path
    """``capture.target_path``, resolved."""
    compute_dtype: str
    """``capture.compute_dtype``: the torch dtype's name (``bfloat16``, ``float32``)."""
    aux_layer_ids: tuple[int, ...]
    """``capture.aux_layer_ids``: the layers whose hidden states the drafts read."""
    vocab_size: int
    hidden_size: int
    embed_tensor_name: str
    """``trainer.embed_tensor_name``: the frozen embedding every draft shares."""
    lm_head_tensor_name: str
    """``trainer.lm_head_tensor_name``: the frozen lm_head every draft shares."""


@dataclass(frozen=True)
class TeacherForcing:
    """How the teacher-forced ``tau`` lays out its blocks (the trainer's objective, every anchor)."""

    loss_decay_gamma: float
    """``trainer.loss.loss_decay_gamma``."""
    chunk_blocks: int
    """``trainer.loss.objective_chunk_blocks``: blocks per chunk of the objective."""
    anchor_seed: int
    """``trainer.seed``: seeds the anchor generator of each sequence."""


@dataclass(frozen=True)
class EvalSettings:
    """The eval section to run (the job's, or ``--eval-recipe``'s, with ``--set`` applied)."""

    sets: tuple[EvalSetFile, ...]
    """The chosen eval sets, in the recipe's order."""
    max_new_tokens: int
    temperatures: tuple[float, ...]
    stop_ids: frozenset[int]
    """``capture.special_tokens.eos_id`` and ``eval.stop_token_ids``: tokens that end a generation."""
    batch_size: int
    """Prompts in flight at once on the SGLang route."""
    seed: int
    device: str
    """``auto``, ``cpu`` or ``cuda``: where the embedded route decodes."""
    compare_untrained: bool
    route: str
    """``embedded`` or ``sglang`` (``eval.route: auto`` is the capture engine's)."""
    sglang_verify_mode: str
    request_timeout_s: float
    checkpoint_prompts: int
    """Prompts of the first set decoded with each checkpoint during training (0: off)."""


@dataclass(frozen=True)
class EvalSetup:
    """Everything the evaluation takes from the resolved recipe, built once by
    :func:`runtime.evaluate.setup.eval_setup`."""

    job_dir: Path
    recipe_file: Path
    """The resolved recipe (named in messages)."""
    recipe_digest: str
    checkpoint_dir: Path
    """Where the run's trainer keeps its checkpoints."""
    target: TargetSettings
    draft: DraftSpec
    """The draft's shape (an exported draft's own architecture replaces ``draft.draft``)."""
    eval: EvalSettings
    teacher_forcing: TeacherForcing
    sglang: SGLangServerSettings
    """The SGLang server of the SGLang route (the capture server's shape)."""
