"""Attach a :class:`~runtime.moe.streaming.StreamedExpertStore` to a model's routed-expert modules.

The expert modules keep computing exactly as before; only where their weight tensors live
changes. :func:`stream_experts` takes each expert module's weights out of the module (so moving
the model no longer moves them), hands them to one store, and wraps the module's forward with
hooks: right before it runs, its weight attributes are pointed at the tensors the store returns
(resident, or the device buffer the layer was streamed into); right after, they are released (and
the attributes cleared, so nothing can read a buffer the next layer is being copied into). The
same bytes reach the same kernels, so the outputs equal the all-resident model's bit for bit.

Known expert modules, in the kernel's format:

- Hugging Face fused experts (``Qwen3MoeExperts`` and kin): ``gate_up_proj``, ``down_proj``;
- :class:`~runtime.moe.experts.LocalExperts` (the expert-parallel layer's experts): ``gate_up``,
  ``down`` in the compute dtype, or packed MXFP4 ``gate_up_blocks``, ``gate_up_scales``,
  ``down_blocks``, ``down_scales`` for the dequant-once grouped GEMM.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from runtime.moe.experts import LocalExperts
from runtime.moe.streaming import StreamedExpertStore
from runtime.recipe.streaming_budget import StreamingSplit, split_layers

HF_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
DENSE_LOCAL_WEIGHTS = ("gate_up", "down")
MXFP4_LOCAL_WEIGHTS = ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales")


def expert_weight_names(module: nn.Module) -> tuple[str, ...] | None:
    """Names of ``module``'s routed-expert weight tensors, or None if it is not an expert module."""
    if isinstance(module, LocalExperts):
        return MXFP4_LOCAL_WEIGHTS if module.quantized else DENSE_LOCAL_WEIGHTS
    if all(isinstance(getattr(module, name, None), torch.Tensor) for name in HF_EXPERT_WEIGHTS):
        return HF_EXPERT_WEIGHTS
    return None


WeightNames = Callable[[nn.Module], "tuple[str, ...] | None"]
"""Which tensors of a module are its routed-expert weights (None: not an expert module)."""


def find_expert_modules(
    model: nn.Module, weight_names: WeightNames = expert_weight_names
) -> list[tuple[str, nn.Module, tuple[str, ...]]]:
    """Every routed-expert module of ``model`` in registration order (= forward order for a
    decoder stack), with its weight names. ``weight_names`` recognises other layouts (a serving
    engine's fused-MoE layer after its own repack: every tensor its kernel reads)."""
    found = []
    for name, module in model.named_modules():
        names = weight_names(module)
        if names is not None:
            found.append((name, module, names))
    return found


def _take(module: nn.Module, name: str) -> torch.Tensor:
    """Remove weight ``name`` from ``module`` (parameter or buffer) and return its tensor."""
    if name in module._parameters:
        tensor = module._parameters.pop(name)
    elif name in module._buffers:
        tensor = module._buffers.pop(name)
    else:
        raise ValueError(f"{type(module).__name__} has no parameter or buffer {name!r}")
    assert tensor is not None
    return tensor.detach()


def _point_at(module: nn.Module, weights: dict[str, torch.Tensor] | None, names: tuple[str, ...]) -> None:
    for name in names:
        setattr(module, name, None if weights is None else weights[name])


def _before(store: StreamedExpertStore, layer: int, names: tuple[str, ...], module: nn.Module, args: object) -> None:
    _point_at(module, store.acquire(layer), names)


def _after(
    store: StreamedExpertStore, layer: int, names: tuple[str, ...], module: nn.Module, args: object, output: object
) -> None:
    store.release(layer)
    _point_at(module, None, names)


def stream_experts(
    model: nn.Module,
    device: torch.device | str,
    *,
    prefetch_layers: int = 1,
    gpu_budget_bytes: int | None = None,
    resident_fraction: float | None = None,
    pinned: bool = True,
    budget_field: str = "capture.expert_streaming.gpu_budget_bytes",
    weight_names: WeightNames = expert_weight_names,
    split: StreamingSplit | None = None,
) -> StreamedExpertStore:
    """Move the routed experts of ``model`` into one streamed store on ``device`` (in place).

    The split between resident and streamed layers comes from ``gpu_budget_bytes`` or
    ``resident_fraction`` (see :func:`~runtime.recipe.streaming_budget.split_layers`); a budget too
    small for the streaming buffers is refused with both numbers. ``split``: a split decided
    before the model was built (a serving engine creates the streamed layers' weights in host
    memory from the start); it must cover every expert module. Returns the store (its
    ``describe()`` is the log line, its ``stats`` the copy counters).
    """
    found = find_expert_modules(model, weight_names)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no routed-expert module (fused gate_up_proj/down_proj experts or "
            "runtime.moe LocalExperts); fix: set capture.expert_streaming.enabled: false for this target"
        )
    if split is not None and split.num_layers != len(found):
        raise ValueError(
            f"the expert-streaming split is for {split.num_layers} MoE layers, but {type(model).__name__} has "
            f"{len(found)} routed-expert modules; fix: set capture.num_moe_layers: {len(found)}"
        )
    layers = [{name: _take(module, name) for name in names} for _, module, names in found]
    if split is None:
        layer_bytes = max(sum(t.numel() * t.element_size() for t in weights.values()) for weights in layers)
        split = split_layers(
            len(layers),
            layer_bytes,
            prefetch_layers=prefetch_layers,
            gpu_budget_bytes=gpu_budget_bytes,
            resident_fraction=resident_fraction,
            budget_field=budget_field,
        )
    store = StreamedExpertStore(layers, split, device, pinned=pinned, release_sources=True)
    del layers
    for index, (_, module, names) in enumerate(found):
        _point_at(module, None, names)
        module.register_forward_pre_hook(partial(_before, store, index, names))
        module.register_forward_hook(partial(_after, store, index, names), always_call=True)
    return store
