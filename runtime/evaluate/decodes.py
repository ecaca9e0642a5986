"""Every decode of an evaluation, one JSON line each, beside ``results.json``: ``decodes.jsonl``.

A line is one prompt decoded once: ``temperature``, ``decoder`` (``target alone`` or the draft's
label), ``set``, ``prompt_id``, ``prompt_ids`` (the token ids the target was given), ``output_ids``
(the tokens committed, the stop token included), ``stopped_by``, ``seconds``; for a speculative
decode also ``verify_steps``, ``acceptance_length`` (:func:`runtime.shared.acceptance_length.acceptance_length`
of this decode alone) and, from the embedded route, ``accepted_per_step`` (drafted tokens accepted at
each verify step) or, from the SGLang route, ``accepted_histogram`` (verify steps by drafted tokens
accepted, as SGLang reports it).

With them anyone can check the figures of ``results.json`` (they are sums and means over these lines) and the
greedy outputs against another decoder: ``python3 -m tools.replay_decodes RESULTS_FOLDER`` replays
the temperature-0 lines with plain transformers greedy decoding.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from runtime.evaluate.decoder import Generation
from runtime.evaluate.eval_sets import Prompt
from runtime.files import atomic_write_text
from runtime.shared.acceptance_length import acceptance_length

DECODES_FILE = "decodes.jsonl"
PLAIN_DECODER = "target alone"


def generation_lines(
    temperature: float, decoder: str, set_name: str, prompts: Sequence[Prompt], generations: Sequence[Generation]
) -> list[dict[str, Any]]:
    """The lines of one set decoded by the embedded route (``decoder``: a draft's label or
    :data:`PLAIN_DECODER`)."""
    lines = []
    for prompt, generation in zip(prompts, generations, strict=True):
        line: dict[str, Any] = {
            "temperature": temperature,
            "decoder": decoder,
            "set": set_name,
            "prompt_id": prompt.prompt_id,
            "prompt_ids": list(prompt.input_ids),
            "output_ids": generation.output_ids,
            "stopped_by": generation.stopped_by,
            "seconds": round(generation.seconds, 6),
        }
        if decoder != PLAIN_DECODER:
            line["verify_steps"] = len(generation.steps)
            line["acceptance_length"] = acceptance_length(len(generation.output_ids), len(generation.steps))
            line["accepted_per_step"] = [step.accepted for step in generation.steps]
        lines.append(line)
    return lines


def outcome_lines(
    temperature: float, decoder: str, set_name: str, prompts: Sequence[Prompt], outcomes: Sequence[Any]
) -> list[dict[str, Any]]:
    """The lines of one set served by SGLang (``outcomes``: its
    :class:`runtime.evaluate.sglang_route.RequestOutcome` per prompt)."""
    return [
        {
            "temperature": temperature,
            "decoder": decoder,
            "set": set_name,
            "prompt_id": prompt.prompt_id,
            "prompt_ids": list(prompt.input_ids),
            "output_ids": outcome.output_ids,
            "completion_tokens": outcome.completion_tokens,
            "verify_steps": outcome.verify_steps,
            "acceptance_length": acceptance_length(outcome.completion_tokens, outcome.verify_steps),
            "accepted_histogram": outcome.accepted_histogram,
            "seconds": round(outcome.seconds, 6),
        }
        for prompt, outcome in zip(prompts, outcomes, strict=True)
    ]


def write_decodes(lines: Iterable[dict[str, Any]], out_dir: Path) -> Path:
    """``decodes.jsonl`` in ``out_dir``, whole or not at all."""
    path = out_dir / DECODES_FILE
    atomic_write_text(path, "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines))
    return path


def read_decodes(path: Path) -> list[dict[str, Any]]:
    """The lines of a ``decodes.jsonl``."""
    return [json.loads(text) for text in path.read_text(encoding="utf-8").splitlines() if text.strip()]
