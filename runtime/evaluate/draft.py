"""The draft under evaluation: where it comes from, and how it proposes one block.

Sources (:func:`resolve_draft_source`): a trainer checkpoint (``latest``, ``step_N``/``N``, or a
checkpoint folder), an export folder (ours, or any DSpark draft in SGLang's ``Qwen3DSparkModel``
format: ``config.json`` + ``*.safetensors``), or ``untrained`` (the recipe's draft freshly
initialised: the floor a trained draft must clear). The draft's shape is the job's
:class:`~runtime.trainer.draft_spec.DraftSpec` (an exported draft's own architecture in it).

Proposing follows SGLang 0.5.23's DSpark draft (``sample_from_anchor``, its default): the block is
the last committed token at position ``a`` followed by ``block_size - 1`` mask tokens at ``a+1..``;
the context is the target's aux hidden states of positions ``0..a-1`` (projected once per row);
every slot's post-norm hidden gives base logits through the target's lm_head, and the Markov head
adds its bias slot by slot, conditioned on the token just drafted (the anchor for slot 0). So
``block_size`` tokens are drafted per step. The confidence head (when the draft has one) scores
each slot from its hidden state and the Markov embedding of the slot's previous token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from runtime.recipe.schema import DraftConfig
from runtime.shared.checkpoint_folders import DraftSource, DraftSourceError
from runtime.trainer.checkpoints import CheckpointError, load_weights
from runtime.trainer.draft_spec import DraftSpec
from runtime.trainer.export import CONFIG_FILE, read_exported_weights
from runtime.trainer.layout import BlockLayout
from runtime.trainer.model import DSparkDraft


def draft_config_from_export(config_path: Path, spec: DraftSpec) -> DraftConfig:
    """The draft shape of an exported DSpark draft's ``config.json``, checked against the target of
    ``spec`` (hidden size, vocabulary, aux layer ids, mask token); every disagreement is listed in
    one :class:`DraftSourceError`."""
    try:
        config: dict[str, Any] = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DraftSourceError(f"{config_path}: not readable JSON ({exc}); fix: export the draft again") from None
    dspark = {**config, **(config.get("dflash_config") or {})}
    problems = []
    expected = {
        "hidden_size": (config.get("hidden_size"), spec.target_hidden_size, "capture.hidden_size"),
        "vocab_size": (config.get("vocab_size"), spec.vocab_size, "capture.vocab_size"),
        "target_layer_ids": (
            list(dspark.get("target_layer_ids") or []),
            list(spec.aux_layer_ids),
            "capture.aux_layer_ids",
        ),
    }
    for key, (found, wanted, field) in expected.items():
        if found != wanted:
            problems.append(f"{key} is {found}, the target's {field} is {wanted}")
    mask = dspark.get("mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < spec.vocab_size:
        problems.append(
            f"mask_token_id {mask!r} is not a token id of the target's vocabulary (0..{spec.vocab_size - 1})"
        )
    if not dspark.get("sample_from_anchor", True):
        problems.append(
            "sample_from_anchor is false (a block that drafts from mask slots only), which this decoder does not run"
        )
    if problems:
        raise DraftSourceError(
            f"{config_path}: this draft does not fit the target of the recipe: {'; '.join(problems)}. Fix: evaluate "
            "it with the recipe of the target it was trained for"
        )
    heads = int(config["num_attention_heads"])
    rope = config.get("rope_scaling")
    latent = "kv_lora_rank" in config  # a latent-attention (MLA) draft: its shape in the K3 MLA keys
    linear = config.get("linear_attn_config") or {}
    try:
        kda_layers = {int(i) for i in linear.get("kda_layers", [])}
        layers = (
            ["kda" if i + 1 in kda_layers else ("mla" if latent else "gqa") for i in range(config["num_hidden_layers"])]
            if kda_layers
            else None
        )
        kda = (
            {
                "num_heads": linear["num_heads"],
                "head_dim": linear["head_dim"],
                "short_conv_kernel_size": linear.get("short_conv_kernel_size", 4),
                "gate_lower_bound": linear.get("gate_lower_bound"),
                "use_full_rank_gate": bool(linear.get("use_full_rank_gate", False)),
            }
            if kda_layers
            else None
        )
        mla = (
            {
                "q_lora_rank": config.get("q_lora_rank"),
                "kv_lora_rank": config["kv_lora_rank"],
                "qk_nope_head_dim": config["qk_nope_head_dim"],
                "qk_rope_head_dim": config["qk_rope_head_dim"],
                "v_head_dim": config["v_head_dim"],
                "use_output_gate": bool(config.get("mla_use_output_gate", False)),
                "rope_interleave": bool(config.get("rope_interleave", True)),
            }
            if latent
            else None
        )
        return DraftConfig(
            attention="mla" if latent else "gqa",
            mla=mla,
            layers=layers,
            kda=kda,
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config["intermediate_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            attention_bias=bool(config.get("attention_bias", False)),
            rope_theta=config.get("rope_theta", 10000.0),
            rope_scaling=None if not rope else _rope_scaling(rope),
            max_position_embeddings=config["max_position_embeddings"],
            block_size=dspark["block_size"],
            mask_token_id=mask,
            markov_rank=dspark.get("markov_rank", 256),
            markov_type=dspark.get("markov_head_type", "vanilla"),
            confidence_head=bool(config.get("enable_confidence_head", False)),
            confidence_uses_markov_embedding=bool(config.get("confidence_head_with_markov", False)),
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise DraftSourceError(
            f"{config_path}: not a DSpark draft config ({exc}); fix: export the draft again"
        ) from None


def _rope_scaling(rope: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face ``rope_scaling`` entry in the recipe's terms (``rope_type`` is our ``type``)."""
    keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
    return {"type": rope.get("rope_type", rope.get("type")), **{k: rope[k] for k in keys if k in rope}}


def build_draft(source: DraftSource, spec: DraftSpec, *, seed: int, device: str, dtype: torch.dtype) -> DSparkDraft:
    """The draft of ``source`` on ``device`` (frozen vocabulary not attached yet): ``spec``'s draft,
    or for an export the draft its ``config.json`` describes on ``spec``'s target."""
    if source.kind == "export":
        assert source.path is not None
        spec = spec.with_draft(draft_config_from_export(source.path / CONFIG_FILE, spec))
    torch.manual_seed(seed)
    model = spec.build(attention_backend="sdpa")
    if source.kind == "checkpoint":
        assert source.path is not None
        try:
            load_weights(source.path, model)
        except CheckpointError as exc:
            raise DraftSourceError(str(exc)) from None
    elif source.kind == "export":
        assert source.path is not None
        tensors = read_exported_weights(source.path, set(model.state_dict()), field="--checkpoint")
        wrong = [
            f"{name} {tuple(tensors[name].shape)} (config says {tuple(t.shape)})"
            for name, t in model.state_dict().items()
            if tuple(tensors[name].shape) != tuple(t.shape)
        ]
        if wrong:
            raise DraftSourceError(
                f"--checkpoint {source.path}: tensor shapes disagree with its {CONFIG_FILE}: {', '.join(wrong[:4])}; "
                "fix: export the draft again"
            )
        model.load_state_dict(tensors)
    return model.to(device=device, dtype=dtype).eval()


MARKOV_TABLE_MAX_BYTES = 64 * 2**20
"""Largest vanilla Markov bias table a proposer precomputes (a vocabulary of up to 4096 tokens)."""


@dataclass
class Proposal:
    """One drafted block."""

    tokens: torch.Tensor
    """int64 [S] on the CPU."""
    probs: torch.Tensor | None
    """[S, V] fp32 draft distributions the tokens were drawn from (sampled proposals only)."""
    confidence: list[float] | None
    """Predicted acceptance probability per slot (sigmoid of the confidence head), or None."""


class DraftProposer:
    """Keeps the projected context of one sequence and drafts a block after each verify step."""

    def __init__(self, model: DSparkDraft) -> None:
        self.model = model
        self.block_size = model.cfg.block_size
        self.mask_token_id = model.cfg.mask_token_id
        self.dtype = model.fc.weight.dtype
        self.device = model.fc.weight.device
        self.context = torch.empty(0, model.cfg.hidden_size, dtype=self.dtype, device=self.device)
        self._markov_table = self._vanilla_markov_table(model)

    @staticmethod
    @torch.no_grad()
    def _vanilla_markov_table(model: DSparkDraft) -> torch.Tensor | None:
        """``W1 @ W2^T`` [V, V] fp32: the vanilla Markov head's bias for every previous token, so that each
        drafted slot costs a row lookup instead of a [r] x [r, V] product. Only where it is small (a small
        vocabulary); otherwise (and for the gated and rnn heads) the bias is computed slot by slot."""
        head = model.markov_head
        vocab = head.markov_w1.weight.shape[0]
        if head.kind != "vanilla" or vocab * vocab * 4 > MARKOV_TABLE_MAX_BYTES:
            return None
        return head.markov_w1.weight.to(torch.float32) @ head.markov_w2.weight.to(torch.float32).t()

    @torch.no_grad()
    def reset(self, aux: torch.Tensor) -> None:
        """Start a sequence: the context is the projection of ``aux [T, n_aux * H]`` (the prompt)."""
        self.context = self.model.project_context(aux.to(self.device, self.dtype))

    @torch.no_grad()
    def append(self, aux: torch.Tensor) -> None:
        """Add the rows of newly accepted tokens (projection is per row, so this equals a re-projection)."""
        self.context = torch.cat([self.context, self.model.project_context(aux.to(self.device, self.dtype))])

    def _layout(self, anchor_token: int) -> BlockLayout:
        anchor = int(self.context.shape[0])
        size, device = self.block_size, self.device
        slots = torch.full((1, size), self.mask_token_id, dtype=torch.int64, device=device)
        slots[0, 0] = anchor_token
        zeros = torch.zeros((1, size), dtype=torch.int64, device=device)
        return BlockLayout(
            anchors=torch.tensor([anchor], dtype=torch.int64, device=device),
            keep=torch.ones(1, dtype=torch.bool, device=device),
            slot_token_ids=slots,
            positions=anchor + torch.arange(size, dtype=torch.int64, device=device)[None, :],
            labels=zeros,
            teacher_index=zeros,
            prev_tokens=zeros,
            eval_mask=torch.zeros((1, size), dtype=torch.bool, device=device),
            weights=torch.zeros((1, size), dtype=torch.float32, device=device),
            supervised_rows=torch.zeros(0, dtype=torch.int64, device=device),
            weight_sum=0.0,
            num_eligible=1,
            seq_len=anchor,
        )

    @torch.no_grad()
    def propose(self, anchor_token: int, temperature: float, generator: torch.Generator) -> Proposal:
        """Draft ``block_size`` tokens after ``anchor_token`` (at position ``len(context)``): argmax at
        temperature 0, else drawn from the Markov-biased softmax at ``temperature`` (CPU ``generator``)."""
        model = self.model
        hidden = model.slot_hidden(self.context, self._layout(anchor_token))  # [1, S, H]
        base = hidden[0].to(torch.float32) @ model.lm_head_weight.to(torch.float32).t()  # [S, V]
        w2 = model.markov_head.markov_w2.weight.to(torch.float32)
        vanilla = model.markov_head.kind == "vanilla"
        prev = [anchor_token]
        probs: list[torch.Tensor] = []
        for k in range(self.block_size):
            if self._markov_table is not None:
                bias = self._markov_table[prev[-1]]
            elif vanilla:  # the latent is the previous token's row: one lookup, not a pass over the slots
                bias = model.markov_head.markov_w1.weight[prev[-1]].to(torch.float32) @ w2.t()
            else:  # recomputed over the slots so far: the gated and rnn heads read the slots (S is small)
                prev_tokens = torch.tensor([prev], dtype=torch.int64, device=self.device)
                latent = model.markov_head(prev_tokens, hidden[:, : k + 1])[0][0, k]
                bias = latent.to(torch.float32) @ w2.t()
            logits = base[k] + bias
            if temperature == 0.0:
                token = int(logits.argmax())
            else:
                q = F.softmax(logits / temperature, dim=-1).cpu()
                token = int(torch.multinomial(q, 1, generator=generator))
                probs.append(q)
            prev.append(token)
        confidence = None
        if model.confidence_head is not None:
            # Every slot at once, from its hidden state and the Markov embedding of its previous token.
            embedded = model.markov_head.markov_w1(torch.tensor([prev[:-1]], dtype=torch.int64, device=self.device))
            scores = torch.sigmoid(model.confidence_head(hidden, embedded).to(torch.float32))[0]
            confidence = [float(score) for score in scores.tolist()]  # one device-to-host read, not S
        return Proposal(
            tokens=torch.tensor(prev[1:], dtype=torch.int64),
            probs=torch.stack(probs) if probs else None,
            confidence=confidence,
        )
