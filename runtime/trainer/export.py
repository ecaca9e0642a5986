"""Export the draft as ``model.safetensors`` + ``config.json`` for SGLang's DSpark draft loader.

Checked against the pinned release, sglang 0.5.23 (``srt/models/dspark.py``, ``srt/models/dflash.py``,
``srt/speculative/dspark_components/dspark_config.py``, ``srt/speculative/dflash_utils.py``;
``tests/test_trainer_export.py`` re-parses them from the wheel when it is present):

Tensor names (no ``model.`` prefix; SGLang strips one if present), with ``i`` the draft layer:

- ``fc.weight`` ``[H, n_aux * H]``, ``hidden_norm.weight``, ``norm.weight``
- ``layers.i.input_layernorm.weight``, ``layers.i.post_attention_layernorm.weight``
- ``layers.i.self_attn.{q,k,v,o}_proj.weight`` (SGLang stacks q/k/v into ``qkv_proj``),
  ``layers.i.self_attn.{q,k}_norm.weight``
- ``layers.i.mlp.{gate,up,down}_proj.weight`` (SGLang stacks gate/up into ``gate_up_proj``)
- ``markov_head.markov_w1.weight`` ``[V, r]``, ``markov_head.markov_w2.weight`` ``[V, r]``
  (``gate_proj`` for ``gated``, ``joint_proj`` for ``rnn``); matched by exact name, unknown
  Markov names are an error there
- ``confidence_head.proj.weight`` ``[1, H + r]``, ``confidence_head.proj.bias`` ``[1]``; all of them
  are required when ``enable_confidence_head`` is on
- not exported: ``embed_tokens`` / ``lm_head`` (SGLang attaches the target's), rotary tables

Note that SGLang's DFlash loader silently ignores names it does not know, so a wrong name would
serve an uninitialised draft: the test compares the full name set.

A latent-attention draft (``trainer.draft.attention: mla``) has, in place of the q/k/v projections and
norms, ``layers.i.self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
kv_b_proj, o_proj, g_proj}.weight`` (the public K3 MLA DSpark drafters' names) and is exported as
``KimiK3DSparkMLADraftModel`` (``model_type: kimi_k3_dspark``) with ``q_lora_rank``, ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``mla_use_output_gate`` and ``rope_interleave``.

Config keys SGLang reads (through transformers' ``AutoConfig`` with ``model_type: qwen3``):
``architectures: [Qwen3DSparkModel]``, the Qwen3 shape keys, ``rope_theta`` / ``rope_scaling``,
``dflash_config.{block_size, target_layer_ids, num_target_layers, mask_token_id, markov_rank,
markov_head_type}`` (also mirrored at the top level, where DeepSpec's own config keeps them),
``enable_confidence_head`` and ``confidence_head_with_markov``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from runtime.shared.checkpoint_folders import EXPORT_CONFIG_FILE
from runtime.shared.checkpoint_integrity import write_export_manifest
from runtime.shared.draft_provenance import RunOrigin, write_export_provenance
from runtime.trainer.distributed import barrier
from runtime.trainer.draft_spec import DraftSpec

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = EXPORT_CONFIG_FILE
ARCHITECTURE = "Qwen3DSparkModel"
MLA_ARCHITECTURE = "KimiK3DSparkMLADraftModel"
"""The architecture a latent-attention draft is exported as (SGLang 0.5.23 has no loader for it)."""
MLA_MODEL_TYPE = "kimi_k3_dspark"
HYBRID_ARCHITECTURE = "KimiK3DSpark4KDA1MLADraftModel"
"""The architecture a draft with ``kda`` layers is exported as (the public name of the K3 KDA+MLA hybrid)."""
IGNORED_ON_IMPORT = ("embed_tokens.", "lm_head.", "rotary_emb.")
"""Name prefixes (after an optional ``model.``) that a draft checkpoint may carry and we ignore,
as SGLang does: the frozen vocabulary tensors come from the target."""


def draft_config(spec: DraftSpec, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of the exported draft."""
    draft = spec.draft
    rope_scaling = None
    if draft.rope_scaling is not None:
        rope_scaling = {
            "rope_type": draft.rope_scaling.type,
            "factor": draft.rope_scaling.factor,
            "original_max_position_embeddings": draft.rope_scaling.original_max_position_embeddings,
            "beta_fast": draft.rope_scaling.beta_fast,
            "beta_slow": draft.rope_scaling.beta_slow,
        }
    dspark = {
        "block_size": draft.block_size,
        "target_layer_ids": list(spec.aux_layer_ids),
        "num_target_layers": spec.num_target_layers,
        "mask_token_id": draft.mask_token_id,
        "markov_rank": draft.markov_rank,
        "markov_head_type": draft.markov_type,
    }
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": draft.hidden_size,
        "intermediate_size": draft.intermediate_size,
        "num_hidden_layers": draft.num_layers,
        "num_attention_heads": draft.num_attention_heads,
        "num_key_value_heads": draft.num_key_value_heads,
        "head_dim": draft.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": draft.rms_norm_eps,
        "attention_bias": draft.attention_bias,
        "rope_theta": draft.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": draft.max_position_embeddings,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": spec.special_tokens.bos_id,
        "eos_token_id": spec.special_tokens.eos_id,
        "pad_token_id": spec.special_tokens.pad_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
        **dspark,
        "dflash_config": dspark,
        "num_anchors": spec.num_anchors,
        "enable_confidence_head": draft.confidence_head,
        "confidence_head_with_markov": draft.confidence_head and draft.confidence_uses_markov_embedding,
    }
    kinds = draft.layer_attentions
    if "kda" in kinds and draft.kda is not None:
        # The K3 layout: 1-based layer lists and the recurrence's shape in linear_attn_config.
        kda = draft.kda
        config.update(
            architectures=[HYBRID_ARCHITECTURE],
            model_type=MLA_MODEL_TYPE,
            draft_layer_types=list(kinds),
            linear_attn_config={
                "kda_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "kda"],
                "full_attn_layers": [i + 1 for i, kind in enumerate(kinds) if kind != "kda"],
                "num_heads": kda.num_heads,
                "head_dim": kda.head_dim,
                "short_conv_kernel_size": kda.short_conv_kernel_size,
                "gate_lower_bound": kda.gate_lower_bound,
                "use_full_rank_gate": kda.use_full_rank_gate,
            },
        )
    if "mla" in kinds and draft.mla is not None:
        # The K3 MLA DSpark loaders (SGLang's KimiK3DSparkMLADraftModel, registered after 0.5.23) read the
        # latent shape from these keys; the tensors already carry their names.
        mla = draft.mla
        config.update(
            architectures=[HYBRID_ARCHITECTURE if "kda" in kinds else MLA_ARCHITECTURE],
            model_type=MLA_MODEL_TYPE,
            head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
            num_key_value_heads=draft.num_attention_heads,
            q_lora_rank=mla.q_lora_rank,
            kv_lora_rank=mla.kv_lora_rank,
            qk_nope_head_dim=mla.qk_nope_head_dim,
            qk_rope_head_dim=mla.qk_rope_head_dim,
            v_head_dim=mla.v_head_dim,
            mla_use_output_gate=mla.use_output_gate,
            mla_use_nope=True,  # the K3 MLA loaders check it: the nope and rope parts of each head are apart
            rope_interleave=mla.rope_interleave,
        )
    return config


def export_draft(
    model: torch.nn.Module, target: Path, spec: DraftSpec, *, dtype: torch.dtype, is_main: bool, origin: RunOrigin
) -> Path:
    """Write ``target/`` (collective: every rank calls it; rank 0 writes), with ``provenance.json``
    recording ``origin``, the run that wrote it. Returns ``target``."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main:
        tmp = target.with_name(f".tmp-{target.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tensors = {name: tensor.detach().to(dtype).contiguous() for name, tensor in full.items()}
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "producer": "dspark-recipes"})
        (tmp / CONFIG_FILE).write_text(json.dumps(draft_config(spec, dtype), indent=2) + "\n")
        weights = write_export_provenance(tmp, origin)  # an eval refuses another run's export
        write_export_manifest(tmp, known=weights)  # an eval checks every file against it
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    barrier()
    return target


def _normalise(name: str) -> str:
    return name.removeprefix("model.")


def read_exported_weights(
    path: Path, expected: set[str], field: str = "trainer.checkpoint.init_from"
) -> dict[str, torch.Tensor]:
    """Full tensors of an exported draft (ours, or any with the same names), checked against the
    model's names: a missing or unknown tensor is an error that lists them (and names ``field``,
    where the path came from)."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise FileNotFoundError(
            f"{field} {path}: neither a checkpoint (step_NNNNNNNN with trainer_state.json) "
            "nor a folder with *.safetensors draft weights"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in list(handle.keys()):
                    key = _normalise(name)
                    if key.startswith(IGNORED_ON_IMPORT):
                        continue
                    tensors[key] = handle.get_tensor(name).to(torch.float32)
        except Exception as exc:  # safetensors raises its own error type for a damaged header or body
            raise ValueError(
                f"{field} {path}: {file} is not a readable safetensors file ({exc}); it is "
                "truncated or corrupt. Fix: export the draft again, or use a checkpoint folder"
            ) from None
    missing = sorted(expected - set(tensors))
    unknown = sorted(set(tensors) - expected)
    if missing or unknown:
        raise ValueError(
            f"{field} {path}: the draft weights do not match this recipe's draft; "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, unknown {unknown[:8]}"
            f"{'...' if len(unknown) > 8 else ''}; fix: use a draft with the recipe's architecture"
        )
    return tensors
