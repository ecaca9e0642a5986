"""The generated, structured chat corpus of the tiny target, and its fixed word vocabulary.

Every assistant answer is a deterministic function of the conversation (count up or down, repeat a
word, recite a memorised poem, add, look up a made-up fact), so a target trained on it has peaked
next-token distributions on assistant tokens, and most answers are long runs that a draft can learn
to propose several tokens at a time (a successor, a repetition, a memorised line): the tiny default
run shows a draft learning, as a real one does on real chat, in a minute of CPU.

Determinism across machines and Python versions: the only randomness is ``random.Random(seed).random()``,
whose sequence Python guarantees to keep; no numpy, no hashing of strings.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from itertools import product
from typing import Any

SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<bos>",
    "<eos>",
    "<mask>",
    "<unk>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
)
"""Special tokens in id order: pad 0, bos 1, eos 2, DSpark mask 3 (what recipes/tiny.yaml says)."""

PAD_ID, BOS_ID, EOS_ID, MASK_ID = 0, 1, 2, 3

FUNCTION_WORDS: tuple[str, ...] = (
    ".",
    ",",
    ":",
    "?",
    "!",
    "count",
    "from",
    "to",
    "reverse",
    "repeat",
    "times",
    "add",
    "and",
    "plus",
    "is",
    "sort",
    "say",
    "what",
    "the",
    "color",
    "home",
    "friend",
    "of",
    "you",
    "are",
    "a",
    "helpful",
    "assistant",
    "answer",
    "briefly",
    "sure",
    "here",
    "it",
    "numbers",
    "words",
    "in",
    "order",
    "then",
    "please",
    "thanks",
    "welcome",
    "again",
    "done",
    "lives",
    "likes",
    "tell",
    "me",
    "about",
    "lists",
    "list",
    "down",
    "recite",
    "poem",
    "number",
)
MAX_NUMBER = 199
"""Numbers 0..199 are single tokens."""
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def build_vocabulary(vocab_size: int) -> list[str]:
    """The token strings in id order: specials, function words, numbers, then made-up words."""
    words = list(SPECIAL_TOKENS) + list(FUNCTION_WORDS) + [str(n) for n in range(MAX_NUMBER + 1)]
    made_up = ("".join(parts) for parts in product(_CONSONANTS, _VOWELS, _CONSONANTS, _VOWELS))
    for word in made_up:
        if len(words) >= vocab_size:
            break
        if word not in words:
            words.append(word)
    if len(words) < vocab_size:
        raise ValueError(f"cannot build {vocab_size} distinct tokens (only {len(words)})")
    return words


def made_up_words(vocabulary: Sequence[str]) -> list[str]:
    """The made-up words of a vocabulary (everything after the numbers)."""
    return list(vocabulary[len(SPECIAL_TOKENS) + len(FUNCTION_WORDS) + MAX_NUMBER + 1 :])


class _Draw:
    """Draws from ``random.Random(seed).random()`` only (stable across Python versions)."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def below(self, n: int) -> int:
        """Uniform integer in [0, n)."""
        return min(int(self._rng.random() * n), n - 1)

    def between(self, low: int, high: int) -> int:
        """Uniform integer in [low, high]."""
        return low + self.below(high - low + 1)

    def pick(self, items: Sequence[Any]) -> Any:
        """One of ``items``, uniformly."""
        return items[self.below(len(items))]


class TinyWorld:
    """Made-up entities with fixed facts (color, home, friend) and fixed poems, from the vocabulary."""

    RELATIONS = ("color", "home", "friend")

    def __init__(self, vocabulary: Sequence[str], num_entities: int = 32, num_poems: int = 12) -> None:
        pool = made_up_words(vocabulary)
        self.entities = pool[:num_entities]
        self.fillers = pool[num_entities:]
        self.common = pool[num_entities : num_entities + 48]
        """A small word pool for the copy tasks, so that a tiny model learns them fast."""
        values = pool[num_entities : num_entities + 32]
        # Fixed made-up "poems" to memorise: long, fully predictable answers. No word is in two poems or
        # twice in one, so each next word follows from the word before it (what a small model learns first).
        poem_words = list(pool[num_entities + 48 :])
        draw = _Draw(num_poems)
        for index in range(len(poem_words) - 1, 0, -1):  # Fisher-Yates: poems are not runs of the word list
            other = draw.below(index + 1)
            poem_words[index], poem_words[other] = poem_words[other], poem_words[index]
        self.poems = []
        for index in range(num_poems):
            length = 12 + 2 * index
            self.poems.append(poem_words[:length])
            poem_words = poem_words[length:]
        self.facts: dict[tuple[str, str], str] = {}
        for entity in self.entities:
            for relation in self.RELATIONS:
                # A fixed, hash-derived table: the same on every machine, unrelated to the RNG stream.
                digest = hashlib.sha256(f"{relation}/{entity}".encode()).digest()
                self.facts[(relation, entity)] = values[int.from_bytes(digest[:4], "big") % len(values)]


def _task_count(draw: _Draw, world: TinyWorld) -> tuple[str, str]:
    start = draw.between(0, 170)
    end = min(start + draw.between(6, 30), MAX_NUMBER)
    numbers = " ".join(str(n) for n in range(start, end + 1))
    return f"count from {start} to {end} .", f"{numbers} ."


def _task_recite(draw: _Draw, world: TinyWorld) -> tuple[str, str]:
    number = draw.below(len(world.poems))
    return f"recite poem {number} .", f"{' '.join(world.poems[number])} ."


def _task_repeat(draw: _Draw, world: TinyWorld) -> tuple[str, str]:
    word = draw.pick(world.common)
    times = draw.between(3, 12)
    return f"repeat {word} {times} times .", f"{' '.join([word] * times)} ."


def _task_fact(draw: _Draw, world: TinyWorld) -> tuple[str, str]:
    entity = draw.pick(world.entities)
    relation = draw.pick(TinyWorld.RELATIONS)
    value = world.facts[(relation, entity)]
    return f"what is the {relation} of {entity} ?", f"the {relation} of {entity} is {value} ."


def _task_about(draw: _Draw, world: TinyWorld) -> tuple[str, str]:
    entity = draw.pick(world.entities)
    facts = " , ".join(f"the {r} of {entity} is {world.facts[(r, entity)]}" for r in TinyWorld.RELATIONS)
    return f"tell me about {entity} .", f"{facts} ."


TASKS: tuple[Callable[[_Draw, TinyWorld], tuple[str, str]], ...] = (
    # Listed with repeats to weight them: answers a small target learns in a minute of CPU and a
    # one-layer draft learns to propose in blocks (runs of successors, repetitions, memorised poems),
    # and some short look-ups whose answer only the target's features carry (facts). No task copies
    # random words from the prompt, counts down or adds: a target this small learns those only after
    # far longer training, and a target that guesses makes every draft look bad.
    _task_count,
    _task_count,
    _task_count,
    _task_recite,
    _task_recite,
    _task_recite,
    _task_recite,
    _task_repeat,
    _task_repeat,
    _task_fact,
    _task_about,
)
SYSTEM_PROMPTS: tuple[str | None, ...] = (None, "you are a helpful assistant .", "answer briefly .")


def generate_conversations(
    vocabulary: Sequence[str], num_conversations: int, seed: int, id_prefix: str = "tiny"
) -> list[dict[str, Any]]:
    """``num_conversations`` chat rows ``{id, conversations: [{role, content}]}``, deterministic in
    (vocabulary, seed). One to three user/assistant exchanges each, sometimes with a system turn."""
    world = TinyWorld(vocabulary)
    draw = _Draw(seed)
    rows: list[dict[str, Any]] = []
    for number in range(num_conversations):
        turns: list[dict[str, str]] = []
        system = draw.pick(SYSTEM_PROMPTS)
        if system is not None:
            turns.append({"role": "system", "content": system})
        for exchange in range(draw.between(1, 3)):
            question, answer = draw.pick(TASKS)(draw, world)
            if system == "you are a helpful assistant .":
                # The system prompt changes the phrasing, deterministically: context matters.
                answer = f"sure , {answer}"
            if exchange > 0 and draw.below(4) == 0:
                question = f"then {question}"
            turns.append({"role": "user", "content": question})
            turns.append({"role": "assistant", "content": answer})
        rows.append({"id": f"{id_prefix}-{number:06d}", "conversations": turns})
    return rows
