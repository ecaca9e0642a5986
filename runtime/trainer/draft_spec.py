"""The draft's spec: its architecture and what it shares with the target, built once from the recipe.

The trainer and the evaluation both build a :class:`~runtime.trainer.model.DSparkDraft`, export it
or check an exported one against the target. Each entry builds one :class:`DraftSpec` at its door
(:meth:`DraftSpec.from_recipe`) and hands it down; nothing below reads the recipe for the draft.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from runtime.recipe.schema import DraftConfig, SpecialTokens

if TYPE_CHECKING:
    from runtime.recipe.schema import Recipe
    from runtime.trainer.model import DSparkDraft


@dataclass(frozen=True)
class DraftSpec:
    """Everything that shapes a DSpark draft of one target."""

    draft: DraftConfig
    """``trainer.draft``: the draft's own architecture (or an exported draft's, see :meth:`with_draft`)."""
    vocab_size: int
    """``capture.vocab_size``: the target's vocabulary (the frozen embedding and lm_head)."""
    target_hidden_size: int
    """``capture.hidden_size``: the width of the target's hidden states the draft reads."""
    aux_layer_ids: tuple[int, ...]
    """``capture.aux_layer_ids``: the target layers whose hidden states feed the draft."""
    num_target_layers: int
    """``capture.num_target_layers``."""
    special_tokens: SpecialTokens
    """``capture.special_tokens``: bos, eos and pad of the target."""
    max_length_tokens: int
    """``data.max_length``: the longest sample (flex attention compiles for this length)."""
    num_anchors: int
    """``trainer.loss.num_anchors`` (recorded in the export's config)."""

    @property
    def num_aux_layers(self) -> int:
        """Hidden states concatenated into the draft's context projection."""
        return len(self.aux_layer_ids)

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> DraftSpec:
        """The spec of ``recipe``'s draft (called once, at an entry's door)."""
        capture = recipe.capture
        return cls(
            draft=recipe.trainer.draft,
            vocab_size=capture.vocab_size,
            target_hidden_size=capture.hidden_size,
            aux_layer_ids=tuple(capture.aux_layer_ids),
            num_target_layers=capture.num_target_layers,
            special_tokens=capture.special_tokens,
            max_length_tokens=recipe.data.max_length,
            num_anchors=recipe.trainer.loss.num_anchors,
        )

    def with_draft(self, draft: DraftConfig) -> DraftSpec:
        """The same target with another draft architecture (an exported draft's own config)."""
        return replace(self, draft=draft)

    def build(self, *, attention_backend: str, compile_regions: bool = False) -> DSparkDraft:
        """A freshly initialised draft of this spec (seed torch first for a reproducible one)."""
        from runtime.trainer.model import DSparkDraft

        return DSparkDraft(
            self.draft,
            vocab_size=self.vocab_size,
            num_aux_layers=self.num_aux_layers,
            attention_backend=attention_backend,
            max_length=self.max_length_tokens,
            compile_regions=compile_regions,
        )
