"""Build the tiny MoE target of ``recipes/tiny.yaml``: a Qwen3-MoE causal LM in Hugging Face format
with a word-level tokenizer made here (no hub download), trained briefly on the generated structured
chat corpus of :mod:`tools.tiny_corpus` so that its next-token distributions are peaked.

Also writes the tiny chat JSONL (``data.chat_path`` of the tiny recipe) that ``tools/prepare_data``
tokenizes: the corpus prompts with this target's own answers, since a draft must learn what its target
says, and the held-out eval prompts. The answers are decoded once per build, by the target that was built
(:data:`PINNED_ARITHMETIC` keeps it the same on every thread count; another torch release builds another
target), since a draft trained on another target's answers accepts less. The target is cached by a content hash of
the build spec: a second run with nothing changed returns at once.

Usage: ``tools/make_tiny_target [--world tiny|one_gpu] [--out .cache/WORLD/target] [--chat-out .cache/WORLD/data/chat.jsonl]``
(``one_gpu`` builds the larger world of ``recipes/one_gpu.yaml`` on a CUDA GPU.)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.files import atomic_write_text, exclusive_lock
from runtime.shared import chat_tokenize
from runtime.shared.data_files import write_rows
from runtime.shared.gpu_presence import require_gpu
from runtime.user_errors import UserError, output_place, require_regular_file, run_command
from tools import tiny_corpus

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TARGET_DIR = REPO_ROOT / ".cache/tiny/target"
"""Where ``recipes/tiny.yaml`` (``capture.target_path``) expects the target."""
DEFAULT_CHAT_PATH = REPO_ROOT / ".cache/tiny/data/chat.jsonl"
"""Where ``recipes/tiny.yaml`` (``data.chat_path``) expects the chat corpus."""
DEFAULT_EVAL_PATH = REPO_ROOT / ".cache/tiny/data/eval.jsonl"
"""Where ``recipes/tiny.yaml`` (``eval.sets``) expects the held-out eval prompts."""
EVAL_SEED = 9001
"""Seed of the eval conversations: neither the target's training corpus nor the draft's chat rows
use it, so the eval prompts are held out from both (same tasks, other draws)."""
EVAL_ROWS = 32
BUILD_FILE = "build.json"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} <|end|> "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
"""Plain-text turns: ``<|role|> content <|end|>``; the generation prompt is ``<|assistant|>``."""
PROGRESS_INTERVAL_S = 5.0
"""A build prints a progress line at least this often (tokenizing, training, evaluating)."""
BUILD_PROCEDURE_VERSION = 3
"""Bump when the code that turns the content into a model changes (model class, training loop,
tokenizer construction, the pinned arithmetic): the cache key covers the content itself, not the
source text."""
PINNED_ARITHMETIC = {
    # One thread: a reduction split over threads sums in another order on every thread count.
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # MKL's conditional numerical reproducibility: the same code path (and so the same rounding) on
    # every x86-64 CPU, Intel or AMD, whatever vector units it has.
    "MKL_CBWR": "COMPATIBLE",
    # torch's own vectorised kernels (softmax, norms, exp) and oneDNN at AVX2 width on every CPU
    # that has it; a wider vector adds partial sums in another order.
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
"""The arithmetic the build runs under, set before torch loads (:func:`pin_arithmetic`), so that the tiny
target, and with it its answers and the default run's acceptance lengths, do not depend on the thread
count or the vector width of the machine that builds it (one model per torch release, not one per
machine; another CPU with the same release is not tried yet, another release builds other bytes). It
also makes a build cost one core, so builds that share a machine do not oversubscribe it."""


@dataclass(frozen=True)
class TinyTargetSpec:
    """Everything that determines the tiny target and its chat corpus."""

    vocab_size: int = 2048
    hidden_size: int = 256
    num_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    # Narrow heads and experts (the recipe fixes only hidden size, layers, vocabulary and the expert
    # counts): the build must finish in under a minute on 2 cores and its answers still be peaked.
    head_dim: int = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-6
    init_seed: int = 1234
    train_corpus_seed: int = 1001
    train_conversations: int = 2500
    train_steps: int = 100
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 8
    chat_seed: int = 7
    chat_rows: int = 128
    device: str = "cpu"
    """Where the target is trained and answers: ``cpu`` or ``cuda`` (the one-GPU world)."""
    train_dtype: str = "float32"
    """Autocast dtype of the training forward on ``cuda`` (``bfloat16``); the CPU trains in float32."""

    def cache_key(self) -> str:
        """SHA-256 of everything the build consumes: this spec, the vocabulary, the chat template,
        the training and chat conversations, and :data:`BUILD_PROCEDURE_VERSION`."""
        vocabulary = tiny_corpus.build_vocabulary(self.vocab_size)
        content = {
            "procedure": BUILD_PROCEDURE_VERSION,
            "spec": dataclasses.asdict(self),
            "vocabulary": vocabulary,
            "chat_template": CHAT_TEMPLATE,
            "train": tiny_corpus.generate_conversations(
                vocabulary, self.train_conversations, self.train_corpus_seed, "train"
            ),
            "chat": tiny_corpus.generate_conversations(vocabulary, self.chat_rows, self.chat_seed, "tiny"),
        }
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


WORLDS: dict[str, TinyTargetSpec] = {
    "tiny": TinyTargetSpec(),
    # The one-GPU world (recipes/one_gpu.yaml): the same corpus and vocabulary, a target of 470M
    # parameters (60M active: 32 experts, 4 per token) and 1,024 answered rows for the draft, trained
    # under bf16 autocast on the GPU. On one H100, 500 steps took 284 s at 1.96 steps/s (assistant top-1
    # accuracy 0.998; the loss was below 0.1 from step 200 on); these 250 steps 146.5 s, accuracy 0.985.
    "one_gpu": TinyTargetSpec(
        hidden_size=768,
        num_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=768,
        train_conversations=8000,
        train_steps=250,
        batch_size=64,
        learning_rate=1e-3,
        warmup_steps=20,
        chat_rows=1024,
        device="cuda",
        train_dtype="bfloat16",
    ),
}
"""The worlds ``--world`` builds, each into ``.cache/<world>/`` (the recipe of the same name reads it)."""


def world_paths(world: str) -> tuple[Path, Path, Path]:
    """The default target folder, chat file and eval file of ``world`` (what its recipe expects)."""
    root = REPO_ROOT / ".cache" / world
    return root / "target", root / "data" / "chat.jsonl", root / "data" / "eval.jsonl"


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------


def build_tokenizer(spec: TinyTargetSpec) -> Any:
    """A word-level fast tokenizer over the generated vocabulary, with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = tiny_corpus.build_vocabulary(spec.vocab_size)
    core = Tokenizer(models.WordLevel({word: index for index, word in enumerate(vocabulary)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Decode word-level tokens back to space-separated text (what the corpus looks like).
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        additional_special_tokens=list(tiny_corpus.SPECIAL_TOKENS[5:]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# ----------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------


def build_config(spec: TinyTargetSpec) -> Any:
    """The Qwen3-MoE config of the tiny target (every layer sparse)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=2 * spec.hidden_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        bos_token_id=tiny_corpus.BOS_ID,
        eos_token_id=tiny_corpus.EOS_ID,
        pad_token_id=tiny_corpus.PAD_ID,
        tie_word_embeddings=False,
    )


def _batches(
    samples: list[tuple[list[int], list[int]]], batch_size: int, steps: int, seed: int
) -> Iterator[tuple[Any, Any, Any]]:
    """``steps`` right-padded batches (input ids, attention mask, labels) drawn by a seeded generator.

    Labels keep only assistant tokens: the answers are what must become predictable, and the user
    turns are random words no model can predict. Samples are drawn in groups of eight batches and
    sorted by length inside a group so that padding (pure waste on two cores) stays small.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    group = 8
    emitted = 0
    while emitted < steps:
        picks = torch.randint(len(samples), (batch_size * group,), generator=generator).tolist()
        picks.sort(key=lambda index: len(samples[index][0]))
        order = torch.randperm(group, generator=generator).tolist()
        for slot in order:
            if emitted == steps:
                return
            chosen = [samples[i] for i in picks[slot * batch_size : (slot + 1) * batch_size]]
            width = max(len(ids) for ids, _ in chosen)
            ids = torch.full((batch_size, width), tiny_corpus.PAD_ID, dtype=torch.long)
            attention = torch.zeros((batch_size, width), dtype=torch.long)
            labels = torch.full((batch_size, width), -100, dtype=torch.long)
            for row, (sequence, mask) in enumerate(chosen):
                ids[row, : len(sequence)] = torch.tensor(sequence)
                attention[row, : len(sequence)] = 1
                keep = torch.tensor(mask, dtype=torch.bool)
                labels[row, : len(sequence)] = torch.tensor(sequence).masked_fill(~keep, -100)
            emitted += 1
            yield ids, attention, labels


class _Progress:
    """Progress lines at most every ``interval_s`` (a user waiting on a build sees it move)."""

    def __init__(self, log: Any, interval_s: float = PROGRESS_INTERVAL_S) -> None:
        self.log = log
        self.interval_s = interval_s
        self.last = time.monotonic()

    def maybe(self, message: str, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last >= self.interval_s:
            self.log(f"[make_tiny_target] {message}")
            self.last = now


def _assistant_loss(model: Any, ids: Any, attention: Any, labels: Any) -> Any:
    """The causal-LM loss of ``model(..., labels=labels)``, with the vocabulary projection computed only
    at the positions that have a label (about half of them: the user turns carry none); a third of a
    step's FLOPs at this size."""
    import torch.nn.functional as F

    hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    keep = targets != -100
    return F.cross_entropy(model.lm_head(hidden[keep]).float(), targets[keep])


def train_model(spec: TinyTargetSpec, tokenizer: Any, log: Any = print) -> Any:
    """Initialise the tiny target from ``init_seed`` and train it on the generated corpus."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(spec.init_seed)
    # The per-expert loop: on a CPU it is 2-3x faster than transformers' default grouped_mm fallback
    # (same function, same losses; measured on 2 cores, tiny shapes). On a GPU its linears run under
    # autocast in bf16 over fp32 master weights; grouped_mm is not autocast-enabled (it would cast the
    # activations up to the fp32 weights).
    model = Qwen3MoeForCausalLM._from_config(build_config(spec), experts_implementation="eager").to(spec.device)
    vocabulary = tiny_corpus.build_vocabulary(spec.vocab_size)
    conversations = tiny_corpus.generate_conversations(
        vocabulary, spec.train_conversations, spec.train_corpus_seed, id_prefix="train"
    )
    progress = _Progress(log)
    progress.maybe(f"tokenizing the training corpus: {len(conversations)} conversations", force=True)
    samples = []
    for index, row in enumerate(conversations):
        chat = chat_tokenize.tokenize_chat(tokenizer, row["conversations"], row["id"], spec.max_position_embeddings)
        samples.append((chat.input_ids, chat.loss_mask))
        progress.maybe(f"tokenizing the training corpus: {index + 1}/{len(conversations)} conversations")
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, betas=(0.9, 0.98), weight_decay=0.0)

    def lr_factor(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        progress = (step - spec.warmup_steps) / max(1, spec.train_steps - spec.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    started = time.monotonic()
    for step, (ids, attention, labels) in enumerate(
        _batches(samples, spec.batch_size, spec.train_steps, spec.init_seed)
    ):
        ids, attention, labels = (t.to(spec.device, non_blocking=True) for t in (ids, attention, labels))
        with torch.autocast(spec.device, dtype=getattr(torch, spec.train_dtype), enabled=spec.device != "cpu"):
            loss = _assistant_loss(model, ids, attention, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        rate = done / (time.monotonic() - started)
        progress.maybe(
            f"training: step {done}/{spec.train_steps} loss {loss.item():.3f}, {rate:.2f} steps/s, "
            f"ETA {(spec.train_steps - done) / rate:.0f} s",
            force=done == spec.train_steps,
        )
    model.eval()
    return model


END_OF_TURN = "<|end|>"
REGENERATE_MAX_NEW_TOKENS = 64
"""Longest regenerated answer (the longest corpus answer is 38 tokens)."""


def regenerate_answers(
    model: Any, tokenizer: Any, rows: list[dict[str, Any]], log: Any = print, sample_seed: int | None = None
) -> list[dict[str, Any]]:
    """``rows`` with every assistant turn replaced by the target's own greedy answer to the conversation so
    far (its earlier answers included), what a draft must learn to propose: the target's behaviour, not
    the corpus author's. Turn by turn, batched over the rows (left-padded), on the CPU in seconds."""
    import torch

    end_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    out = [{**row, "conversations": [dict(turn) for turn in row["conversations"]]} for row in rows]
    answers = [[i for i, turn in enumerate(row["conversations"]) if turn["role"] == "assistant"] for row in out]
    rounds = max((len(a) for a in answers), default=0)
    for round_index in range(rounds):
        todo = [(r, a[round_index]) for r, a in enumerate(answers) if len(a) > round_index]
        prompts = [
            chat_tokenize.tokenize_prompt(tokenizer, out[r]["conversations"][:turn], out[r]["id"]) for r, turn in todo
        ]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tiny_corpus.PAD_ID, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention[row, width - len(prompt) :] = 1
        if sample_seed is not None:
            torch.manual_seed(sample_seed + round_index)
        device = next(model.parameters()).device
        with torch.no_grad():
            generated = model.generate(
                input_ids=ids.to(device),
                attention_mask=attention.to(device),
                max_new_tokens=REGENERATE_MAX_NEW_TOKENS,
                do_sample=sample_seed is not None,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                eos_token_id=[end_id, tiny_corpus.EOS_ID],
                pad_token_id=tiny_corpus.PAD_ID,
            )[:, width:].cpu()
        for (r, turn), tokens in zip(todo, generated.tolist(), strict=True):
            stop = next(
                (i for i, t in enumerate(tokens) if t in (end_id, tiny_corpus.EOS_ID, tiny_corpus.PAD_ID)), len(tokens)
            )
            out[r]["conversations"][turn]["content"] = tokenizer.decode(tokens[:stop]).strip()
        how = "greedy" if sample_seed is None else "sampled at temperature 1"
        log(
            f"[make_tiny_target] {how} answers: turn {round_index + 1} of {rounds} answered in {len(todo)} "
            "conversations"
        )
    return out


def evaluate_peakedness(
    model: Any, rows: list[dict[str, Any]], tokenizer: Any, max_length: int, batch_size: int = 32
) -> dict[str, float]:
    """Top-1 accuracy and mean top-1 probability of the target on the assistant tokens of ``rows``
    (right-padded batches: causal attention keeps every real position exact)."""
    import torch

    chats = [chat_tokenize.tokenize_chat(tokenizer, row["conversations"], row["id"], max_length) for row in rows]
    correct = total = 0
    top_probability = 0.0
    with torch.no_grad():
        for first in range(0, len(chats), batch_size):
            group = chats[first : first + batch_size]
            width = max(len(chat.input_ids) for chat in group)
            ids = torch.full((len(group), width), tiny_corpus.PAD_ID, dtype=torch.long)
            scored = torch.zeros((len(group), width), dtype=torch.bool)
            for row, chat in enumerate(group):
                ids[row, : len(chat.input_ids)] = torch.tensor(chat.input_ids)
                scored[row, : len(chat.input_ids)] = torch.tensor(chat.loss_mask, dtype=torch.bool)
            attention = (torch.arange(width)[None, :] < torch.tensor([len(c.input_ids) for c in group])[:, None]).long()
            device = next(model.parameters()).device
            logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits[:, :-1].cpu()
            on_assistant = scored[:, 1:]
            best_p, best = logits[on_assistant].float().softmax(-1).max(-1)
            correct += int((best == ids[:, 1:][on_assistant]).sum())
            top_probability += float(best_p.sum())
            total += int(on_assistant.sum())
    return {"assistant_top1_accuracy": correct / total, "assistant_mean_top1_probability": top_probability / total}


# ----------------------------------------------------------------------------------------------
# build + cache
# ----------------------------------------------------------------------------------------------


def cached_build(target_dir: Path) -> dict[str, Any] | None:
    """The build record of an existing target folder, or None."""
    try:
        return json.loads((target_dir / BUILD_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


CHAT_ANSWERS_FILE = "chat_answers.jsonl"
"""The chat rows with the target's own answers, written into the target folder once per build (and into
a cached folder that lacks it): what :func:`write_chat_corpus` copies to the recipe's ``chat_path``."""
SAMPLE_SEED = 7
"""Seed of the sampled answers of :data:`CHAT_ANSWERS_FILE`."""


def target_answered_rows(model: Any, tokenizer: Any, spec: TinyTargetSpec, log: Any = print) -> list[dict[str, Any]]:
    """The corpus conversations with the target's own answers: its greedy ones in even rows, its samples
    at temperature 1 (seeded) in odd rows. A draft must learn what its target says, not what the corpus
    wrote (the target answers 4 turns in 5 otherwise): on the corpus's answers the tiny draft accepted 2.7
    tokens per verify step greedily, on these 4.4; the samples keep it right where a sampled target
    leaves its greedy path (2.3 sampled, against 1.8 on greedy answers alone)."""
    vocabulary = tiny_corpus.build_vocabulary(spec.vocab_size)
    rows = tiny_corpus.generate_conversations(vocabulary, spec.chat_rows, spec.chat_seed, id_prefix="tiny")
    greedy = regenerate_answers(model, tokenizer, rows, log)
    sampled = regenerate_answers(model, tokenizer, rows, log, sample_seed=SAMPLE_SEED)
    return [g if index % 2 == 0 else s for index, (g, s) in enumerate(zip(greedy, sampled, strict=True))]


def ensure_chat_answers(spec: TinyTargetSpec, target_dir: Path, log: Any = print) -> Path:
    """The target folder's :data:`CHAT_ANSWERS_FILE`, decoded from the saved target (what every component
    loads) when the folder lacks it; a few seconds on a CPU."""
    path = target_dir / CHAT_ANSWERS_FILE
    if path.is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"[make_tiny_target] answering the {spec.chat_rows} chat conversations with the target (greedy and sampled)")
    dtype = torch.float32 if spec.device == "cpu" else getattr(torch, spec.train_dtype)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(spec.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    write_rows(path, target_answered_rows(model, tokenizer, spec, log))
    return path


def write_chat_corpus(
    spec: TinyTargetSpec, chat_path: Path, target_dir: Path = DEFAULT_TARGET_DIR, log: Any = print
) -> str:
    """Write the tiny chat JSONL that the draft trains on: the conversations of the chat corpus with the
    built target's own answers (:func:`ensure_chat_answers`); returns its SHA-256."""
    answers = ensure_chat_answers(spec, target_dir, log)
    chat_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(chat_path, answers.read_text())
    return hashlib.sha256(chat_path.read_bytes()).hexdigest()


def eval_prompt_turns(row: dict[str, Any]) -> list[dict[str, str]]:
    """The turns an eval decode starts from: the conversation without its last assistant turn."""
    turns = list(row["conversations"])
    return turns[:-1] if turns and turns[-1]["role"] == "assistant" else turns


def held_out_eval_rows(spec: TinyTargetSpec) -> list[dict[str, Any]]:
    """:data:`EVAL_ROWS` conversations from :data:`EVAL_SEED` whose prompt (every turn before the last
    answer) opens no conversation the draft trains on (the chat rows) nor the target's training corpus:
    the same tasks and world, other draws, and never a prompt either model has seen."""
    vocabulary = tiny_corpus.build_vocabulary(spec.vocab_size)
    seen = [
        row["conversations"]
        for rows in (
            tiny_corpus.generate_conversations(vocabulary, spec.chat_rows, spec.chat_seed, "tiny"),
            tiny_corpus.generate_conversations(vocabulary, spec.train_conversations, spec.train_corpus_seed, "train"),
        )
        for row in rows
    ]
    candidates = tiny_corpus.generate_conversations(vocabulary, 4 * EVAL_ROWS, EVAL_SEED, id_prefix="eval")
    held_out = []
    for row in candidates:
        prompt = eval_prompt_turns(row)
        if not any(turns[: len(prompt)] == prompt for turns in seen):
            held_out.append(row)
    if len(held_out) < EVAL_ROWS:
        raise RuntimeError(f"only {len(held_out)} of {len(candidates)} eval candidates are held out; draw more")
    return held_out[:EVAL_ROWS]


def write_eval_set(spec: TinyTargetSpec, eval_path: Path) -> str:
    """Write the held-out eval conversations (:func:`held_out_eval_rows`); returns the file's SHA-256.
    Each keeps its last assistant turn as the reference answer; the eval drops it."""
    write_rows(eval_path, held_out_eval_rows(spec))
    return hashlib.sha256(eval_path.read_bytes()).hexdigest()


def _fix_config_keys(target_dir: Path, spec: TinyTargetSpec) -> None:
    # transformers renamed the expert count between releases (num_experts / num_local_experts);
    # writing both keeps the checkpoint loadable by the CPU box's and the H200 box's versions.
    path = target_dir / "config.json"
    config = json.loads(path.read_text())
    config["num_experts"] = spec.num_experts
    config["num_local_experts"] = spec.num_experts
    atomic_write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def make_tiny_target(
    target_dir: Path = DEFAULT_TARGET_DIR,
    chat_path: Path = DEFAULT_CHAT_PATH,
    spec: TinyTargetSpec | None = None,
    eval_path: Path = DEFAULT_EVAL_PATH,
    force: bool = False,
    log: Any = print,
) -> dict[str, Any]:
    """Build (or reuse) the tiny target and write its chat corpus (the target's own answers); returns the
    build record."""
    spec = spec or TinyTargetSpec()
    target_dir, chat_path = target_dir.resolve(), chat_path.resolve()
    key = spec.cache_key()
    # Builds are serialised: tests and helpers may ask for the tiny target at the same time.
    lock = target_dir.parent / ".make_tiny_target.lock"

    def waiting() -> None:
        log(f"[make_tiny_target] another build of {target_dir} is running (lock {lock}); waiting for it to finish")

    with exclusive_lock(lock, waiting):
        write_eval_set(spec, eval_path.resolve())
        record = cached_build(target_dir)
        if record and record.get("cache_key") == key and not force:
            log(f"[make_tiny_target] cached: {target_dir} (key {key[:12]}), chat corpus {chat_path}")
        else:
            record = _build(spec, key, target_dir, log)
        write_chat_corpus(spec, chat_path, target_dir, log)
        return record


def pin_arithmetic() -> None:
    """Set :data:`PINNED_ARITHMETIC` in this process's environment; call before anything loads torch
    (the command line does: every build runs in a process of its own). Where torch is loaded already
    (a caller in-process), only the thread count can still be pinned; the build record says what held."""
    os.environ.update(PINNED_ARITHMETIC)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def arithmetic_in_effect() -> dict[str, Any]:
    """What the build's rounding depends on, as recorded in ``build.json``."""
    import torch

    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": os.environ.get("MKL_CBWR", ""),
    }


def _build(spec: TinyTargetSpec, key: str, target_dir: Path, log: Any) -> dict[str, Any]:
    """Train the tiny target and swap it into ``target_dir``; returns its build record."""
    log("[make_tiny_target] loading torch and transformers")
    import torch

    pinned = arithmetic_in_effect()
    log(
        f"[make_tiny_target] building {target_dir} (key {key[:12]}) on {pinned['threads']} thread(s), "
        f"{pinned['cpu_capability']} kernels, MKL path {pinned['mkl_cbwr'] or 'native'}, torch {pinned['torch']}"
    )
    started, started_cpu = time.monotonic(), time.process_time()
    tokenizer = build_tokenizer(spec)
    model = train_model(spec, tokenizer, log)
    vocabulary = tiny_corpus.build_vocabulary(spec.vocab_size)
    chat_rows = tiny_corpus.generate_conversations(vocabulary, spec.chat_rows, spec.chat_seed, id_prefix="tiny")
    log(f"[make_tiny_target] evaluating on the {len(chat_rows)} chat rows, then saving")
    quality = evaluate_peakedness(model, chat_rows, tokenizer, spec.max_position_embeddings)
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target_dir.name}.tmp", dir=target_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the target is shared by every component
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    _fix_config_keys(staging, spec)
    record = {
        "cache_key": key,
        "spec": dataclasses.asdict(spec),
        "quality": quality,
        "build_seconds": round(time.monotonic() - started, 1),
        # CPU seconds of this process (all its threads): what the build costs on a loaded machine.
        "build_cpu_seconds": round(time.process_time() - started_cpu, 1),
        "torch": torch.__version__,
        "arithmetic": pinned,
        "weights_sha256": hashlib.sha256((staging / "model.safetensors").read_bytes()).hexdigest(),
    }
    atomic_write_text(staging / BUILD_FILE, json.dumps(record, indent=2, sort_keys=True) + "\n")
    # Swap the finished folder in; a reader never sees a half-written target.
    previous = None
    if target_dir.exists():
        previous = target_dir.with_name(f".{target_dir.name}.old{time.time_ns()}")
        target_dir.rename(previous)
    staging.rename(target_dir)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
    log(
        f"[make_tiny_target] done in {record['build_seconds']} s ({record['build_cpu_seconds']} CPU s): "
        "assistant top-1 accuracy "
        f"{quality['assistant_top1_accuracy']:.3f}, mean top-1 probability "
        f"{quality['assistant_mean_top1_probability']:.3f}"
    )
    return record


def check_outputs(target_dir: Path, chat_path: Path, eval_path: Path) -> None:
    """Refuse, before anything is built, outputs that would destroy what is not ours: ``--out`` must be
    a tiny target folder (``build.json`` in it), an empty folder or a new path (the build swaps the
    whole folder in and deletes the old one); not a file, the filesystem root or the home folder. The
    chat and eval files must be two different files, outside ``--out``, and regular files when they
    exist."""
    target = output_place(target_dir, "--out", fix="give a new folder, e.g. .cache/tiny/target")
    if target.exists() and not target.is_dir():
        raise UserError(f"--out {target_dir} is a file; the target is a folder. Fix: give a new folder's path")
    if target.is_dir() and any(target.iterdir()) and not (target / BUILD_FILE).is_file():
        raise UserError(
            f"--out {target_dir} is a folder with files in it that is not a tiny target (no {BUILD_FILE}); a build "
            "replaces the whole folder, so nothing was touched. Fix: give a new or empty folder"
        )
    outputs = {"--chat-out": chat_path, "--eval-out": eval_path}
    resolved = {flag: output_place(path, flag) for flag, path in outputs.items()}
    if resolved["--chat-out"] == resolved["--eval-out"]:
        raise UserError(
            f"--chat-out and --eval-out name the same file {chat_path}: one would overwrite the other. Fix: give "
            "two different files"
        )
    for flag, path in resolved.items():
        if path == target or target in path.parents:
            raise UserError(
                f"{flag} {outputs[flag]} is inside --out {target_dir}, which a build replaces. Fix: write it elsewhere"
            )
        require_regular_file(path, flag, "give a file's path")


def main(argv: list[str] | None = None) -> int:
    """Command line entry point (bad input: one ``error:`` line, exit 2)."""
    return run_command(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="tools/make_tiny_target", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--world",
        choices=sorted(WORLDS),
        default="tiny",
        help="which world: its sizes and default paths (.cache/WORLD)",
    )
    parser.add_argument("--out", type=Path, default=None, help="target folder (HF layout); default .cache/WORLD/target")
    parser.add_argument("--chat-out", type=Path, default=None, help="chat JSONL to write; default .cache/WORLD/data")
    parser.add_argument("--eval-out", type=Path, default=None, help="held-out eval JSONL to write; default likewise")
    parser.add_argument("--force", action="store_true", help="rebuild even when the cache matches")
    parser.add_argument("--train-steps", type=int, default=None, help="override the training steps")
    args = parser.parse_args(argv)
    pin_arithmetic()
    if args.train_steps is not None and args.train_steps < 1:
        raise UserError(f"--train-steps {args.train_steps}: the target trains for at least 1 step. Fix: give 1 or more")
    target_dir, chat_path, eval_path = world_paths(args.world)
    args.out, args.chat_out, args.eval_out = (
        args.out or target_dir,
        args.chat_out or chat_path,
        args.eval_out or eval_path,
    )
    check_outputs(args.out, args.chat_out, args.eval_out)
    spec = WORLDS[args.world]
    if spec.device == "cuda":
        require_gpu(f"tools/make_tiny_target --world {args.world}")
    if args.train_steps is not None:
        spec = dataclasses.replace(spec, train_steps=args.train_steps)
    make_tiny_target(args.out, args.chat_out, spec, eval_path=args.eval_out, force=args.force)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
