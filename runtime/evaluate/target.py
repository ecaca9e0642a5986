"""The target as a speculative decoder needs it: one sequence, a KV cache kept across verify steps.

:meth:`TargetDecoder.start` prefills the prompt; :meth:`TargetDecoder.extend` runs the next tokens
(a verify block of ``block_size + 1``, or one token for plain decoding) on top of the cache;
:meth:`TargetDecoder.rollback` cuts the cache back to the accepted prefix. So a verify step costs one
forward over ``block_size + 1`` tokens, never a re-prefill.

Every forward also returns the aux-layer outputs (forward hooks on those decoder layers, as capture
takes them: layer ``i`` is ``hidden_states[i + 1]``) of the tokens it ran: the draft's context is the
aux hidden states of the accepted prefix. :meth:`TargetDecoder.features` runs one full forward
without the cache for the teacher-forced figures (aux states and the post-norm last hidden state).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.capture.hidden_states import SampleFeatures, decoder_parts
from runtime.user_errors import UserError

log = logging.getLogger("dspark.evaluate.target")


class TargetLoadError(UserError, RuntimeError):
    """The target cannot be loaded for evaluation; the message names the path and the fix."""


@dataclass
class TargetStep:
    """What one forward over ``n`` new tokens returns."""

    logits: torch.Tensor
    """[n, V] fp32: row ``i`` scores the token after the first ``i + 1`` new tokens."""
    aux: torch.Tensor
    """[n, n_aux * H]: the aux-layer outputs of the new tokens (the draft's context rows)."""


def load_causal_lm(target_path: Path, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The target with its lm_head from a local Hugging Face folder, in eval mode on ``device``."""
    if not (target_path / "config.json").is_file():
        raise TargetLoadError(
            f"capture.target_path {target_path} has no config.json (not a Hugging Face checkpoint folder); "
            "fix: point it at the target checkpoint (for recipes/tiny.yaml run tools/make_tiny_target first)"
        )
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).to(device).eval()


class TargetDecoder:
    """One sequence at a time through a causal LM with a KV cache, handing out aux hidden states."""

    def __init__(self, model: torch.nn.Module, aux_layer_ids: Sequence[int]) -> None:
        self.model = model
        self.base, layers = decoder_parts(model)
        last = len(layers) - 1
        bad = [i for i in aux_layer_ids if not 0 <= i < last]
        if bad:
            raise ValueError(f"capture.aux_layer_ids {bad} are outside the target's decoder layers 0..{last - 1}")
        self.aux_layer_ids = list(aux_layer_ids)
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self._outputs: dict[int, torch.Tensor] = {}
        self._handles = [layers[i].register_forward_hook(self._keep(i)) for i in sorted(set(self.aux_layer_ids))]
        self._norm_output: torch.Tensor | None = None
        self._handles.append(self.base.norm.register_forward_hook(self._keep_norm))
        self._cache: Any = None
        # transformers renamed the cache argument (past_key_values -> cache) and warns on the old name.
        self._cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _keep(self, layer_id: int) -> Any:
        def keep(module: torch.nn.Module, args: Any, output: Any) -> None:
            self._outputs[layer_id] = output[0] if isinstance(output, tuple) else output

        return keep

    def _keep_norm(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._norm_output = output[0] if isinstance(output, tuple) else output

    @property
    def length(self) -> int:
        """Tokens in the cache (the position of the next token)."""
        return 0 if self._cache is None else int(self._cache.get_seq_length())

    @torch.no_grad()
    def start(self, prompt_ids: Sequence[int]) -> TargetStep:
        """Prefill ``prompt_ids`` into a fresh cache; only the last row of logits is kept."""
        from transformers import DynamicCache

        if not prompt_ids:
            raise ValueError("a prompt needs at least one token")
        self._cache = DynamicCache(config=self.model.config)
        return self._run(prompt_ids, last_logits_only=True)

    @torch.no_grad()
    def extend(self, token_ids: Sequence[int]) -> TargetStep:
        """Run ``token_ids`` after the cached prefix; every row of logits is kept."""
        if self._cache is None:
            raise RuntimeError("call start() before extend()")
        return self._run(token_ids, last_logits_only=False)

    def rollback(self, keep_tokens: int) -> None:
        """Cut the cache back to its first ``keep_tokens`` tokens (the accepted prefix)."""
        remove = self.length - keep_tokens
        if remove < 0:
            raise ValueError(f"cannot keep {keep_tokens} tokens of a cache holding {self.length}")
        if remove:
            # A negative count removes that many tokens in every transformers release that has crop().
            self._cache.crop(-remove)

    def _run(self, token_ids: Sequence[int], last_logits_only: bool) -> TargetStep:
        ids = torch.tensor([list(token_ids)], dtype=torch.int64, device=self.device)
        self._outputs.clear()
        try:
            output = self.model(
                input_ids=ids,
                use_cache=True,
                logits_to_keep=1 if last_logits_only else 0,
                **{self._cache_argument: self._cache},
            )
            aux = torch.cat([self._outputs[i][0] for i in self.aux_layer_ids], dim=-1)
        finally:
            self._outputs.clear()
        return TargetStep(logits=output.logits[0].to(torch.float32), aux=aux)

    @torch.no_grad()
    def features(self, token_ids: Sequence[int]) -> SampleFeatures:
        """Aux states and post-norm last hidden state of ``token_ids`` (one forward, no cache)."""
        ids = torch.tensor([list(token_ids)], dtype=torch.int64, device=self.device)
        self._outputs.clear()
        try:
            self.base(input_ids=ids, use_cache=False)
            aux = torch.cat([self._outputs[i][0] for i in self.aux_layer_ids], dim=-1)
            assert self._norm_output is not None
            lhs = self._norm_output[0]
        finally:
            self._outputs.clear()
            self._norm_output = None
        return SampleFeatures(hs=aux, lhs=lhs)

    def close(self) -> None:
        """Remove the hooks and drop the cache."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._cache = None
