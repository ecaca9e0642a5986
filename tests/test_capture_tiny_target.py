"""The tiny target (tools/make_tiny_target): deterministic corpus and tokenizer, peaked trained model,
and the tiny recipe's pinned data SHA-256 equal to what the tools produce."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch

from runtime.recipe import load_recipe
from runtime.shared.data_files import sha256_file
from tests.conftest import REPO_ROOT
from tools import tiny_corpus
from tools.data_prepare import PrepareOptions, prepare
from tools.tiny_target import (
    DEFAULT_TARGET_DIR,
    TinyTargetSpec,
    build_tokenizer,
    evaluate_peakedness,
    make_tiny_target,
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


def test_tiny_recipe_pins_the_sha256_of_the_generated_data(tmp_path: Path) -> None:
    """recipes/tiny.yaml's data.expected_sha256 is what make_tiny_target + prepare_data produce."""
    from transformers import AutoTokenizer

    recipe = load_recipe(REPO_ROOT / "recipes" / "tiny.yaml").recipe
    build_tokenizer(SPEC).save_pretrained(tmp_path / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    write_chat_corpus(SPEC, tmp_path / "chat.jsonl")
    options = PrepareOptions(
        tmp_path / "chat.jsonl",
        tmp_path / "train.jsonl",
        tmp_path / "tokenizer",
        recipe.data.max_length,
        vocab_size=recipe.capture.vocab_size,
    )
    result = prepare(options, tokenizer=tokenizer, log=lambda *_: None)
    assert result.rows == recipe.data.num_rows
    assert sha256_file(options.output_path) == recipe.data.expected_sha256, (
        "the tiny data changed: update data.expected_sha256 in recipes/tiny.yaml to "
        f"{sha256_file(options.output_path)} (tools/prepare_data --recipe tiny prints it)"
    )


@pytest.mark.slow
def test_make_tiny_target_builds_a_peaked_target_and_caches_it() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    record = make_tiny_target(log=lambda *_: None)  # minutes the first time, then cached
    started = time.monotonic()
    again = make_tiny_target(log=lambda *_: None)
    assert again["cache_key"] == record["cache_key"] == SPEC.cache_key()
    assert time.monotonic() - started < 30, "a second build with nothing changed must come from the cache"
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
    # The draft trains on the target's own answers: the checked-in chat is what this target says
    # (greedy in even rows; the odd rows' samples are checked by their count of differences below).
    from transformers import AutoModelForCausalLM as _Model

    from tools.tiny_target import REGENERATED_CHAT, regenerate_answers

    target = _Model.from_pretrained(DEFAULT_TARGET_DIR, dtype=torch.float32).eval()
    corpus = tiny_corpus.generate_conversations(
        tiny_corpus.build_vocabulary(SPEC.vocab_size), 16, SPEC.chat_seed, "tiny"
    )
    checked_in = [json.loads(line) for line in REGENERATED_CHAT.read_text().splitlines()][:16]
    greedy = regenerate_answers(target, tokenizer, corpus, log=lambda *_: None)
    assert greedy[::2] == checked_in[::2], (
        "tools/tiny_chat.jsonl is not what the tiny target answers; fix: tools/make_tiny_target --regenerate-chat"
    )


def test_the_chat_rows_carry_the_corpus_prompts_and_the_targets_answers(tmp_path: Path) -> None:
    """tools/tiny_chat.jsonl keeps the corpus's prompts (refused when they differ) and carries the
    target's answers, which differ from the corpus's in most turns."""
    write_chat_corpus(SPEC, tmp_path / "chat.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "chat.jsonl").read_text().splitlines()]
    vocabulary = tiny_corpus.build_vocabulary(SPEC.vocab_size)
    corpus = tiny_corpus.generate_conversations(vocabulary, SPEC.chat_rows, SPEC.chat_seed, "tiny")
    answers = [(a["content"], b["content"]) for r, c in zip(rows, corpus, strict=True)
               for a, b in zip(r["conversations"], c["conversations"], strict=True) if a["role"] == "assistant"]  # fmt: skip
    assert sum(x != y for x, y in answers) > len(answers) // 2
    with pytest.raises(RuntimeError, match="no longer fits the tiny corpus"):
        write_chat_corpus(dataclasses.replace(SPEC, chat_seed=SPEC.chat_seed + 1), tmp_path / "other.jsonl")
