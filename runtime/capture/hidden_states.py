"""Run a Hugging Face decoder on a padded batch and pull out what DSpark needs.

- ``hs``: the outputs of the decoder layers in ``aux_layer_ids``, concatenated in that order. Layer
  id ``i`` is the output of decoder layer ``i`` (HF ``hidden_states[i + 1]``): the full residual
  stream at that layer boundary. They are taken by forward hooks on those layers only, so no other
  layer's output is kept alive.
- ``lhs``: the final hidden state after the final norm (what the lm_head would read), i.e. the base
  model's ``last_hidden_state``. The lm_head itself never runs: for a large vocabulary it would be
  the most expensive matmul of the forward and nobody needs its logits.

Samples are right-padded into one batch with an attention mask. Positions are ``0..T-1`` for every
sample (what an unpadded forward uses) and a causal model never lets a real token see the padding
after it, so each sample's features are those of its own forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

CONTRACT_FEATURE_DTYPE = torch.bfloat16
"""Stored dtype of ``hs`` and ``lhs``."""


@dataclass
class SampleFeatures:
    """Captured features of one sample, in the forward's dtype and on its device."""

    hs: torch.Tensor
    """[T, n_aux * H]"""
    lhs: torch.Tensor
    """[T, H]"""

    @property
    def num_tokens(self) -> int:
        """T."""
        return int(self.lhs.shape[0])


def decoder_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, Sequence[torch.nn.Module]]:
    """The base decoder (embeddings, layers, final norm) of a CausalLM or base model, and its layers."""
    base = model
    if not hasattr(base, "layers"):
        getter = getattr(model, "get_decoder", None)
        base = getter() if callable(getter) else getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None or not hasattr(base, "norm"):
        raise TypeError(
            f"{type(model).__name__}: cannot find the decoder layers and final norm (expected a base model with "
            "'.layers' and '.norm', as Llama/Qwen-style transformers models have)"
        )
    return base, layers


class HiddenStateCapture:
    """Aux-layer outputs and post-norm last hidden states of a padded batch, one model, one device."""

    def __init__(self, model: torch.nn.Module, aux_layer_ids: Sequence[int], pad_id: int = 0) -> None:
        self.base, layers = decoder_parts(model)
        last = len(layers) - 1
        for layer_id in aux_layer_ids:
            if not 0 <= layer_id < last:
                raise ValueError(
                    f"capture.aux_layer_ids contains {layer_id}; the target has decoder layers 0..{last} and the "
                    f"last one ({last}) is not allowed (lhs carries its output after the final norm)"
                )
        self.aux_layer_ids = list(aux_layer_ids)
        self.pad_id = pad_id
        self.device = next(self.base.parameters()).device
        self.dtype = next(self.base.parameters()).dtype
        self.hidden_size = int(self.base.norm.weight.shape[-1])
        self._layers = layers
        self._outputs: dict[int, torch.Tensor] = {}
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in sorted(set(self.aux_layer_ids))]

    def _hook(self, layer_id: int) -> Any:
        def keep(module: torch.nn.Module, args: Any, output: Any) -> None:
            # Decoder layers return the new residual stream, alone or first in a tuple.
            self._outputs[layer_id] = output[0] if isinstance(output, tuple) else output

        return keep

    def pad(self, sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Right-padded ``[B, T_max]`` input ids on the model's device, and the attention mask there
        when some sample is shorter than the batch (None without padding: an all-ones mask changes
        nothing but can steer attention kernels away from their fast causal path). Decided from the
        lengths on the host: testing the mask on the device would wait for all queued GPU work."""
        if not sequences or any(len(s) == 0 for s in sequences):
            raise ValueError("every sample of a capture batch needs at least one token")
        width = max(len(s) for s in sequences)
        # Through numpy: several times faster than torch.tensor on a tuple of Python ints, and
        # the GPU waits for this host work between two forwards.
        ids = np.full((len(sequences), width), self.pad_id, dtype=np.int64)
        attention = np.zeros((len(sequences), width), dtype=np.int64)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence)] = np.fromiter(sequence, dtype=np.int64, count=len(sequence))
            attention[row, : len(sequence)] = 1
        padded = any(len(s) != width for s in sequences)
        on_device = torch.from_numpy(ids).to(self.device, non_blocking=True)
        mask = torch.from_numpy(attention).to(self.device, non_blocking=True) if padded else None
        return on_device, mask

    @torch.no_grad()
    def forward(self, sequences: Sequence[Sequence[int]]) -> list[SampleFeatures]:
        """Features of every sample (compute dtype, model device), one padded forward. (no_grad rather
        than inference_mode: the returned tensors are ordinary tensors a caller may use anywhere.)"""
        ids, mask = self.pad(sequences)
        self._outputs.clear()
        try:
            output = self.base(input_ids=ids, attention_mask=mask, use_cache=False)
            last = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            aux = [self._outputs[i] for i in self.aux_layer_ids]
        finally:
            self._outputs.clear()
        stacked = torch.cat(aux, dim=-1)  # [B, T_max, n_aux * H], one copy
        return [
            SampleFeatures(hs=stacked[row, : len(sequence)], lhs=last[row, : len(sequence)])
            for row, sequence in enumerate(sequences)
        ]

    def close(self) -> None:
        """Remove the hooks (the model is usable as before)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def to_contract_dtype(features: SampleFeatures) -> SampleFeatures:
    """``hs`` / ``lhs`` as the contract stores them (bf16, contiguous, same device)."""
    return SampleFeatures(
        hs=features.hs.to(CONTRACT_FEATURE_DTYPE).contiguous(),
        lhs=features.lhs.to(CONTRACT_FEATURE_DTYPE).contiguous(),
    )
