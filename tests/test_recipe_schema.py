"""Recipe schema, overlays, overrides and cross-field checks: every bad-input class has its message."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from runtime.recipe import RecipeError, load_recipe, load_resolved, write_resolved
from runtime.recipe.loader import find_recipe_file
from runtime.recipe.units import parse_bytes

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny.yaml"
K3 = REPO / "recipes" / "kimi_k3_v1c.yaml"


def _problems(exc: RecipeError) -> dict[str, str]:
    return {p.path: p.render() for p in exc.problems}


def _write(tmp_path: Path, document: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def _tiny_doc() -> dict:
    return yaml.safe_load(TINY.read_text())


def test_both_recipes_load_with_and_without_smoke() -> None:
    for path in (TINY, K3):
        assert load_recipe(path).recipe.job.name == path.stem
        smoke = load_recipe(path, smoke=True)
        assert smoke.smoke and smoke.recipe.trainer.max_steps == 1


def test_k3_recipe_carries_the_production_numbers() -> None:
    r = load_recipe(K3).recipe
    assert r.capture.aux_layer_ids == [7, 23, 51, 67, 83]
    assert (r.capture.num_target_layers, r.capture.hidden_size, r.capture.vocab_size) == (93, 7168, 163840)
    tokens = r.capture.special_tokens
    assert (tokens.bos_id, tokens.eos_id, tokens.pad_id, r.trainer.draft.mask_token_id) == (
        163584,
        163586,
        163839,
        163824,
    )
    assert r.capture.target_revision == "cdd2e49a2c1cf8d4713b513955e415ed75405a72"
    assert (r.trainer.seed, r.trainer.prompt_seed) == (42, 1)
    assert (r.trainer.micro_batch_size, r.trainer.gradient_accumulation_steps, r.trainer_world_size) == (1, 32, 4)
    assert r.trainer.global_batch_size == 128
    assert r.trainer.optimizer.lr == 5.0959167111070076e-05
    assert r.trainer.schedule.type == "constant" and r.trainer.schedule.warmup_steps == 0
    assert r.trainer.optimizer.max_grad_norm == 1.0
    loss = r.trainer.loss
    assert (loss.ce_weight, loss.l1_weight, loss.confidence_weight) == (0.1, 0.9, 1.0)
    assert (loss.num_anchors, loss.loss_decay_gamma, loss.objective_chunk_blocks) == (512, 4.0, 128)
    assert r.data.max_length == 65536
    assert (r.trainer.checkpoint.every_steps, r.trainer.log_every_steps, r.trainer.epochs) == (8, 10, 10)
    assert r.trainer.checkpoint.init_from and not r.trainer.checkpoint.resume_from
    d = r.trainer.draft
    assert (d.num_layers, d.hidden_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim) == (
        5,
        7168,
        64,
        16,
        64,
    )
    assert (d.intermediate_size, d.rms_norm_eps, d.attention_bias, d.rope_theta) == (14336, 1e-5, False, 10000.0)
    assert d.rope_scaling and (d.rope_scaling.type, d.rope_scaling.factor) == ("yarn", 16.0)
    assert d.rope_scaling.original_max_position_embeddings == 4096 and d.max_position_embeddings == 65536
    assert (d.block_size, d.markov_rank, d.markov_type, d.confidence_head) == (7, 256, "vanilla", True)
    assert r.trainer.embed_tensor_name == "language_model.model.embed_tokens.weight"
    assert r.trainer.lm_head_tensor_name == "language_model.lm_head.weight"
    s = r.capture.sglang
    assert (s.tp_size, s.mem_fraction_static, s.context_length, s.max_running_requests) == (8, 0.76, 66048, 1)
    assert (s.max_total_tokens, s.attention_backend, s.moe_runner_backend) == (66048, "trtllm_mla", "marlin")
    assert (s.mamba_radix_cache_strategy, s.max_mamba_cache_size) == ("extra_buffer", 5)
    assert (s.disable_cuda_graph, s.chunked_prefill_size, s.skip_tokenizer_init) == (True, -1, True)
    t = r.transport
    assert t.protocol == "tcp" and t.global_segment_bytes >= 2**40 and t.local_buffer_bytes == 2**30
    assert (t.kv_lease_ttl_s, t.transfer_timeout_s) == (300, 300)
    assert (t.high_watermark_samples, t.low_watermark_samples) == (128, 128)
    assert (t.high_watermark_bytes, t.low_watermark_bytes, t.store_cap_bytes) == (800 * 2**30, 650 * 2**30, 900 * 2**30)
    assert r.data.num_rows == 462
    assert r.data.expected_sha256 == "6d50e6bb9ee59095eed91bfba035081efef9fea43bece9ad5dd01c6648a8ef24"
    smoke = load_recipe(K3, smoke=True).recipe
    assert (smoke.data.num_rows, smoke.trainer.epochs, smoke.trainer.max_steps) == (4, 1, 1)
    assert smoke.trainer.gradient_accumulation_steps == 1
    assert (smoke.transport.high_watermark_samples, smoke.transport.low_watermark_samples) == (4, 4)


def test_unknown_key_names_path_and_suggests(tmp_path: Path) -> None:
    doc = _tiny_doc()
    doc["trainer"]["optimizer"]["learning_rate"] = 1.0
    doc["transport"]["high_watermark_sample"] = 3
    with pytest.raises(RecipeError) as info:
        load_recipe(_write(tmp_path, doc))
    problems = _problems(info.value)
    assert "did you mean 'high_watermark_samples'" in problems["transport.high_watermark_sample"].lower()
    assert "unknown key 'learning_rate'" in problems["trainer.optimizer.learning_rate"]
    assert "recipe.yaml" in str(info.value)


def test_wrong_type_and_missing_key(tmp_path: Path) -> None:
    doc = _tiny_doc()
    doc["trainer"]["epochs"] = "many"
    del doc["capture"]["hidden_size"]
    doc["capture"]["engine"] = "vllm"
    with pytest.raises(RecipeError) as info:
        load_recipe(_write(tmp_path, doc))
    problems = _problems(info.value)
    assert "valid integer" in problems["trainer.epochs"] and "'many'" in problems["trainer.epochs"]
    assert "required key is missing" in problems["capture.hidden_size"]
    assert "'sglang', 'embedded'" in problems["capture.engine"]


def test_bad_byte_size(tmp_path: Path) -> None:
    doc = _tiny_doc()
    doc["transport"]["global_segment_bytes"] = "lots"
    with pytest.raises(RecipeError) as info:
        load_recipe(_write(tmp_path, doc))
    assert "800GiB" in _problems(info.value)["transport.global_segment_bytes"]
    assert parse_bytes("1TiB") == 2**40 and parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes(7) == 7


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("job:\n  name: x\n  partition: [unclosed\n")
    with pytest.raises(RecipeError, match=r"line \d+"):
        load_recipe(path)


def test_set_override_applies_and_typos_are_attributed() -> None:
    loaded = load_recipe(TINY, overrides=["trainer.optimizer.lr=0.5", "transport.protocol=rdma"])
    assert loaded.recipe.trainer.optimizer.lr == 0.5 and loaded.recipe.transport.protocol == "rdma"
    assert loaded.digest != load_recipe(TINY).digest
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, overrides=["trainer.optimzer.lr=1"])
    rendered = _problems(info.value)["trainer.optimzer"]
    assert "--set trainer.optimzer.lr=1" in rendered and "did you mean 'optimizer'" in rendered.lower()
    with pytest.raises(RecipeError, match="key.path=value"):
        load_recipe(TINY, overrides=["trainer.seed"])


def test_global_batch_arithmetic() -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, overrides=["trainer.global_batch_size=12"])
    message = _problems(info.value)["trainer.global_batch_size"]
    assert "micro_batch_size 1 x gradient_accumulation_steps 2 x trainer ranks 4" in message and "= 8" in message


def test_watermark_rules_name_both_numbers() -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, overrides=["transport.high_watermark_samples=4", "transport.low_watermark_samples=2"])
    problems = _problems(info.value)
    assert "is 4, below one global step (trainer.global_batch_size 8)" in problems["transport.high_watermark_samples"]
    assert "is 2, below one global step" in problems["transport.low_watermark_samples"]

    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, overrides=["transport.high_watermark_bytes=1MiB", "transport.low_watermark_bytes=1MiB"])
    message = _problems(info.value)["transport.high_watermark_bytes"]
    assert "1.00 MiB" in message and "trainer.global_batch_size 8 x" in message

    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, overrides=["transport.high_watermark_bytes=200MiB"])
    message = _problems(info.value)["transport.high_watermark_bytes"]
    assert "200.00 MiB" in message and "store_cap_bytes 192.00 MiB" in message

    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, overrides=["transport.store_cap_bytes=300MiB"])
    assert "global_segment_bytes 256.00 MiB" in _problems(info.value)["transport.store_cap_bytes"]


def test_k3_smoke_low_watermark_below_one_step_is_rejected() -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(K3, smoke=True, overrides=["transport.low_watermark_samples=2"])
    assert (
        "below one global step (trainer.global_batch_size 4)"
        in _problems(info.value)["transport.low_watermark_samples"]
    )


def test_aux_layer_ids_inside_target_and_not_last() -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, overrides=["capture.aux_layer_ids=[1, 7, 9, 1]"])
    problems = _problems(info.value)
    assert "last decoder layer" in problems["capture.aux_layer_ids[1]"]
    assert "outside the target's decoder layers 0..7" in problems["capture.aux_layer_ids[2]"]
    assert "repeats layer ids [1]" in problems["capture.aux_layer_ids"]


def test_resume_and_init_are_exclusive() -> None:
    with pytest.raises(RecipeError, match="exclude each other"):
        load_recipe(TINY, overrides=["trainer.checkpoint.resume_from=auto", "trainer.checkpoint.init_from=/x"])


def test_smoke_overlay_typo_fails_without_smoke(tmp_path: Path) -> None:
    doc = _tiny_doc()
    doc["smoke"]["trainer"]["max_step"] = 1
    with pytest.raises(RecipeError) as info:
        load_recipe(_write(tmp_path, doc))
    rendered = _problems(info.value)["smoke.trainer.max_step"]
    assert "smoke overlay" in rendered and "did you mean 'max_steps'" in rendered.lower()


def test_unknown_recipe_name_suggests() -> None:
    with pytest.raises(FileNotFoundError, match="Did you mean 'tiny'"):
        find_recipe_file("tinny", REPO / "recipes")


def test_resolved_recipe_round_trip_and_tamper_detection(tmp_path: Path) -> None:
    loaded = load_recipe(TINY, overrides=["trainer.seed=11"])
    path = write_resolved(loaded, tmp_path / "job", REPO)
    resolved = load_resolved(path)
    assert resolved.digest == loaded.digest and resolved.recipe.trainer.seed == 11
    assert resolved.overrides == ["trainer.seed=11"]
    assert resolved.resolve_path("recipes/tiny.yaml") == REPO / "recipes" / "tiny.yaml"
    payload = json.loads(path.read_text())
    payload["recipe"]["trainer"]["seed"] = 12
    path.write_text(json.dumps(payload))
    with pytest.raises(RecipeError, match="edited after resolution"):
        load_resolved(path)
    assert not list((tmp_path / "job").glob(".*tmp*")), "no temporary file left behind"


def test_digest_is_machine_independent() -> None:
    # Relative paths stay relative in the digest: the same recipe hashes the same on any checkout.
    loaded = load_recipe(TINY)
    assert loaded.recipe.capture.target_path == ".cache/tiny/target"
    assert loaded.digest == load_recipe(TINY).digest


def test_set_values_follow_the_field_type() -> None:
    recipe = load_recipe(
        TINY,
        overrides=[
            "data.expected_sha256=" + "0" * 64,  # digits stay text for a text field
            "capture.sglang.extra_args=[--log-level, debug]",  # a list stays a list
            "trainer.checkpoint.init_from=null",  # null clears an optional text field
            "job.partition=123",
        ],
    ).recipe
    assert recipe.data.expected_sha256 == "0" * 64 and recipe.job.partition == "123"
    assert recipe.capture.sglang.extra_args == ["--log-level", "debug"]
    assert recipe.trainer.checkpoint.init_from is None


def test_expert_streaming_knobs_are_checked_with_both_numbers() -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(K3, overrides=["capture.expert_streaming.gpu_budget_bytes=3GB"])
    message = _problems(info.value)["capture.expert_streaming.gpu_budget_bytes"]
    assert "3.00 GB per GPU, below the 3 streaming buffers" in message and "= 5.91 GB" in message
    with pytest.raises(RecipeError) as info:
        load_recipe(K3, overrides=["capture.expert_streaming.resident_fraction=0.5"])
    assert "sets both gpu_budget_bytes and resident_fraction" in _problems(info.value)["capture.expert_streaming"]
    with pytest.raises(RecipeError) as info:  # a small budget streams more experts than the host holds
        load_recipe(K3, overrides=["capture.expert_streaming.gpu_budget_bytes=20GB"])
    message = _problems(info.value)["plan.capture_host_memory_bytes"]
    assert "2,199.02 GB" in message and "streamed experts 1,339.67 GB" in message and "= 2,439.19 GB" in message
    # the same budget fits once the Mooncake segment moves to the trainer node
    moved = load_recipe(
        K3, overrides=["capture.expert_streaming.gpu_budget_bytes=20GB", "transport.segment_placement=trainer"]
    )
    assert moved.recipe.transport.segment_placement == "trainer"
    with pytest.raises(RecipeError) as info:
        load_recipe(K3, overrides=["capture.expert_streaming.prefetch_layers=0"])
    assert "capture.expert_streaming.prefetch_layers" in _problems(info.value)


@pytest.mark.parametrize(
    ("item", "named"),
    [
        ("job.setup=['export WANDB_API_KEY=abc123']", "WANDB_API_KEY"),
        ("job.setup=['HF_TOKEN=hf_abcdef python3 x.py']", "HF_TOKEN"),
        ("capture.sglang.extra_args=['--api-key', 'sk-123']", "--api-key"),
        ("job.setup=['python3 serve.py --api-key sk-123']", "--api-key"),
    ],
)
def test_a_credential_written_into_any_string_of_the_recipe_is_refused(item: str, named: str) -> None:
    """Not only job.env names: a setup line or an argument (the flag and its value may be two list
    elements) that writes a credential down is refused at load time, naming the field; a reference to
    the environment ($HF_TOKEN) is fine."""
    with pytest.raises(RecipeError, match=rf"{re.escape(named)} with a literal value") as err:
        load_recipe(REPO / "recipes" / "tiny.yaml", [item])
    assert item.split("=", 1)[0] in str(err.value) and "export it in the submitting shell" in str(err.value)
    assert "has 1 problem" in str(err.value), "one mistake, one problem"
    load_recipe(
        REPO / "recipes" / "tiny.yaml", ["job.setup=['export HF_TOKEN=$HF_TOKEN', 'echo ${WANDB_API_KEY:+set}']"]
    )
