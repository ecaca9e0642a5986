"""The tiny target (tools/make_tiny_target): deterministic corpus and tokenizer, peaked trained model,
the chat corpus of the target's own answers, and the tiny recipe's data pinned through its manifest."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.recipe import load_recipe
from runtime.recipe.loader import resolve_recipe_path
from runtime.shared.data_files import resolve_expected_sha256, sha256_file, verify_data_file
from tests.conftest import REPO_ROOT
from tools import tiny_corpus
from tools.tiny_target import (
    CHAT_ANSWERS_FILE,
    DEFAULT_CHAT_PATH,
    DEFAULT_TARGET_DIR,
    TinyTargetSpec,
    evaluate_peakedness,
    make_tiny_target,
    target_answered_rows,
    write_chat_corpus,
)

SPEC = TinyTargetSpec()


def test_vocabulary_matches_the_tiny_recipe() -> None:
    vocabulary = tiny_corpus.build_vocabulary(SPEC.vocab_size)
    recipe = load_recipe(REPO_ROOT / "recipes" / "tiny.yaml").recipe
    assert len(vocabulary) == len(set(vocabulary)) == recipe.capture.vocab_size
    special = recipe.capture.special_tokens
    assert vocabulary[special.pad_id] == "<pad>" and vocabulary[special.bos_id] == "<bos>"
    assert vocabulary[special.eos_id] == "<eos>" and vocabulary[recipe.trainer.draft.mask_token_id] == "<mask>"
    assert (recipe.capture.hidden_size, recipe.capture.num_target_layers) == (SPEC.hidden_size, SPEC.num_layers)


def test_corpus_is_deterministic_and_seed_dependent() -> None:
    vocabulary = tiny_corpus.build_vocabulary(SPEC.vocab_size)
    first = tiny_corpus.generate_conversations(vocabulary, 50, seed=3)
    assert first == tiny_corpus.generate_conversations(vocabulary, 50, seed=3)
    assert first != tiny_corpus.generate_conversations(vocabulary, 50, seed=4)
    words = set(vocabulary)
    for row in first:  # every word of the corpus is a token: nothing maps to <unk>
        for turn in row["conversations"]:
            assert set(turn["content"].split()) <= words, turn


def test_cache_key_follows_the_spec() -> None:
    assert SPEC.cache_key() == TinyTargetSpec().cache_key()
    assert SPEC.cache_key() != dataclasses.replace(SPEC, train_steps=SPEC.train_steps + 1).cache_key()


def test_the_tiny_recipe_pins_its_data_through_the_manifest_prepare_data_writes(tiny_assets: Path) -> None:
    """recipes/tiny.yaml pins its data through the manifest (the data holds what the target built on this
    machine answers), and that manifest holds the prepared file's digest and the recipe's row count."""
    resolved = load_recipe(REPO_ROOT / "recipes" / "tiny.yaml")
    data = resolved.recipe.data
    assert data.expected_sha256 == "manifest"
    train_path = resolve_recipe_path(data.train_path, REPO_ROOT)
    summary = verify_data_file(
        train_path, data.expected_sha256, resolved.recipe.capture.vocab_size, data.max_length, data.num_rows
    )
    assert summary.sha256 == resolve_expected_sha256(train_path, "manifest") == sha256_file(train_path)
    assert summary.rows == data.num_rows == SPEC.chat_rows


@pytest.mark.slow
def test_make_tiny_target_builds_a_peaked_target_and_caches_it() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    record = make_tiny_target(log=lambda *_: None)  # minutes the first time, then cached
    weights = DEFAULT_TARGET_DIR / "model.safetensors"
    built = (weights.stat().st_ino, weights.stat().st_mtime_ns)
    said: list[str] = []
    again = make_tiny_target(log=lambda *parts: said.append(" ".join(map(str, parts))))
    assert again["cache_key"] == record["cache_key"] == SPEC.cache_key()
    # a second build with nothing changed comes from the cache: the same weights file, untouched
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == built
    assert any("cached:" in line for line in said), said
    config = AutoConfig.from_pretrained(DEFAULT_TARGET_DIR)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (256, 8, 2048)
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    saved = json.loads((DEFAULT_TARGET_DIR / "config.json").read_text())
    assert saved["num_experts"] == saved["num_local_experts"] == 8
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET_DIR, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TARGET_DIR)
    rows = tiny_corpus.generate_conversations(tiny_corpus.build_vocabulary(SPEC.vocab_size), 64, seed=SPEC.chat_seed)
    quality = evaluate_peakedness(model, rows, tokenizer, SPEC.max_position_embeddings)
    # A random model is right on about 1/2048 of the tokens; a peaked one on most assistant tokens.
    assert quality["assistant_top1_accuracy"] > 0.6, quality
    assert quality["assistant_mean_top1_probability"] > 0.5, quality
    # The draft trains on the target's own answers: the chat corpus written with the target is what the
    # saved target says (greedy in even rows; the odd rows are seeded samples), decoded here as then.
    written = [json.loads(line) for line in DEFAULT_CHAT_PATH.read_text().splitlines()]
    assert written == target_answered_rows(model, tokenizer, SPEC, log=lambda *_: None), (
        f"{DEFAULT_CHAT_PATH} is not what the tiny target answers; fix: tools/make_tiny_target --force"
    )


def test_the_chat_rows_carry_the_corpus_prompts_and_the_targets_answers(tiny_assets: Path, tmp_path: Path) -> None:
    """The chat corpus keeps the corpus's prompts and carries the target's answers, which differ from the
    corpus's in most turns; a cached target folder without its answers gets them decoded again, the same
    bytes."""
    write_chat_corpus(SPEC, tmp_path / "chat.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "chat.jsonl").read_text().splitlines()]
    vocabulary = tiny_corpus.build_vocabulary(SPEC.vocab_size)
    corpus = tiny_corpus.generate_conversations(vocabulary, SPEC.chat_rows, SPEC.chat_seed, "tiny")

    def prompts(row: dict[str, Any]) -> list[Any]:
        return [row["id"], *(turn for turn in row["conversations"] if turn["role"] != "assistant")]

    assert [prompts(r) for r in rows] == [prompts(r) for r in corpus]
    answers = [(a["content"], b["content"]) for r, c in zip(rows, corpus, strict=True)
               for a, b in zip(r["conversations"], c["conversations"], strict=True) if a["role"] == "assistant"]  # fmt: skip
    assert sum(x != y for x, y in answers) > len(answers) // 2
    copy = shutil.copytree(DEFAULT_TARGET_DIR, tmp_path / "target")
    (copy / CHAT_ANSWERS_FILE).unlink()
    write_chat_corpus(SPEC, tmp_path / "again.jsonl", copy, log=lambda *_: None)
    assert (tmp_path / "again.jsonl").read_bytes() == (tmp_path / "chat.jsonl").read_bytes()
