"""Regenerate the assistant turns of a chat with the target itself, so the draft learns the target's
own distribution rather than another model's answers.

Two back ends behind one small interface (``reply(messages) -> str``):
- :class:`EmbeddedRegenerator`: the target in this process through transformers (small targets);
- :class:`OpenAIRegenerator`: an OpenAI-compatible ``/v1/chat/completions`` server (production
  targets served by SGLang or vLLM). The API key, if the server needs one, is read from the
  environment variable named by ``api_key_env`` only; it is never written anywhere.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from runtime.user_errors import REDACTED, UserError

END_OF_TURN_TOKENS = ("<|end|>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>")
"""Tokens that close an assistant turn in common chat templates (generation stops at them)."""


class RegenerationError(UserError, RuntimeError):
    """A reply could not be generated; the message names the row and the turn."""


class Regenerator(Protocol):
    """Produces the assistant's next reply to a conversation prefix."""

    def reply(self, messages: Sequence[dict[str, str]]) -> str:
        """The content of the next assistant turn after ``messages``."""


def regenerate_conversation(
    messages: Sequence[dict[str, str]], regenerator: Regenerator, where: str
) -> list[dict[str, str]]:
    """``messages`` with every assistant turn replaced, turn by turn (later turns see the new ones)."""
    out: list[dict[str, str]] = []
    for index, turn in enumerate(messages):
        if turn["role"] != "assistant":
            out.append(dict(turn))
            continue
        try:
            content = regenerator.reply(out)
        except RegenerationError as exc:
            raise RegenerationError(f"{where}: conversations[{index}]: {exc}") from None
        out.append({"role": "assistant", "content": content})
    return out


class EmbeddedRegenerator:
    """Greedy (or sampled) generation with the target loaded through transformers."""

    def __init__(
        self,
        target_path: Path,
        tokenizer: Any,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).to(device).eval()
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        vocab = tokenizer.get_vocab()
        stops = {tokenizer.eos_token_id, *(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)}
        self.stop_ids = sorted(i for i in stops if i is not None)

    def reply(self, messages: Sequence[dict[str, str]]) -> str:
        """Generate until an end-of-turn token or ``max_new_tokens``; decoded without specials."""
        import torch

        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([self.tokenizer(text, add_special_tokens=False)["input_ids"]], device=self.device)
        sampling: dict[str, Any] = {"do_sample": False}
        if self.temperature > 0:
            torch.manual_seed(int(torch.randint(2**31 - 1, (1,), generator=self.generator, device=self.device)))
            sampling = {"do_sample": True, "temperature": self.temperature, "top_k": 0, "top_p": 1.0}
        with torch.inference_mode():
            output = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=self.max_new_tokens,
                eos_token_id=self.stop_ids,
                pad_token_id=self.tokenizer.pad_token_id,
                **sampling,
            )
        new_tokens = [t for t in output[0, ids.shape[1] :].tolist() if t not in self.stop_ids]
        return self.tokenizer.decode(new_tokens, skip_special_tokens=True).strip()


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an error, never followed: urllib would send the Authorization header (the API key) to
    whatever host the answer names, and turn the POST into a GET whose answer became training data."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        raise RegenerationError(
            f"{req.full_url} answered HTTP {code}, a redirect to {newurl.split('?')[0]}: not followed (the API key "
            "would go wherever it points); fix: give --server-url the endpoint itself"
        )


_OPENER = urllib.request.build_opener(_RefuseRedirects)


class OpenAIRegenerator:
    """Replies from an OpenAI-compatible chat completions endpoint."""

    def __init__(
        self,
        base_url: str,
        model: str,
        max_new_tokens: int = 1024,
        temperature: float = 0.0,
        timeout_s: float = 600.0,
        retries: int = 3,
        api_key_env: str | None = None,
    ) -> None:
        base = base_url.rstrip("/")
        self.url = base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.timeout_s = timeout_s
        self.retries = retries
        self.api_key_env = api_key_env

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise RegenerationError(
                    f"the environment variable {self.api_key_env} (--api-key-env) is not set; fix: export it in this "
                    "shell (the key is read from there and never written down)"
                )
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def reply(self, messages: Sequence[dict[str, str]]) -> str:
        """POST the conversation; retries transient failures (connection errors, 5xx, 429)."""
        body = json.dumps(
            {
                "model": self.model,
                "messages": list(messages),
                "max_tokens": self.max_new_tokens,
                "temperature": self.temperature,
            }
        ).encode()
        delay_s = 1.0
        for attempt in range(self.retries + 1):
            headers = self._headers()
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with _OPENER.open(request, timeout=self.timeout_s) as response:
                    answer = json.loads(response.read())
                return _content_of(answer, self.url)
            except urllib.error.HTTPError as exc:
                transient = exc.code >= 500 or exc.code == 429
                detail = _without_key(exc.read()[:300].decode(errors="replace"), headers)
                if not transient or attempt == self.retries:
                    raise RegenerationError(f"{self.url} answered HTTP {exc.code}: {detail}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                if attempt == self.retries:
                    raise RegenerationError(
                        f"cannot reach {self.url} ({exc}); fix: start the server or correct --server-url"
                    ) from None
            time.sleep(delay_s)
            delay_s *= 2
        raise AssertionError("unreachable")


def _without_key(text: str, headers: dict[str, str]) -> str:
    """A server's answer as it may be printed: the API key we sent removed wherever it is echoed (a body
    may quote the request's headers), whatever the redactor would recognise."""
    key = headers.get("Authorization", "").removeprefix("Bearer ")
    return text.replace(key, REDACTED) if key else text


def _content_of(answer: Any, url: str) -> str:
    try:
        content = answer["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise RegenerationError(f"{url} answered without choices[0].message.content: {str(answer)[:300]}") from None
    if not isinstance(content, str):
        raise RegenerationError(f"{url} answered a non-text content: {str(content)[:100]}")
    return content.strip()
