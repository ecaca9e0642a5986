"""The SGLang server's settings, built once from the recipe by :mod:`runtime.capture.setup`.

:class:`SGLangServerSettings` is what :class:`~runtime.capture.engine_sglang.SGLangEngine` and its
command line take (the capture's engine, and the evaluation's SGLang route); :class:`ExpertStreamingPlan`
is what the server's expert streaming (:mod:`runtime.capture.sglang_streaming`) takes inside the
server's own processes. Light: no torch, no SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.recipe.schema import SGLangSettings
from runtime.recipe.streaming_budget import StreamingSplit


@dataclass(frozen=True)
class SGLangServerSettings:
    """One SGLang server of the target: how it is launched, reached and asked to capture."""

    sglang: SGLangSettings
    """``capture.sglang``: address, parallelism, memory, backends, timeouts, environment."""
    target_path: Path
    """``capture.target_path``, resolved: the model the server loads."""
    python: str | None
    """``capture.sglang.python``, resolved: the server's interpreter (None: this one)."""
    library_dirs: tuple[Path, ...]
    """``capture.sglang.library_dirs``, resolved: put in front of the server's LD_LIBRARY_PATH."""
    recipe_file: Path
    """The resolved recipe the server's capture sink reads (``--dspark-capture-recipe``)."""
    server_log_path: Path
    """Where the server logs unless the caller names another file."""
    nodes_per_engine: int
    """Nodes one server spans (several capture shares: one server per node)."""
    aux_layer_ids: tuple[int, ...]
    """``capture.aux_layer_ids``: the layer outputs the server returns."""
    hidden_size: int
    """``capture.hidden_size``."""
    store_id: str
    """The store the server's sink commits to (each capture ticket names it)."""


class ExpertStreamingSetupError(RuntimeError):
    """The server's MoE layers do not match what the recipe's streaming split was made for."""


@dataclass(frozen=True)
class ExpertStreamingPlan:
    """The per-GPU streaming split of the server's MoE layers (``capture.expert_streaming`` on)."""

    recipe_file: Path
    """The resolved recipe the split comes from (named in refusals)."""
    split: StreamingSplit
    layer_bytes_known: bool
    """Whether ``split.layer_bytes`` comes from the recipe's stated sizes (else a placeholder)."""
    gpu_budget_bytes: int | None
    """``capture.expert_streaming.gpu_budget_bytes``: checked against the loaded layers' real size."""
    pinned: bool
    """``capture.expert_streaming.pinned``: the streamed layers' host memory is pinned."""
