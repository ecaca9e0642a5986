"""The speculative decoder and its figures (runtime/evaluate), on a toy target and draft.

Lossless with greedy verification: the output equals the target's own greedy decoding token for
token, whatever the draft proposes (a random draft, and a scripted one that is right for exactly k
slots, so every acceptance length 0..S and every rollback is exercised). The draft's proposals
equal the trainer's teacher-forced forward at the same anchors. The rules, figures, eval sets and
draft sources are checked on their own; the sampled rule's distribution test is in
tests/test_evaluate_sampling.py, the whole command on the tiny run in tests/test_evaluate_tiny.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime.evaluate.decoder import Generation, VerifyRecord, plain_generate, speculative_generate
from runtime.evaluate.draft import Proposal, draft_config_from_export
from runtime.evaluate.eval_sets import EvalSetError, file_sha256, load_prompts
from runtime.evaluate.report import greedy_agreement, pass_figures
from runtime.evaluate.settings import EvalSetFile
from runtime.evaluate.verify import greedy_accept, sampled_accept
from runtime.recipe import load_recipe
from runtime.shared.acceptance_length import LEGACY_POOLED_KEY, MEAN_OF_DECODES_KEY, POOLED_KEY
from runtime.shared.checkpoint_folders import DraftSourceError, resolve_draft_source
from runtime.trainer.layout import BlockLayout
from tests.conftest import REPO_ROOT
from tests.support.toy_spec import toy_pair

VOCAB = 24
BLOCK = 4
STOP = {VOCAB - 2}


def _logits_for(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    rows = torch.full((len(tokens), vocab), -5.0)
    for i, token in enumerate(tokens):
        rows[i, token] = 5.0
    return rows


def test_greedy_accept_takes_the_longest_matching_prefix_and_the_targets_next_token() -> None:
    # target argmax after each prefix: 3, 1, 4, 1, 5
    target = _logits_for([3, 1, 4, 1, 5])
    assert greedy_accept(torch.tensor([3, 1, 4, 1]), target) == (4, 5)
    assert greedy_accept(torch.tensor([3, 1, 0, 1]), target) == (2, 4)  # a later match does not count
    assert greedy_accept(torch.tensor([2, 1, 4, 1]), target) == (0, 3)
    with pytest.raises(ValueError, match="S \\+ 1 target rows"):
        greedy_accept(torch.tensor([3, 1, 4]), target)


def test_sampled_accept_follows_the_probability_ratio() -> None:
    generator = torch.Generator().manual_seed(0)
    # p >= q on the drafted tokens: always accepted, then the last row gives the token
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.0, 0.8]])
    assert sampled_accept(torch.tensor([1, 2]), q, p, generator) == (2, 0)
    # p = 0 on the drafted token: always rejected, and the token comes from max(p - q, 0)
    p = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.9, 0.1, 0.0]])
    assert sampled_accept(torch.tensor([0]), q, p, generator) == (0, 2)


def test_greedy_speculative_output_is_the_targets_greedy_output() -> None:
    pair = toy_pair(VOCAB, BLOCK, seed=3, logit_scale=4.0)
    prompts = [[1, 5, 7], [2], [9, 3, 3, 8, 1, 4], [11, 12, 13, 14]]
    for prompt in prompts:
        spec = speculative_generate(
            pair.target,
            pair.proposer,
            "p",
            prompt,
            max_new_tokens=30,
            temperature=0.0,
            stop_ids=STOP,
            generator=torch.Generator().manual_seed(0),
        )
        plain = plain_generate(
            pair.target,
            "p",
            prompt,
            max_new_tokens=30,
            temperature=0.0,
            stop_ids=STOP,
            generator=torch.Generator().manual_seed(0),
        )
        assert spec.output_ids == plain.output_ids, prompt
        assert spec.stopped_by == plain.stopped_by
        assert sum(s.accepted + 1 for s in spec.steps) >= len(spec.output_ids) - 1  # every token was committed


class _ScriptedProposer:
    """Proposes the target's true greedy continuation for the first ``right`` slots of every block
    and a wrong token after that: every verify step must accept exactly ``right`` tokens."""

    def __init__(self, real: object, truth: list[int], prompt_length: int, right: int) -> None:
        self.real, self.truth, self.prompt_length, self.right = real, truth, prompt_length, right
        self.block_size = BLOCK
        self.model = real.model  # type: ignore[attr-defined]
        self.position = 0

    def reset(self, aux: torch.Tensor) -> None:
        self.position = aux.shape[0]

    def append(self, aux: torch.Tensor) -> None:
        self.position += aux.shape[0]

    def propose(self, anchor_token: int, temperature: float, generator: torch.Generator) -> Proposal:
        start = self.position - self.prompt_length + 1  # index in ``truth`` of the token after the anchor
        tokens = []
        for k in range(BLOCK):
            true = self.truth[start + k] if start + k < len(self.truth) else 0
            tokens.append(true if k < self.right else (true + 1) % (VOCAB - 3))
        return Proposal(tokens=torch.tensor(tokens), probs=None, confidence=[0.5] * BLOCK)


@pytest.mark.parametrize("right", range(BLOCK + 1))
def test_every_acceptance_length_commits_the_right_tokens_and_rolls_the_cache_back(right: int) -> None:
    pair = toy_pair(VOCAB, BLOCK, seed=4, logit_scale=4.0)
    prompt = [3, 1, 4, 1, 5]
    truth = plain_generate(
        pair.target,
        "p",
        prompt,
        max_new_tokens=40,
        temperature=0.0,
        stop_ids=set(),
        generator=torch.Generator(),
    ).output_ids
    scripted = _ScriptedProposer(pair.proposer, truth, len(prompt), right)
    spec = speculative_generate(
        pair.target,
        scripted,
        "p",
        prompt,
        max_new_tokens=40,
        temperature=0.0,
        stop_ids=set(),  # type: ignore[arg-type]
        generator=torch.Generator(),
    )
    assert spec.output_ids == truth
    # (the last step may run past the 40 known tokens, where the script guesses)
    assert [s.accepted for s in spec.steps[:-1]] == [right] * (len(spec.steps) - 1)
    assert len(spec.steps) >= 40 // (right + 1) - 1


def test_acceptance_length_counts_committed_tokens_not_those_after_the_stop() -> None:
    """A draft right in every slot; the stop token is the third output token. The decode commits the
    prefill's token and two more, the stop included, in one verify step: 3 tokens per verify step, as
    SGLang counts it (completion_tokens / spec_verify_ct). The step offered 5 (4 drafted + the
    target's own); the two after the stop are never emitted and do not count. The same decode as
    SGLang answers it gives the same figure on the SGLang route."""
    from runtime.evaluate.decodes import generation_lines
    from runtime.evaluate.eval_sets import Prompt
    from runtime.evaluate.sglang_route import RequestOutcome, outcome_figures

    pair = toy_pair(VOCAB, BLOCK, seed=4, logit_scale=4.0)
    prompt = [3, 1, 4, 1, 5]
    truth = plain_generate(
        pair.target, "p", prompt, max_new_tokens=40, temperature=0.0, stop_ids=set(), generator=torch.Generator()
    ).output_ids
    stop = next(i for i in range(2, len(truth)) if truth[i] not in truth[:i])
    spec = speculative_generate(
        pair.target,
        _ScriptedProposer(pair.proposer, truth, len(prompt), BLOCK),
        "p",
        prompt,
        max_new_tokens=40,
        temperature=0.0,
        stop_ids={truth[stop]},  # type: ignore[arg-type]
        generator=torch.Generator(),
    )
    assert spec.output_ids == truth[: stop + 1] and spec.stopped_by == "stop_token"
    steps = len(spec.steps)
    figures = pass_figures([spec], block_size=BLOCK)
    assert figures[POOLED_KEY] == figures[MEAN_OF_DECODES_KEY] == pytest.approx((stop + 1) / steps)  # one decode
    assert figures[POOLED_KEY] < sum(s.accepted + 1 for s in spec.steps) / steps  # offered > emitted
    (line,) = generation_lines(0.0, "d", "s", [Prompt("p", prompt)], [spec])
    assert line["acceptance_length"] == figures[POOLED_KEY] and line["output_ids"] == spec.output_ids

    # SGLang 0.5.23's answer for this decode: meta_info as its tokenizer manager writes it
    meta = {"completion_tokens": stop + 1, "spec_verify_ct": steps, "spec_accept_length": (stop + 1) / steps}
    histogram = [0] * (BLOCK + 1)
    for record in spec.steps:
        histogram[record.accepted] += 1
    outcome = RequestOutcome("p", spec.output_ids, meta["completion_tokens"], meta["spec_verify_ct"], histogram, 0.1)
    served = outcome_figures([outcome], block_size=BLOCK, wall_s=0.1)
    assert served[POOLED_KEY] == figures[POOLED_KEY] == pytest.approx(meta["spec_accept_length"])
    assert served[MEAN_OF_DECODES_KEY] == figures[MEAN_OF_DECODES_KEY]
    assert [s["accept_rate"] for s in served["slots"]] == [s["accept_rate"] for s in figures["slots"]]


def test_the_drafts_proposal_equals_the_trainers_teacher_forced_forward() -> None:
    """At an anchor, the decoder's greedy block (Markov head fed the drafted tokens) equals the
    trainer's forward over the full sequence (block mask, Markov head fed the true tokens) wherever
    the drafted prefix is the true one."""
    pair = toy_pair(VOCAB, BLOCK, seed=5)
    draft = pair.proposer.model
    ids = torch.tensor([1, 7, 3, 9, 2, 2, 5, 11, 6, 4, 8, 10])
    features = pair.target.features(ids.tolist())
    for anchor in (3, 6, 7):
        pair.proposer.reset(features.hs[:anchor])
        proposal = pair.proposer.propose(int(ids[anchor]), 0.0, torch.Generator())
        positions = anchor + torch.arange(BLOCK)
        prev = torch.cat([ids[anchor : anchor + 1], proposal.tokens[:-1]])[None]
        slots = torch.full((1, BLOCK), draft.cfg.mask_token_id)
        slots[0, 0] = ids[anchor]
        zeros = torch.zeros((1, BLOCK), dtype=torch.int64)
        layout = BlockLayout(
            anchors=torch.tensor([anchor]),
            keep=torch.tensor([True]),
            slot_token_ids=slots,
            positions=positions[None],
            labels=zeros,
            teacher_index=zeros,
            prev_tokens=prev,
            eval_mask=torch.ones((1, BLOCK), dtype=torch.bool),
            weights=torch.ones((1, BLOCK)),
            supervised_rows=torch.arange(BLOCK),
            weight_sum=float(BLOCK),
            num_eligible=1,
            seq_len=len(ids),
        )
        with torch.no_grad():
            hidden = draft.draft_hidden(features.hs, layout)
            latent, embedded = draft.markov_head(prev, hidden)
            logits = hidden[0] @ draft.lm_head_weight.t() + latent[0] @ draft.markov_head.markov_w2.weight.t()
            confidence = torch.sigmoid(draft.confidence_head(hidden, embedded))[0]
        assert logits.argmax(-1).tolist() == proposal.tokens.tolist()
        assert torch.allclose(confidence, torch.tensor(proposal.confidence), atol=1e-5)


def _generation(accepted: list[int], confidence: list[float] | None, tokens: int = 5) -> Generation:
    steps = [VerifyRecord(a, confidence) for a in accepted]
    return Generation("g", list(range(tokens)), 0.5, steps, "stop_token")


def test_pass_figures_count_acceptance_length_per_slot_rates_and_calibration() -> None:
    gens = [_generation([0, 2, 3], [0.9, 0.5, 0.25]), _generation([1], [0.9, 0.5, 0.25], tokens=3)]
    figures = pass_figures(gens, block_size=3)
    assert figures["verify_steps"] == 4
    # committed tokens (5 + 3) per verify step: what was emitted, not what the steps offered (1+3+4+2)
    assert figures[POOLED_KEY] == pytest.approx(8 / 4)
    # each decode's own figure (5/3 and 3/1), averaged: the short decode weighs as much as the long one
    assert figures[MEAN_OF_DECODES_KEY] == pytest.approx((5 / 3 + 3 / 1) / 2)
    slots = figures["slots"]
    # slot 1 verified in all 4 steps, accepted in 3; slot 2 reached 3 times, accepted 2; slot 3: 2 and 1
    assert [(s["reached"], s["accept_rate"]) for s in slots] == [(4, 0.75), (3, pytest.approx(2 / 3)), (2, 0.5)]
    assert [s["cumulative_rate"] for s in slots] == [0.75, 0.5, 0.25]
    assert slots[0]["mean_confidence"] == pytest.approx(0.9)
    assert figures["generated_tokens"] == 8 and figures["tokens_per_s"] == pytest.approx(8.0)
    bins = {b["predicted_low"]: b for b in figures["calibration_bins"] if b["count"]}
    assert bins[0.9]["count"] == 4 and bins[0.9]["observed"] == 0.75
    assert figures["expected_calibration_error"] == pytest.approx((0.6 + 0.5 + 0.5) / 9, abs=1e-6)
    assert "calibration_bins" not in pass_figures([_generation([1], None)], block_size=3)


def test_greedy_agreement_names_the_prompts_that_differ() -> None:
    same, other = Generation("a", [1, 2], 0.1), Generation("b", [1, 3], 0.1)
    verdict = greedy_agreement([same, other], [Generation("a", [1, 2], 0.1), Generation("b", [1, 2], 0.1)])
    assert verdict == {"prompts": 2, "identical": 1, "differing": ["b"]}


def _eval_set(path: Path, sha: str | None = None, index: int = 0) -> EvalSetFile:
    return EvalSetFile(name="s", index=index, path=path, sha256=sha or file_sha256(path), max_prompts=None)


def test_eval_sets_are_pinned_and_bad_rows_are_named(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "input_ids": [1, 2, 3]}\n\n{"input_ids": [4]}\n')
    prompts = load_prompts(_eval_set(path), None, vocab_size=8)
    assert [(p.prompt_id, p.input_ids) for p in prompts] == [("a", [1, 2, 3]), ("row-1", [4])]
    with pytest.raises(EvalSetError, match=r"eval.sets\[0\].sha256: .* hashes to [0-9a-f]{64}, the recipe pins 0{64}"):
        load_prompts(_eval_set(path, "0" * 64), None, vocab_size=8)
    with pytest.raises(EvalSetError, match=r"eval.sets\[2\].path: .*missing.jsonl does not exist"):
        load_prompts(_eval_set(tmp_path / "missing.jsonl", "0" * 64, index=2), None, 8)
    for text, message in (
        ('{"input_ids": [1, 99]}\n', r"prompts.jsonl:1: input_ids must be .* token ids in 0..7"),
        ("not json\n", r"prompts.jsonl:1: not valid JSON"),
        ('{"id": "x"}\n', r"prompts.jsonl:1: the row has neither conversations nor input_ids"),
        ('{"conversations": [{"role": "user", "content": "hi"}]}\n', r"needs the target's tokenizer"),
    ):
        path.write_text(text)
        with pytest.raises(EvalSetError, match=message):
            load_prompts(_eval_set(path), None, vocab_size=8)


def test_a_conversation_prompt_drops_the_reference_answer_and_adds_the_generation_prompt(tiny_assets: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets / "target")
    path = tiny_assets / "data" / "eval.jsonl"
    prompts = load_prompts(_eval_set(path), tokenizer, vocab_size=2048)
    first = json.loads(path.read_text().splitlines()[0])["conversations"]
    text = tokenizer.decode(prompts[0].input_ids)
    assert text.endswith("<|assistant|>") and first[-1]["content"] not in text and first[0]["content"] in text


def test_draft_sources(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    for step in (8, 16):
        (checkpoints / f"step_{step:08d}").mkdir(parents=True)
        (checkpoints / f"step_{step:08d}" / "trainer_state.json").write_text("{}")
    assert resolve_draft_source("latest", checkpoints).label == "step_00000016"
    assert resolve_draft_source("8", checkpoints).step == 8
    assert resolve_draft_source("untrained", checkpoints).kind == "untrained"
    with pytest.raises(DraftSourceError, match="this run has step_00000008, step_00000016"):
        resolve_draft_source("step_4", checkpoints)
    with pytest.raises(DraftSourceError, match="holds no complete checkpoint"):
        resolve_draft_source("latest", tmp_path / "none")
    export = tmp_path / "export-step_00000016"
    export.mkdir()
    (export / "config.json").write_text("{}")
    assert resolve_draft_source(str(export), checkpoints).step == 16
    with pytest.raises(DraftSourceError, match="neither latest"):
        resolve_draft_source(str(tmp_path), checkpoints)


def test_a_draft_for_another_target_is_refused_with_every_difference(tmp_path: Path) -> None:
    from runtime.trainer.draft_spec import DraftSpec
    from runtime.trainer.export import draft_config

    recipe = load_recipe(REPO_ROOT / "recipes" / "tiny.yaml").recipe
    spec = DraftSpec.from_recipe(recipe)
    config = draft_config(spec, torch.float32)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert draft_config_from_export(path, spec) == recipe.trainer.draft
    config.update(hidden_size=512, vocab_size=4096, mask_token_id=5000)
    config["dflash_config"] = {**config["dflash_config"], "target_layer_ids": [2, 4], "mask_token_id": 5000}
    path.write_text(json.dumps(config))
    with pytest.raises(DraftSourceError) as info:
        draft_config_from_export(path, spec)
    message = str(info.value)
    for part in (
        "hidden_size is 512, the target's capture.hidden_size is 256",
        "vocab_size is 4096, the target's capture.vocab_size is 2048",
        "target_layer_ids is [2, 4], the target's capture.aux_layer_ids is [1, 3, 5]",
        "mask_token_id 5000 is not a token id",
        "Fix: evaluate it with the recipe of the target it was trained for",
    ):
        assert part in message


def test_eval_settings_do_not_change_the_training_runs_digest() -> None:
    """A job folder verifies and resumes whatever eval settings it was resolved with, or without."""
    from runtime.recipe.loader import recipe_digest

    tiny = REPO_ROOT / "recipes" / "tiny.yaml"
    base = load_recipe(tiny).recipe
    assert base.eval is not None
    same = [load_recipe(tiny, ["eval.max_new_tokens=7"]).recipe, base.model_copy(update={"eval": None})]
    assert all(recipe_digest(r) == recipe_digest(base) for r in same)
    assert recipe_digest(load_recipe(tiny, ["trainer.seed=8"]).recipe) != recipe_digest(base)


def test_the_replay_tool_recomputes_the_figures_and_names_a_difference() -> None:
    """tools/replay_decodes sums committed tokens over verify steps from decodes.jsonl's lines and names
    any figure of results.json that does not follow from them."""
    from tools.replay_decodes import recomputed_figures

    lines = [
        {"temperature": 0.0, "decoder": "d", "set": "a", "output_ids": [1, 2, 3], "verify_steps": 2},
        {"temperature": 0.0, "decoder": "d", "set": "b", "output_ids": [1, 2, 3, 4, 5], "verify_steps": 2},
        {"temperature": 0.0, "decoder": "target alone", "set": "a", "output_ids": [1, 2, 3]},
    ]
    figures = {
        "overall": {POOLED_KEY: 2.0, MEAN_OF_DECODES_KEY: 2.0},  # 8 / 4 pooled; (1.5 + 2.5) / 2 per decode
        "sets": {"a": {POOLED_KEY: 1.5, MEAN_OF_DECODES_KEY: 1.5}, "b": {POOLED_KEY: 2.5, MEAN_OF_DECODES_KEY: 2.5}},
    }
    results = {"passes": [{"temperature": 0.0, "drafts": {"d": figures}}]}
    assert recomputed_figures(results, lines) == []
    figures["sets"]["b"][POOLED_KEY] = 3.0  # e.g. counting the tokens the steps offered
    figures["overall"][MEAN_OF_DECODES_KEY] = 2.0001
    assert recomputed_figures(results, lines) == [
        "T=0 d overall: acceptance length mean of decodes: results.json says 2.0001, the 2 decodes with a verify "
        "step give 2.0",
        "T=0 d b: pooled acceptance length: results.json says 3.0, the decodes give 5 tokens / 2 verify steps = 2.5",
    ]
    # An older run's file: the pooled figure under its old name, and no mean of decodes to check.
    old = {"overall": {LEGACY_POOLED_KEY: 2.0}, "sets": {"a": {LEGACY_POOLED_KEY: 1.5}, "b": {LEGACY_POOLED_KEY: 2.5}}}
    assert recomputed_figures({"passes": [{"temperature": 0.0, "drafts": {"d": old}}]}, lines) == []


def _replay_folder(folder: Path, results: object, lines: list[object]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(results))
    (folder / "decodes.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


_GOOD_LINE = {"temperature": 0.0, "decoder": "target alone", "set": "a", "prompt_id": "p0", "prompt_ids": [1, 5, 6],
              "output_ids": [7, 2], "verify_steps": 2}  # fmt: skip
_GOOD_RESULTS = {"passes": [], "dtype": "float32", "stop_token_ids": [2], "max_new_tokens": 100000}


@pytest.mark.parametrize(
    ("results", "lines", "named"),
    [
        ([], [_GOOD_LINE], "holds a list, not an evaluation's results"),
        ({**_GOOD_RESULTS, "dtype": "save"}, [_GOOD_LINE], "'dtype' is 'save'"),
        ({**_GOOD_RESULTS, "stop_token_ids": []}, [_GOOD_LINE], "'stop_token_ids' is []"),
        (_GOOD_RESULTS, [5], "decodes.jsonl:1 is 5, not a decode"),
        (_GOOD_RESULTS, [{**_GOOD_LINE, "temperature": "abc"}], "'temperature' is 'abc'"),
        (_GOOD_RESULTS, [{**_GOOD_LINE, "output_ids": [1, "x"]}], "'output_ids' is not a list of token ids"),
    ],
)
def test_the_replay_tool_refuses_a_tampered_folder_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], results: object, lines: list[object], named: str
) -> None:
    from tools.replay_decodes import main

    folder = _replay_folder(tmp_path / "eval", results, lines)
    assert main([str(folder), "--target", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and "fix:" in err and "Traceback" not in err, err


def test_the_replay_tool_refuses_a_fifo_and_a_limit_below_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import os

    from tools.replay_decodes import main

    folder = _replay_folder(tmp_path / "eval", _GOOD_RESULTS, [_GOOD_LINE])
    assert main([str(folder), "--limit", "-30"]) == 2 and "--limit -30" in capsys.readouterr().err
    (folder / "decodes.jsonl").unlink()
    os.mkfifo(folder / "decodes.jsonl")
    assert main([str(folder)]) == 2 and "is a FIFO (named pipe)" in capsys.readouterr().err


def test_the_replay_decodes_no_further_than_the_recorded_output(tmp_path: Path) -> None:
    """A results.json whose max_new_tokens says 100000 does not make the replay decode 100000 tokens: each
    prompt is decoded at most as far as its longest recorded output (and a whole output ends at a stop)."""
    from tests.support.tiny_moe import save_tiny_moe_target, tiny_moe_config
    from tools.replay_decodes import replay_greedy

    target = save_tiny_moe_target(tmp_path / "target", tiny_moe_config(max_position_embeddings=4096))
    lines = [{**_GOOD_LINE, "output_ids": [7, 8, 9]}]  # no stop token at its end: cut short, or tampered
    never_stops = {**_GOOD_RESULTS, "stop_token_ids": [999_999]}  # no token of the vocabulary: only the cap ends it
    compared, differences = replay_greedy(never_stops, lines, target, "cpu", None)
    assert compared == 1
    (difference,) = differences
    import re

    given = int(re.search(r"transformers greedy gives (\d+)", difference).group(1))  # type: ignore[union-attr]
    assert given == 3, difference
