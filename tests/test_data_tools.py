"""tools/prepare_data and tools/verify_data end to end (the real CLIs, the tiny target's tokenizer)."""

from __future__ import annotations

import dataclasses
import http.server
import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.shared.data_files import DataFileError, iter_rows, read_manifest, sha256_file, write_rows
from tests.conftest import REPO_ROOT
from tests.support.tiny_moe import tiny_moe_config
from tools import tiny_corpus
from tools.data_prepare import PrepareOptions, prepare
from tools.regenerate import EmbeddedRegenerator, OpenAIRegenerator, RegenerationError
from tools.tiny_target import TinyTargetSpec, build_tokenizer

SPEC = TinyTargetSpec()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(SPEC).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
def chat_file(tmp_path: Path) -> Path:
    rows = tiny_corpus.generate_conversations(tiny_corpus.build_vocabulary(SPEC.vocab_size), 24, seed=5)
    path = tmp_path / "chat.jsonl"
    write_rows(path, rows)
    return path


def _tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(REPO_ROOT / "tools" / name), *args], capture_output=True, text=True, timeout=300)


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for index, value in enumerate([*mask, 0]):
        if value and start is None:
            start = index
        elif not value and start is not None:
            spans.append((start, index))
            start = None
    return spans


def test_prepare_masks_exactly_the_assistant_turns(
    tmp_path: Path, chat_file: Path, tokenizer_dir: Path, tokenizer
) -> None:
    out = tmp_path / "train.jsonl"
    result = _tool(
        "prepare_data",
        "--input",
        str(chat_file),
        "--output",
        str(out),
        "--tokenizer",
        str(tokenizer_dir),
        "--max-length",
        "256",
    )
    assert result.returncode == 0, result.stderr
    chats = [json.loads(line) for line in chat_file.read_text().splitlines()]
    rows = list(iter_rows(out))
    assert [r.id for r in rows] == [c["id"] for c in chats]
    for chat, row in zip(chats, rows, strict=True):
        answers = [t["content"] for t in chat["conversations"] if t["role"] == "assistant"]
        spans = _spans(row.loss_mask)
        assert len(spans) == len(answers)
        for (start, end), answer in zip(spans, answers, strict=True):
            assert tokenizer.convert_ids_to_tokens(row.input_ids[start - 1]) == "<|assistant|>"
            assert tokenizer.decode(row.input_ids[start:end]) == f"{answer} <|end|>"
    manifest = read_manifest(out)
    assert manifest["sha256"] == sha256_file(out)
    assert manifest["rows"] == len(rows) and manifest["tokens"] == sum(r.num_tokens for r in rows)
    assert manifest["masked_tokens"] == sum(sum(r.loss_mask) for r in rows)
    assert str(tmp_path) not in out.with_name(out.name + ".manifest.json").read_text(), "no absolute paths"
    verified = _tool(
        "verify_data",
        str(out),
        "--expected-sha256",
        "manifest",
        "--vocab-size",
        "2048",
        "--max-length",
        "256",
        "--rows",
        str(len(rows)),
    )
    assert verified.returncode == 0, verified.stderr
    assert f"{len(rows)} rows" in verified.stdout


def test_prepare_is_deterministic(tmp_path: Path, chat_file: Path, tokenizer_dir: Path, tokenizer) -> None:
    options = PrepareOptions(chat_file, tmp_path / "a.jsonl", tokenizer_dir, 256)
    first = prepare(options, tokenizer=tokenizer, log=lambda *_: None)
    second = prepare(
        dataclasses.replace(options, output_path=tmp_path / "b.jsonl"), tokenizer=tokenizer, log=lambda *_: None
    )
    assert first.sha256 == second.sha256 == sha256_file(tmp_path / "b.jsonl")


def test_truncation_and_dropped_rows(tmp_path: Path, chat_file: Path, tokenizer_dir: Path, tokenizer) -> None:
    options = PrepareOptions(chat_file, tmp_path / "train.jsonl", tokenizer_dir, 12)
    result = prepare(options, tokenizer=tokenizer, log=lambda *_: None)
    rows = list(iter_rows(options.output_path))
    assert all(r.num_tokens <= 12 for r in rows) and result.truncated_rows > 0
    # A row whose first answer starts past token 12 has nothing left to learn: dropped and listed.
    full = prepare(
        dataclasses.replace(options, output_path=tmp_path / "full.jsonl", max_length=256),
        tokenizer=tokenizer,
        log=lambda *_: None,
    )
    assert full.dropped_rows == []
    full_rows = {r.id: r for r in iter_rows(tmp_path / "full.jsonl")}
    expect_dropped = [i for i, r in full_rows.items() if not any(r.loss_mask[:12])]
    assert result.dropped_rows == expect_dropped and expect_dropped
    assert read_manifest(options.output_path)["dropped_rows"] == expect_dropped
    for row in rows:
        assert row.input_ids == full_rows[row.id].input_ids[:12]
        assert row.loss_mask == full_rows[row.id].loss_mask[:12]


def test_bad_chat_rows_name_the_line(tmp_path: Path, tokenizer_dir: Path, tokenizer) -> None:
    path = tmp_path / "chat.jsonl"
    good = {
        "id": "a",
        "conversations": [{"role": "user", "content": "say : bati"}, {"role": "assistant", "content": "bati ."}],
    }
    no_answer = {"id": "b", "conversations": [{"role": "user", "content": "say : bati"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(no_answer) + "\n")
    options = PrepareOptions(path, tmp_path / "train.jsonl", tokenizer_dir, 64)
    with pytest.raises(DataFileError, match=r"line 2 \(id 'b'\): no assistant turn"):
        prepare(options, tokenizer=tokenizer)
    path.write_text(json.dumps(good) + "\n" + json.dumps(good)[:20] + "\n")
    with pytest.raises(DataFileError, match="line 2: not valid JSON"):
        prepare(options, tokenizer=tokenizer)
    assert not options.output_path.exists(), "nothing is written when the input is bad"


def test_verify_cli_names_the_bad_row(tmp_path: Path, chat_file: Path, tokenizer_dir: Path, tokenizer) -> None:
    out = tmp_path / "train.jsonl"
    prepare(PrepareOptions(chat_file, out, tokenizer_dir, 256), tokenizer=tokenizer, log=lambda *_: None)
    lines = out.read_text().splitlines(keepends=True)
    row = json.loads(lines[4])
    row["input_ids"][2] = 4096
    lines[4] = json.dumps(row, separators=(",", ":")) + "\n"
    out.write_text("".join(lines))
    result = _tool("verify_data", str(out), "--vocab-size", "2048")
    assert result.returncode == 1
    assert f"row 5 (id '{row['id']}'): input_ids[2] = 4096" in result.stderr
    mismatch = _tool("verify_data", str(out), "--expected-sha256", "manifest")
    assert mismatch.returncode == 1 and "SHA-256 is" in mismatch.stderr and "(from the manifest)" in mismatch.stderr


# -- regeneration ---------------------------------------------------------------------------------


class _ChatServer(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint on 127.0.0.1 whose reply is the last user message reversed."""

    requests: list[dict] = []
    fail_with: int | None = None

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, **body})
        if type(self).fail_with:
            self.send_response(type(self).fail_with)
            self.end_headers()
            self.wfile.write(b'{"error": "model not found"}')
            return
        last_user = [m["content"] for m in body["messages"] if m["role"] == "user"][-1]
        reply = " ".join(reversed(last_user.split()))
        payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def chat_server() -> Iterator[str]:
    _ChatServer.requests = []
    _ChatServer.fail_with = None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ChatServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_regenerate_through_an_openai_compatible_server(
    tmp_path: Path, chat_file: Path, tokenizer_dir: Path, tokenizer, chat_server: str
) -> None:
    options = PrepareOptions(
        chat_file,
        tmp_path / "train.jsonl",
        tokenizer_dir,
        256,
        regenerate="openai",
        server_url=chat_server,
        server_model="tiny",
    )
    result = prepare(options, tokenizer=tokenizer, log=lambda *_: None)
    assert result.manifest["regenerate"]["mode"] == "openai"
    chats = [json.loads(line) for line in chat_file.read_text().splitlines()]
    rows = list(iter_rows(options.output_path))
    for chat, row in zip(chats, rows, strict=True):
        users = [t["content"] for t in chat["conversations"] if t["role"] == "user"]
        spans = _spans(row.loss_mask)
        for (start, end), user in zip(spans, users, strict=True):
            assert tokenizer.decode(row.input_ids[start:end]) == " ".join(reversed(user.split())) + " <|end|>"
    # Later turns were asked with the regenerated earlier answers in the conversation.
    multi = next(r for r in _ChatServer.requests if sum(m["role"] == "assistant" for m in r["messages"]) >= 1)
    earlier = next(m for m in multi["messages"] if m["role"] == "assistant")
    first_user = next(m for m in multi["messages"] if m["role"] == "user")
    assert earlier["content"] == " ".join(reversed(first_user["content"].split()))
    assert all(r["path"] == "/v1/chat/completions" and r["model"] == "tiny" for r in _ChatServer.requests)


def test_regenerate_server_refusal_is_a_clear_error(
    tmp_path: Path, chat_file: Path, tokenizer_dir: Path, tokenizer, chat_server: str
) -> None:
    _ChatServer.fail_with = 404
    options = PrepareOptions(
        chat_file,
        tmp_path / "train.jsonl",
        tokenizer_dir,
        256,
        regenerate="openai",
        server_url=chat_server + "/v1",
        server_model="nope",
    )
    with pytest.raises(RegenerationError, match=r"line 1 \(id 'tiny-000000'\): conversations\[\d\]: .*HTTP 404"):
        prepare(options, tokenizer=tokenizer)
    assert len(_ChatServer.requests) == 1, "a 4xx is not retried"
    unreachable = OpenAIRegenerator("http://127.0.0.1:9", "m", retries=0, timeout_s=2)
    with pytest.raises(RegenerationError, match="cannot reach"):
        unreachable.reply([{"role": "user", "content": "hi"}])


def test_regenerate_with_the_embedded_target_is_its_greedy_continuation(
    tmp_path: Path, tokenizer_dir: Path, tokenizer
) -> None:
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = tiny_moe_config(
        vocab_size=SPEC.vocab_size,
        intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # never emit special tokens, so the reply decodes and re-encodes to itself
        model.lm_head.weight[: len(tiny_corpus.SPECIAL_TOKENS)] = 0.0
    target = tmp_path / "target"
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    chat = tmp_path / "chat.jsonl"
    write_rows(chat, tiny_corpus.generate_conversations(tiny_corpus.build_vocabulary(SPEC.vocab_size), 4, seed=9))
    regenerator = EmbeddedRegenerator(target, tokenizer, max_new_tokens=5)
    options = PrepareOptions(chat, tmp_path / "train.jsonl", target, 256, regenerate="embedded", target_path=target)
    prepare(options, tokenizer=tokenizer, regenerator=regenerator, log=lambda *_: None)
    for row in iter_rows(options.output_path):
        with torch.no_grad():
            predicted = model(input_ids=torch.tensor([row.input_ids])).logits[0].argmax(-1).tolist()
        for start, end in _spans(row.loss_mask):
            reply = row.input_ids[start : end - 1]  # the answer, without the closing <|end|>
            assert len(reply) == 5
            assert reply == predicted[start - 1 : end - 2], "each regenerated token is the target's argmax"


def test_data_a_recipe_pins_is_never_replaced_by_other_data(
    tmp_path: Path, chat_file: Path, tokenizer_dir: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verified data file (its SHA-256 pinned by a recipe) is not overwritten by a run that would write
    other data there: refused with both digests, the file byte-identical, no temporary file left. The
    same data again is fine, and a folder given as --output leaves no temporary file either."""
    from tools import data_prepare

    out = tmp_path / "train.jsonl"
    options = PrepareOptions(input_path=chat_file, output_path=out, tokenizer_path=tokenizer_dir, max_length=256)
    pinned = prepare(options, tokenizer=tokenizer, log=lambda _: None).sha256
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "mine.yaml").write_text(f"data:\n  expected_sha256: {pinned}\n")
    monkeypatch.setattr(data_prepare, "RECIPES_DIR", recipes)
    before = out.read_bytes()
    assert prepare(options, tokenizer=tokenizer, log=lambda _: None).sha256 == pinned, "the same data: written again"

    shorter = dataclasses.replace(options, max_length=64)
    with pytest.raises(
        DataFileError, match=rf"holds the data recipes/mine.yaml pins \(sha256 {pinned}\).*nothing was written"
    ):
        prepare(shorter, tokenizer=tokenizer, log=lambda _: None)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["chat.jsonl", "recipes", "train.jsonl", "train.jsonl.manifest.json"]
    )

    folder = tmp_path / "a-folder"
    folder.mkdir()
    with pytest.raises(IsADirectoryError):
        prepare(dataclasses.replace(options, output_path=folder), tokenizer=tokenizer, log=lambda _: None)
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name], "no temporary file left"


class _HostileServer(http.server.BaseHTTPRequestHandler):
    """On 127.0.0.1: answers a redirect to ``/steal`` (recording what reaches it) or a 401 whose body
    quotes the request's Authorization header."""

    mode = "redirect"
    stolen: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        if type(self).mode == "redirect":
            self.send_response(302)
            self.send_header("Location", "/steal")
            self.end_headers()
            return
        body = f"unauthorized: you sent Authorization: {self.headers.get('Authorization')}".encode()
        self.send_response(401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        type(self).stolen.append(str(self.headers.get("Authorization")))
        payload = json.dumps({"choices": [{"message": {"content": "stolen answer"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("mode", ["redirect", "echo"])
def test_the_api_key_never_leaves_for_another_place_nor_reaches_the_console(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redirect is not followed (urllib re-sent the key to whatever host it named and wrote that host's
    answer into the data); a body that echoes the key is printed without it."""
    key = "Zq8xKp2vLm4nRt7wXy"
    monkeypatch.setenv("DSPARK_TEST_API_KEY", key)
    _HostileServer.mode, _HostileServer.stolen = mode, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HostileServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = OpenAIRegenerator(
            f"http://127.0.0.1:{server.server_address[1]}/v1", "m", retries=0, api_key_env="DSPARK_TEST_API_KEY"
        )
        with pytest.raises(RegenerationError) as err:
            client.reply([{"role": "user", "content": "hi"}])
    finally:
        server.shutdown()
        server.server_close()
    assert key not in str(err.value) and _HostileServer.stolen == []
    if mode == "redirect":
        assert "HTTP 302, a redirect to" in str(err.value) and "not followed" in str(err.value)
    else:
        assert "HTTP 401: unauthorized: you sent Authorization: Bearer <redacted>" in str(err.value)
