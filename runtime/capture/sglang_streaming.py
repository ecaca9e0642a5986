"""Routed experts streamed from host memory inside the patched SGLang server (capture patch version 2).

The capture patch calls two functions of this module, in each TP rank's scheduler process:

1. :func:`expert_weights_device`, around ``FusedMoE.__init__``'s ``quant_method.create_weights``:
   the MoE layers the recipe's split streams get their weights created in host memory, so a target
   larger than the GPUs (Kimi K3 on 8 x H200) never has them all in HBM, not even while loading.
   SGLang's loader already handles parameters that live on the CPU: its post-load step stages a
   module on the GPU for the quant method's repack (``process_weights_after_loading``) and puts
   the results back where the parameters were, so the streamed layers end up in host memory in
   the format the MoE runner reads after its own repack.
2. :func:`attach_expert_streaming`, once the weights are loaded and repacked: every fused-MoE
   module's expert tensors go into one :class:`~runtime.moe.streaming.StreamedExpertStore` (resident
   layers stay where they are, streamed ones are pinned), and forward hooks point the module at
   the device buffer its layer was prefetched into, a copy stream running ``prefetch_layers``
   streamed layers ahead (:mod:`runtime.moe.streaming_modules`, the same hooks the embedded engine
   uses). The kernels read the same bytes, so captures equal the all-resident server's.

The split is decided before the model exists, from the recipe, as ``--plan`` computes it
(:func:`runtime.recipe.fit.expert_streaming.target_streaming_split`: ``capture.routed_expert_weight_bytes`` over
``capture.num_moe_layers`` and ``tp_size``), once per server process by
:func:`runtime.capture.setup.expert_streaming_plan` from the recipe path the patch passes; after loading, the real per-layer bytes are checked
against the GPU budget. Prefill-only: CUDA graphs must be off (the K3 recipe sets
``capture.sglang.disable_cuda_graph``), a graph would replay whatever its buffers last held.

Nothing here imports SGLang: fused-MoE modules are recognised by their shape (``num_local_experts``,
``quant_method`` and tensors whose first dimension is the local expert count).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from runtime.capture.sglang_settings import ExpertStreamingPlan, ExpertStreamingSetupError
from runtime.moe.streaming import StreamedExpertStore
from runtime.recipe.streaming_budget import StreamingBudgetError, StreamingSplit

log = logging.getLogger("dspark.capture.sglang_streaming")


@dataclass
class _ServerStreaming:
    """One server process's streaming plan and how many MoE layers it has created so far."""

    settings: ExpertStreamingPlan
    created: int = 0
    store: StreamedExpertStore | None = None


_PLANS: dict[str, _ServerStreaming | None] = {}


def _plan(recipe_path: str | None) -> _ServerStreaming | None:
    if not recipe_path:
        return None
    if recipe_path not in _PLANS:
        from runtime.capture.setup import expert_streaming_plan

        plan = expert_streaming_plan(recipe_path)
        _PLANS[recipe_path] = None if plan is None else _ServerStreaming(plan)
    return _PLANS[recipe_path]


@contextlib.contextmanager
def expert_weights_device(recipe_path: str | None) -> Iterator[None]:
    """Around one fused-MoE layer's weight creation (layers are created in forward order): host
    memory when the split streams this layer, the loader's device otherwise."""
    plan = _plan(recipe_path)
    if plan is None:
        yield
        return
    index = plan.created
    plan.created += 1
    split = plan.settings.split
    if index >= split.num_layers:
        raise ExpertStreamingSetupError(
            f"the model creates more than {split.num_layers} MoE layers (capture.num_moe_layers, or "
            f"capture.num_target_layers when unset, in {plan.settings.recipe_file}); fix: set capture.num_moe_layers to "
            "the target's number of MoE layers"
        )
    if split.resident[index]:
        yield
        return
    with torch.device("cpu"):
        yield


def sglang_expert_weights(module: nn.Module) -> tuple[str, ...] | None:
    """The tensors a fused-MoE module's kernel reads per expert (after the quant method's repack):
    every parameter and buffer whose first dimension is the module's local expert count."""
    experts = getattr(module, "num_local_experts", None)
    if not isinstance(experts, int) or experts < 1 or not hasattr(module, "quant_method"):
        return None
    tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
    names = tuple(name for name, t in tensors if t is not None and t.dim() >= 1 and t.shape[0] == experts)
    return names or None


def attach_expert_streaming(
    model: nn.Module, recipe_path: str | None, device: torch.device | str
) -> StreamedExpertStore | None:
    """After loading: stream the host-resident MoE layers into ``device`` (see the module docstring).
    Returns the store (None when the recipe does not stream experts)."""
    from runtime.moe.streaming_modules import find_expert_modules, stream_experts

    plan = _plan(recipe_path)
    if plan is None:
        return None
    if plan.store is not None:
        return plan.store
    found = find_expert_modules(model, sglang_expert_weights)
    split = plan.settings.split
    if len(found) != split.num_layers or plan.created != split.num_layers:
        raise ExpertStreamingSetupError(
            f"the server built {plan.created} MoE layers ({len(found)} with expert weights), the streaming split "
            f"of {plan.settings.recipe_file} is for {split.num_layers}; fix: set capture.num_moe_layers: {len(found)}"
        )
    layer_bytes = max(
        sum(t.numel() * t.element_size() for name, t in _tensors(module, names)) for _, module, names in found
    )
    budget = plan.settings.gpu_budget_bytes
    needed = (split.resident_layers + split.num_buffers) * layer_bytes
    if plan.settings.layer_bytes_known and budget is not None and needed > budget:
        raise StreamingBudgetError(
            f"capture.expert_streaming.gpu_budget_bytes is {budget} B per GPU, but the loaded MoE layers hold "
            f"{layer_bytes} B of experts each (the recipe's capture.routed_expert_weight_bytes gave "
            f"{split.layer_bytes} B): {split.resident_layers} resident + {split.num_buffers} buffers need "
            f"{needed} B; fix: correct capture.routed_expert_weight_bytes to the repacked size, or raise the budget"
        )
    actual = StreamingSplit(split.num_layers, layer_bytes, split.resident, split.num_buffers)
    store = stream_experts(model, device, pinned=plan.settings.pinned, weight_names=sglang_expert_weights, split=actual)
    plan.store = store
    log.info("%s", store.describe())
    return store


def _tensors(module: nn.Module, names: tuple[str, ...]) -> list[tuple[str, torch.Tensor]]:
    return [(name, getattr(module, name)) for name in names]
