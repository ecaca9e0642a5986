"""Chat conversation -> (input_ids, loss_mask) with the target tokenizer's own chat template.

The loss mask marks exactly the tokens the template emits for each assistant turn (its content and
whatever closes the turn, e.g. an end-of-turn token), found by rendering the conversation prefix by
prefix: the tokens of ``messages[:i+1]`` past those of ``messages[:i]`` plus the generation prompt.
This works with any template that renders a conversation as a growing prefix, with no need for
``{% generation %}`` markers; a template that rewrites earlier turns is reported, not guessed at.

An eval prompt (:func:`tokenize_prompt`) is the conversation without its trailing assistant turn,
rendered with the generation prompt: what a server would feed the target before it answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.user_errors import UserError

VALID_ROLES = ("system", "user", "assistant", "tool")


class ChatFormatError(UserError, ValueError):
    """A chat row or template that cannot be tokenized; the message names the row and the fix."""


@dataclass(frozen=True)
class TokenizedChat:
    """One tokenized conversation."""

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool
    """Whether tokens past ``max_length`` were cut."""


def check_messages(messages: Any, where: str, require_assistant: bool = True) -> list[dict[str, str]]:
    """Validate the ``conversations`` field of a chat row; returns it as plain dicts. A training row
    needs an assistant turn (``require_assistant``); a prompt does not."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError(
            f"{where}: field conversations must be a non-empty list; fix: give it [{{role, content}}, ...] turns"
        )
    checked: list[dict[str, str]] = []
    for turn_index, turn in enumerate(messages):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise ChatFormatError(
                f'{where}: conversations[{turn_index}] is not an object with role and content; fix: write it as {{"role": ..., "content": ...}}'
            )
        role, content = turn["role"], turn["content"]
        if role not in VALID_ROLES:
            raise ChatFormatError(
                f"{where}: conversations[{turn_index}].role is {role!r}; fix: use one of {', '.join(VALID_ROLES)}"
            )
        if not isinstance(content, str):
            raise ChatFormatError(
                f"{where}: conversations[{turn_index}].content is not a string; fix: write the text as a JSON string"
            )
        checked.append({"role": role, "content": content})
    if require_assistant and not any(turn["role"] == "assistant" for turn in checked):
        raise ChatFormatError(
            f"{where}: no assistant turn, so the loss mask would be empty; fix: drop the row or add the assistant's answer"
        )
    return checked


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render(tokenizer: Any, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
    """The chat template applied to ``messages`` as text."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenize_chat(
    tokenizer: Any, messages: Sequence[dict[str, str]], where: str, max_length: int | None = None
) -> TokenizedChat:
    """Token ids and the assistant loss mask of one conversation, truncated to ``max_length``."""
    input_ids = _encode(tokenizer, render(tokenizer, messages, add_generation_prompt=False))
    loss_mask = [0] * len(input_ids)
    for turn_index, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        prefix = _encode(tokenizer, render(tokenizer, messages[:turn_index], add_generation_prompt=True))
        upto = _encode(tokenizer, render(tokenizer, messages[: turn_index + 1], add_generation_prompt=False))
        if upto[: len(prefix)] != prefix or input_ids[: len(upto)] != upto:
            raise ChatFormatError(
                f"{where}: the chat template does not render conversations[{turn_index}] (assistant) as a "
                "continuation of the earlier turns (it rewrites history, e.g. strips reasoning), so the "
                "assistant tokens cannot be located; fix: use a template without history rewriting for "
                "data preparation"
            )
        for position in range(len(prefix), len(upto)):
            loss_mask[position] = 1
    truncated = max_length is not None and len(input_ids) > max_length
    if truncated:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return TokenizedChat(input_ids, loss_mask, truncated)


def tokenize_prompt(tokenizer: Any, messages: Any, where: str) -> list[int]:
    """Token ids of an eval prompt: ``messages`` without a trailing assistant turn (the reference
    answer, if the row has one), then the template's generation prompt."""
    checked = check_messages(messages, where, require_assistant=False)
    if checked[-1]["role"] == "assistant":
        checked = checked[:-1]
    if not checked:
        raise ChatFormatError(
            f"{where}: conversations holds only an assistant turn, so there is no prompt; drop the row"
        )
    if not any(str(turn["content"]).strip() for turn in checked):
        raise ChatFormatError(
            f"{where}: every turn of the prompt is empty, so there is nothing to answer; fix: write the prompt's text, "
            "or drop the row"
        )
    return _encode(tokenizer, render(tokenizer, checked, add_generation_prompt=True))
