"""The recipe's eval sets as prompts: each file checked against its SHA-256, each row turned into
prompt token ids (a ``conversations`` row through the target tokenizer's chat template, an
``input_ids`` row as is)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.evaluate.settings import EvalSetFile
from runtime.shared.chat_tokenize import ChatFormatError, tokenize_prompt
from runtime.user_errors import UserError


class EvalSetError(UserError, ValueError):
    """An eval set that cannot be used; the message names the file, the field and the fix."""


@dataclass(frozen=True)
class Prompt:
    """One eval prompt."""

    prompt_id: str
    input_ids: list[int]


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for piece in iter(lambda: handle.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def load_prompts(eval_set: EvalSetFile, tokenizer: Any, vocab_size: int) -> list[Prompt]:
    """The prompts of ``eval_set``; ``tokenizer`` is needed only for ``conversations`` rows."""
    field = f"eval.sets[{eval_set.index}]"
    path = eval_set.path
    if not path.is_file():
        raise EvalSetError(
            f"{field}.path: {path} does not exist; fix: create it (recipes/tiny.yaml: run tools/make_tiny_target) "
            "or correct the path"
        )
    found = file_sha256(path)
    if found != eval_set.sha256:
        raise EvalSetError(
            f"{field}.sha256: {path} hashes to {found}, the recipe pins {eval_set.sha256}; the file changed. Fix: "
            f"restore the file, or if the change is intended set {field}.sha256: {found}"
        )
    prompts: list[Prompt] = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            prompts.append(_prompt(line, where, tokenizer, vocab_size, len(prompts)))
            if eval_set.max_prompts is not None and len(prompts) >= eval_set.max_prompts:
                break
    if not prompts:
        raise EvalSetError(f"{field}.path: {path} holds no prompts; fix: point it at a JSONL file with one per line")
    return prompts


def _prompt(line: str, where: str, tokenizer: Any, vocab_size: int, number: int) -> Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise EvalSetError(f"{where}: not valid JSON ({exc.msg}); fix: one JSON object per line") from None
    if not isinstance(row, dict):
        raise EvalSetError(f"{where}: a row must be a JSON object with conversations or input_ids")
    prompt_id = str(row.get("id", f"row-{number}"))
    if "input_ids" in row:
        ids = row["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise EvalSetError(
                f"{where}: input_ids must be a non-empty list of token ids in 0..{vocab_size - 1} (capture.vocab_size)"
            )
        return Prompt(prompt_id, list(ids))
    if "conversations" in row:
        if tokenizer is None:
            raise EvalSetError(f"{where}: a conversations row needs the target's tokenizer, and none was loaded")
        try:
            return Prompt(prompt_id, tokenize_prompt(tokenizer, row["conversations"], where))
        except ChatFormatError as exc:
            raise EvalSetError(str(exc)) from None
    raise EvalSetError(f"{where}: the row has neither conversations nor input_ids; fix: give it one of them")
