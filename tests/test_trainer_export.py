"""The exported draft against SGLang 0.5.23's DSpark draft loader, parsed from the pinned wheel.

The wheel is not installed (it needs CUDA); its sources are read with ``zipfile`` + ``ast``. Get it
with ``pip download --no-deps sglang==0.5.23 -d .cache/sglang`` (``.cache/`` is git-ignored).
"""

from __future__ import annotations

import ast
import json
import zipfile
from pathlib import Path

import pytest
import torch

from runtime.recipe import load_recipe
from runtime.trainer.draft_spec import DraftSpec
from runtime.trainer.export import ARCHITECTURE, draft_config, read_exported_weights
from runtime.trainer.model import DSparkDraft

REPO_ROOT = Path(__file__).resolve().parent.parent
WHEELS = sorted((REPO_ROOT / ".cache" / "sglang").glob("sglang-0.5.23-*.whl"))


def k3_recipe():
    return load_recipe(REPO_ROOT / "recipes" / "kimi_k3_v1c.yaml").recipe


@pytest.fixture(scope="module")
def wheel_sources() -> dict[str, str]:
    if not WHEELS:
        pytest.skip("sglang 0.5.23 wheel not downloaded: pip download --no-deps sglang==0.5.23 -d .cache/sglang")
    wanted = {
        "dspark": "sglang/srt/models/dspark.py",
        "dflash": "sglang/srt/models/dflash.py",
        "dspark_config": "sglang/srt/speculative/dspark_components/dspark_config.py",
        "dflash_utils": "sglang/srt/speculative/dflash_utils.py",
    }
    with zipfile.ZipFile(WHEELS[0]) as wheel:
        return {key: wheel.read(path).decode() for key, path in wanted.items()}


def self_attributes(source: str, class_name: str) -> set[str]:
    """Names assigned as ``self.X = ...`` in ``class_name.__init__``."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return {
                        target.attr
                        for stmt in ast.walk(item)
                        if isinstance(stmt, ast.Assign | ast.AnnAssign)
                        for target in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
                        if isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                    }
    raise AssertionError(f"class {class_name} not found in the wheel source")


def stacked_mapping(source: str) -> dict[str, list[str]]:
    """``stacked_params_mapping`` of DFlash's load_weights: fused param -> checkpoint names."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "stacked_params_mapping" for t in node.targets
        ):
            mapping: dict[str, list[str]] = {}
            for entry in ast.literal_eval(node.value):
                mapping.setdefault(entry[0], []).append(entry[1])
            return mapping
    raise AssertionError("stacked_params_mapping not found in dflash.py")


def sglang_checkpoint_names(sources: dict[str, str], num_layers: int, markov_type: str) -> set[str]:
    """Every tensor name SGLang's DSpark draft loader consumes, assembled from the wheel's modules."""
    dflash, dspark = sources["dflash"], sources["dspark"]
    root = self_attributes(dflash, "DFlashDraftModel")
    layer = self_attributes(dflash, "DFlashDecoderLayer")
    attention = self_attributes(dflash, "DFlashAttention")
    mlp = self_attributes(dflash, "DFlashMLP")
    stacked = stacked_mapping(dflash)
    for needed, owner in (
        ({"layers", "norm", "fc", "hidden_norm"}, root),
        ({"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}, layer),
        ({"qkv_proj", "o_proj", "q_norm", "k_norm"}, attention),
        ({"gate_up_proj", "down_proj"}, mlp),
    ):
        assert needed <= owner, f"the wheel's modules changed: missing {needed - owner}"
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        p = f"layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{n}.weight" for n in ("o_proj", "q_norm", "k_norm")}
        names |= {p + f"self_attn.{n}.weight" for n in stacked["qkv_proj"]}
        names |= {p + f"mlp.{n}.weight" for n in stacked["gate_up_proj"]}
        names.add(p + "mlp.down_proj.weight")
    markov = self_attributes(dspark, "VanillaMarkov")
    assert {"markov_w1", "markov_w2"} <= markov
    names |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
    if markov_type == "gated":
        assert "gate_proj" in self_attributes(dspark, "GatedMarkovHead")
        names |= {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"}
    if markov_type == "rnn":
        assert "joint_proj" in self_attributes(dspark, "RNNHead")
        names |= {"markov_head.joint_proj.weight", "markov_head.joint_proj.bias"}
    assert "proj" in self_attributes(dspark, "DSparkConfidenceHead")
    assert "bias: bool = True" in dspark  # DSparkConfidenceHead's Linear keeps its bias by default
    names |= {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    return names


@pytest.mark.parametrize("markov_type", ["vanilla", "gated", "rnn"])
def test_exported_names_equal_what_sglang_loads(wheel_sources: dict[str, str], markov_type: str) -> None:
    recipe = load_recipe(
        REPO_ROOT / "recipes" / "tiny.yaml",
        overrides=[
            f"trainer.draft.markov_type={markov_type}",
            "trainer.draft.num_layers=2",
            "data.expected_sha256=" + "ab" * 32,
        ],
    ).recipe
    model = DSparkDraft(
        recipe.trainer.draft,
        vocab_size=recipe.capture.vocab_size,
        num_aux_layers=3,
        attention_backend="sdpa",
        max_length=64,
    )
    ours = set(model.state_dict())
    theirs = sglang_checkpoint_names(wheel_sources, 2, markov_type)
    assert ours == theirs, f"only ours: {sorted(ours - theirs)}; only SGLang's: {sorted(theirs - ours)}"
    skipped = ast.literal_eval(
        wheel_sources["dspark"].split("_DSPARK_SKIPPED_WEIGHT_PREFIXES = ", 1)[1].split("\n", 1)[0]
    )
    assert not any(name.startswith(tuple(skipped)) for name in ours)


def test_config_keys_are_the_ones_sglang_reads(wheel_sources: dict[str, str], tmp_path: Path) -> None:
    recipe = k3_recipe()
    config = draft_config(DraftSpec.from_recipe(recipe), torch.bfloat16)
    assert f"{ARCHITECTURE}" in wheel_sources["dspark"].split("EntryClass", 1)[1]
    parsers = wheel_sources["dspark_config"] + wheel_sources["dflash_utils"]
    for key in config["dflash_config"]:
        assert f'"{key}"' in parsers, key
    for key in ("enable_confidence_head", "confidence_head_with_markov", "markov_rank", "markov_head_type"):
        assert f'"{key}"' in wheel_sources["dspark"] + parsers, key
    assert config["dflash_config"]["target_layer_ids"] == [7, 23, 51, 67, 83]
    assert config["block_size"] == 7 and config["mask_token_id"] == 163824 and config["markov_rank"] == 256

    # SGLang reads the draft config through transformers' AutoConfig (model_type qwen3)
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded.num_hidden_layers == 5 and loaded.hidden_size == 7168 and loaded.head_dim == 64
    assert loaded.num_key_value_heads == 16 and loaded.intermediate_size == 14336 and loaded.vocab_size == 163840
    rope = loaded.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 16.0 and rope["original_max_position_embeddings"] == 4096
    assert rope["rope_theta"] == 10000.0 and loaded.max_position_embeddings == 65536
    assert loaded.dflash_config["mask_token_id"] == 163824 and loaded.enable_confidence_head is True


def test_warm_start_reads_an_exported_draft_and_names_mismatches(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    recipe = load_recipe(REPO_ROOT / "recipes" / "tiny.yaml", overrides=["data.expected_sha256=" + "ab" * 32]).recipe
    model = DSparkDraft(
        recipe.trainer.draft,
        vocab_size=recipe.capture.vocab_size,
        num_aux_layers=3,
        attention_backend="sdpa",
        max_length=64,
    )
    state = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}  # a "model." prefix is accepted
    state["model.embed_tokens.weight"] = torch.zeros(4, 4)  # frozen vocabulary tensors are ignored
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    loaded = read_exported_weights(tmp_path, set(model.state_dict()))
    assert set(loaded) == set(model.state_dict())
    assert torch.equal(loaded["fc.weight"], model.fc.weight.detach())

    del state["model.norm.weight"]
    state["model.extra.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\], unknown \['extra.weight'\]"):
        read_exported_weights(tmp_path, set(model.state_dict()))
