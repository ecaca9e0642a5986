"""The bad-input corpus: every command an operator types, given the mistakes operators make.

Each case runs one command in this process (its ``main``, the same function the command line calls)
in a fresh folder of job folders, recipes and data files, and asserts what a user must see:

- a non-zero exit and no traceback (an unexpected exception fails the case);
- the file, field or flag named, and a fix (each case lists the words that must appear);
- for the damage class, every file that existed before is byte-identical after, and no temporary
  file is left behind.

The table is the corpus; ``test_corpus_covers_every_command_and_kind`` keeps it from shrinking.
Nothing here starts a job, a server or a subprocess: the cases stay fast (the developer loop).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from launcher import cli as launcher_cli
from launcher.jobs import JobRecord, write_record
from runtime.probe.__main__ import main as probe_main
from runtime.recipe import load_recipe, write_resolved
from runtime.transport.__main__ import main as transport_main
from tools import compare_runs, data_prepare, data_verify, replay_decodes, room_walk, smoke_data, tiny_target
from tools.bench import speedup

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny.yaml"

COMMANDS: dict[str, Callable[[list[str] | None], int]] = {
    "launcher": launcher_cli.main,
    "prepare_data": data_prepare.main,
    "verify_data": data_verify.main,
    "compare_runs": compare_runs.main,
    "derive_smoke_data": smoke_data.main,
    "make_tiny_target": tiny_target.main,
    "transport": transport_main,
    "probe": probe_main,
    "room_walk": room_walk.main,
    "replay_decodes": replay_decodes.main,
    "speedup": speedup.main,
}

KINDS = ("damage", "secret", "load-time", "os", "empty", "message", "value", "flag", "job", "data")


@dataclass(frozen=True)
class Case:
    """One bad input: the command, its arguments (``{w}`` is the case's folder) and what must show."""

    id: str
    kind: str
    command: str
    argv: tuple[str, ...]
    expect: tuple[str, ...]
    """Substrings of the error output that must appear (the file/field/flag named, the fix)."""
    setup: Callable[[Path], None] | None = None
    keep: tuple[str, ...] = ()
    """Files (relative to the case folder) that must be byte-identical after the command."""
    not_root: bool = False
    """Permission cases: root reads everything, so they are skipped as root."""
    forbid: tuple[str, ...] = field(default=())
    """Substrings that must NOT appear (e.g. a secret's value)."""


# -- the world each case starts from -------------------------------------------------------------

METRICS_ROWS = [
    {"step": 1, "loss": 5.0, "lr": 0.001, "acc@0": 0.1, "time": 1.0},
    {"step": 2, "loss": 4.5, "lr": 0.002, "acc@0": 0.2, "time": 2.0},
]


def _job(world: Path, name: str, job_id: str, *, smoke: bool = False, metrics: bool = True) -> Path:
    loaded = load_recipe(TINY, smoke=smoke, display_name="recipes/tiny.yaml")
    job_dir = world / "runs" / "tiny" / name
    write_resolved(loaded, job_dir, REPO)
    (job_dir / "logs").mkdir()
    record = JobRecord(
        job_id=job_id,
        mode="local",
        name="tiny",
        job_dir=str(job_dir),
        recipe_source="recipes/tiny.yaml",
        recipe_digest=loaded.digest,
        smoke=smoke,
        probe=False,
        components={"capture": 1, "trainer": 4},
        supervisor_pid=None,
    )
    write_record(record, world / "runs")
    for component, count in record.components.items():
        for rank in range(count):
            record.log_path(component, rank).write_text(f"{component} {rank} done\n")
    if metrics:
        (job_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS_ROWS))
    status = {c: {"state": "COMPLETED", "tasks": n, "exit_codes": {}} for c, n in record.components.items()}
    (job_dir / "local_status.json").write_text(json.dumps(status))
    return job_dir


def build_world(world: Path) -> None:
    """Recipes; the tiny tokenizer (``tok/``) and a chat and prepared data of the tiny shape (``data/``),
    made here in seconds (the tiny target's weights, which take minutes to train, are not needed), whose
    digest the world's tiny recipe pins; a finished job (``runs/tiny/done``, id ``local-1``), a finished smoke
    job (``local-2``) and a job that never stepped (``local-3``)."""
    from runtime.shared.data_files import write_rows
    from tools import tiny_corpus
    from tools.data_prepare import PrepareOptions, prepare
    from tools.tiny_target import TinyTargetSpec, build_tokenizer

    (world / "recipes").mkdir(parents=True)
    (world / "data").mkdir()
    spec = TinyTargetSpec()
    build_tokenizer(spec).save_pretrained(world / "tok")
    # The corpus's own answers: the cases need a chat file of the tiny shape, not the target's answers.
    vocabulary = tiny_corpus.build_vocabulary(spec.vocab_size)
    chat_rows = tiny_corpus.generate_conversations(vocabulary, spec.chat_rows, spec.chat_seed, "tiny")
    write_rows(world / "data" / "chat.jsonl", chat_rows)
    prepared = prepare(
        PrepareOptions(world / "data" / "chat.jsonl", world / "data" / "train.jsonl", world / "tok", 256),
        log=lambda *_: None,
    )
    # The damage cases over "a verified file" need data a recipe pins by its digest (the repository's
    # tiny recipe pins through the manifest, since its data is what the target built on this machine says).
    pinned = TINY.read_text().replace("expected_sha256: manifest", f"expected_sha256: {prepared.sha256}", 1)
    assert pinned != TINY.read_text()
    (world / "recipes" / "tiny.yaml").write_text(pinned)
    _job(world, "done", "local-1")
    _job(world, "smoke", "local-2", smoke=True)
    _job(world, "fresh", "local-3", metrics=False)


def write(relative: str, content: str | bytes) -> Callable[[Path], None]:
    """A setup step that writes one file of the case folder."""

    def step(world: Path) -> None:
        path = world / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)

    return step


def tiny_with(old: str, new: str, name: str = "bad.yaml") -> Callable[[Path], None]:
    """A setup step writing ``recipes/<name>``: the tiny recipe with one text replaced."""

    def step(world: Path) -> None:
        text = TINY.read_text()
        assert old in text, old
        (world / "recipes" / name).write_text(text.replace(old, new, 1))

    return step


def mkdir(relative: str) -> Callable[[Path], None]:
    """A setup step making a folder."""
    return lambda world: (world / relative).mkdir(parents=True, exist_ok=True)


def chmod(relative: str, mode: int) -> Callable[[Path], None]:
    """A setup step changing a file's permissions."""
    return lambda world: os.chmod(world / relative, mode)


def steps(*parts: Callable[[Path], None]) -> Callable[[Path], None]:
    """Several setup steps in order."""

    def step(world: Path) -> None:
        for part in parts:
            part(world)

    return step


DRY = ("--dry-run",)
JOB = "{w}/runs/tiny/done"
SMOKE_JOB = "{w}/runs/tiny/smoke"
FRESH_JOB = "{w}/runs/tiny/fresh"
RUNS = ("--runs-dir", "{w}/runs")
# Made-up credentials, assembled here so that no credential-shaped literal sits in the file.
FAKE_KEY = "fake" * 5
FAKE_HF = "hf" + "_" + "fake" * 6
FAKE_HF_2 = "hf" + "_" + "made" * 6
FAKE_SK = "sk" + "-" + "fake" * 8
SHA_OF_NOTHING = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def L(*argv: str) -> tuple[str, ...]:
    return argv


# -- the corpus ----------------------------------------------------------------------------------

RECIPE_VALUES = [
    # --set on the tiny recipe: bad values name the field, the origin (--set) and the allowed range.
    ("lr-text", "trainer.optimizer.lr=fast", ("trainer.optimizer.lr", "--set")),
    ("lr-negative", "trainer.optimizer.lr=-1e-4", ("trainer.optimizer.lr", "greater than")),
    ("lr-absurd", "trainer.optimizer.lr=50", ("trainer.optimizer.lr", "less than")),
    ("lr-nan", "trainer.optimizer.lr=nan", ("trainer.optimizer.lr", "finite")),
    ("betas-one", "trainer.optimizer.betas=[0.9]", ("trainer.optimizer.betas",)),
    ("micro-batch-zero", "trainer.micro_batch_size=0", ("trainer.micro_batch_size", "greater than")),
    ("grad-accum-negative", "trainer.gradient_accumulation_steps=-2", ("trainer.gradient_accumulation_steps",)),
    ("global-batch-mismatch", "trainer.global_batch_size=7", ("global_batch_size", "fix")),
    ("epochs-zero", "trainer.epochs=0", ("trainer.epochs",)),
    ("time-limit-zero", "job.time_limit_min=0", ("job.time_limit_min",)),
    ("time-limit-absurd", "job.time_limit_min=99999999", ("job.time_limit_min", "less than")),
    ("name-empty", "job.name=", ("job.name",)),
    ("name-slash", "job.name=a/b", ("job.name", "plain folder name")),
    ("name-too-long", "job.name=" + "n" * 300, ("job.name",)),
    ("port-too-high", "transport.master_rpc_port=70000", ("transport.master_rpc_port", "65535")),
    ("port-zero", "transport.metadata_http_port=0", ("transport.metadata_http_port",)),
    ("port-clash", "transport.metrics_port=50151", ("50151", "fix")),
    ("master-port-clash", "job.master_port=50151", ("50151", "job.master_port")),
    ("watermarks-swapped", "transport.low_watermark_samples=64", ("low_watermark_samples", "fix")),
    ("bytes-garbage", "transport.global_segment_bytes=lots", ("transport.global_segment_bytes",)),
    ("bytes-negative", "transport.local_buffer_bytes=-5MiB", ("transport.local_buffer_bytes",)),
    ("sha-short", "data.expected_sha256=abc", ("data.expected_sha256", "64")),
    ("sha-non-hex", "data.expected_sha256=" + "z" * 64, ("data.expected_sha256",)),
    ("vocab-zero", "capture.vocab_size=0", ("capture.vocab_size",)),
    ("aux-layer-out-of-range", "capture.aux_layer_ids=[1, 3, 99]", ("aux_layer_ids", "99")),
    ("block-size-zero", "trainer.draft.block_size=0", ("trainer.draft.block_size",)),
    ("heads-not-dividing", "trainer.draft.num_key_value_heads=3", ("num_key_value_heads",)),
    ("device-typo", "trainer.device=gpu", ("trainer.device",)),
    ("cuda-without-gpus", "trainer.device=cuda", ("trainer.device", "gpus_per_node")),
    ("cpu-with-gpus", "job.trainer.gpus_per_node=4", ("trainer.device", "never uses")),
    ("dtype-typo", "trainer.param_dtype=float31", ("trainer.param_dtype",)),
    ("engine-typo", "capture.engine=sglangg", ("capture.engine",)),
    ("keep-last-zero", "trainer.checkpoint.keep_last=0", ("trainer.checkpoint.keep_last",)),
    ("stop-grace-negative", "job.stop_grace_s=-1", ("job.stop_grace_s",)),
    ("seed-text", "trainer.seed=seven", ("trainer.seed",)),
    ("unknown-field", "trainer.optimzer.lr=1e-4", ("trainer.optimzer", "optimizer")),
    ("unknown-section", "traner.seed=1", ("traner",)),
    ("no-equals", "trainer.seed", ("--set", "trainer.seed=VALUE")),
    ("empty-key", "=3", ("--set",)),
    ("set-on-section", "trainer=3", ("trainer",)),
    ("broken-list", "capture.aux_layer_ids=[1, 3", ("capture.aux_layer_ids",)),
    ("smoke-typo", "smoke.trainer.max_stepz=3", ("smoke", "max_stepz")),
    ("eval-negative-temperature", "eval.temperatures=[-1]", ("eval.temperatures",)),
    ("eval-zero-tokens", "eval.max_new_tokens=0", ("eval.max_new_tokens",)),
    ("log-every-zero", "trainer.log_every_steps=0", ("trainer.log_every_steps",)),
    ("warmup-negative", "trainer.schedule.warmup_steps=-1", ("trainer.schedule.warmup_steps",)),
]

LOAD_TIME = {
    "global-batch-mismatch",
    "port-clash",
    "master-port-clash",
    "watermarks-swapped",
    "aux-layer-out-of-range",
    "heads-not-dividing",
    "cuda-without-gpus",
    "cpu-with-gpus",
}
"""Cross-field checks that would otherwise fail inside the running job."""

CASES: list[Case] = [
    Case(
        f"set-{name}",
        "load-time" if name in LOAD_TIME else "value",
        "launcher",
        ("tiny", *DRY, "--set", override),
        expect,
    )
    for name, override, expect in RECIPE_VALUES
]
CASES.append(
    Case(
        "set-ranks-beyond-gpus",
        "load-time",
        "launcher",
        ("tiny", *DRY, "--set", "trainer.device=cuda", "--set", "job.trainer.gpus_per_node=2"),
        ("tasks_per_node", "gpus_per_node"),
    )
)

CASES += [
    # -- secrets: a credential anywhere the recipe renders is refused, and its value is never echoed
    Case(
        "secret-in-setup",
        "secret",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("job.setup", "submitting shell", "has 1 problem"),  # not again for the smoke overlay
        setup=tiny_with("  setup:\n", f"  setup:\n    - export WANDB_API_KEY={FAKE_KEY}\n"),
        forbid=(FAKE_KEY,),
    ),
    Case(
        "secret-in-set-setup",
        "secret",
        "launcher",
        ("tiny", *DRY, "--set", f"job.setup=['export HF_TOKEN={FAKE_HF}']"),
        ("job.setup",),
        forbid=(FAKE_HF,),
    ),
    Case(
        "secret-in-env",
        "secret",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("job.env", "submitting shell"),
        setup=tiny_with("  master_port: 29511\n", f"  master_port: 29511\n  env:\n    HF_TOKEN: {FAKE_HF_2}\n"),
        forbid=(FAKE_HF_2,),
    ),
    Case(
        "secret-in-description",
        "secret",
        "launcher",
        ("tiny", *DRY, "--set", f"description=key {FAKE_SK}"),
        ("description",),
        forbid=(FAKE_SK,),
    ),
    Case(
        "secret-in-api-key-env-value",
        "secret",
        "launcher",
        ("tiny", *DRY, "--set", f"job.python=WANDB_API_KEY={FAKE_KEY * 2} python3"),
        ("job.python",),
        forbid=(FAKE_KEY * 2,),
    ),
]

CASES += [
    # -- recipe files
    Case("recipe-missing", "os", "launcher", ("{w}/recipes/nope.yaml", *DRY), ("nope.yaml",)),
    Case("recipe-name-typo", "message", "launcher", ("tinyy", *DRY), ("tinyy", "tiny")),
    Case("recipe-is-folder", "os", "launcher", ("{w}/recipes", *DRY), ("recipes", "folder")),
    Case(
        "recipe-empty",
        "empty",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("bad.yaml", "empty"),
        write("recipes/bad.yaml", ""),
    ),
    Case(
        "recipe-indentation",
        "message",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("bad.yaml", "indent"),
        tiny_with("  time_limit_min: 30\n", "   time_limit_min: 30\n"),
    ),
    Case(
        "recipe-tab",
        "message",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("bad.yaml", "tab"),
        tiny_with("  time_limit_min: 30\n", "\ttime_limit_min: 30\n"),
    ),
    Case(
        "recipe-top-level-list",
        "message",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("bad.yaml", "mapping"),
        write("recipes/bad.yaml", "- job\n- trainer\n"),
    ),
    Case(
        "recipe-unquoted-zero-sha",
        "message",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("data.expected_sha256", "quote"),
        tiny_with(
            "expected_sha256: manifest",
            "expected_sha256: " + "1" * 64,  # all digits: YAML reads a number (all zeros stay text: YAML 1.2)
        ),
    ),
    Case(
        "recipe-number-as-name",
        "message",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("job.name",),
        tiny_with("  name: tiny\n", "  name: 12\n"),
    ),
    Case(
        "recipe-binary",
        "os",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("bad.yaml", "UTF-8"),
        write("recipes/bad.yaml", bytes(range(256))),
    ),
    Case(
        "recipe-unknown-section",
        "message",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("trainr",),
        tiny_with("\ntrainer:\n", "\ntrainr:\n  seed: 1\ntrainer:\n"),
    ),
    Case(
        "recipe-missing-section",
        "message",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("transport",),
        write("recipes/bad.yaml", TINY.read_text().split("\ntransport:\n")[0] + "\n"),
    ),
    Case(
        "recipe-empty-env-var",
        "message",
        "launcher",
        ("{w}/recipes/bad.yaml",),
        ("DSPARK_TEST_EMPTY_DIR", "empty"),
        tiny_with(
            "  train_path: .cache/tiny/data/train.jsonl\n", "  train_path: ${DSPARK_TEST_EMPTY_DIR}/train.jsonl\n"
        ),
    ),
    Case(
        "recipe-unset-env-var",
        "message",
        "launcher",
        ("{w}/recipes/bad.yaml",),
        ("DSPARK_TEST_UNSET_DIR", "not set"),
        tiny_with(
            "  train_path: .cache/tiny/data/train.jsonl\n", "  train_path: ${DSPARK_TEST_UNSET_DIR}/train.jsonl\n"
        ),
    ),
    Case(
        "recipe-unreadable",
        "os",
        "launcher",
        ("{w}/recipes/tiny.yaml", *DRY),
        ("tiny.yaml", "permission"),
        chmod("recipes/tiny.yaml", 0),
        not_root=True,
    ),
    Case(
        "recipe-data-missing",
        "data",
        "verify_data",
        ("--recipe", "{w}/recipes/bad.yaml"),
        ("nowhere.jsonl",),
        tiny_with("  train_path: .cache/tiny/data/train.jsonl\n", "  train_path: /nonexistent/nowhere.jsonl\n"),
    ),
]

CASES += [
    # -- launcher flags
    Case("flag-unknown", "flag", "launcher", ("tiny", "--dryrun"), ("--dryrun",)),
    Case("flag-two-modes", "flag", "launcher", ("tiny", "--dry-run", "--local"), ("--local", "--dry-run")),
    Case("flag-resume-unknown", "job", "launcher", ("tiny", *DRY, "--resume", "no-such-job"), ("no-such-job", "fix")),
    Case(
        "flag-resume-other-recipe",
        "job",
        "launcher",
        ("tiny", "--plan", "--resume", JOB, "--set", "trainer.draft.markov_rank=16"),
        ("trainer.draft.markov_rank 256 -> 16",),
    ),
    Case(
        "flag-resume-changes-a-result-field",
        "job",
        "launcher",
        ("tiny", "--plan", "--resume", JOB, "--set", "trainer.optimizer.lr=0.001"),
        ("trainer.optimizer.lr 0.005 -> 0.001", "--fork"),
    ),
    Case("flag-resume-and-fork", "flag", "launcher", ("tiny", *DRY, "--resume", JOB, "--fork", JOB), ("--fork",)),
    Case(
        "flag-resume-broken-record",
        "job",
        "launcher",
        ("tiny", *DRY, "--resume", JOB),
        ("job.json",),
        write("runs/tiny/done/job.json", "{not json"),
        keep=("runs/tiny/done/job.json",),
    ),
    Case("flag-no-recipe", "flag", "launcher", (), ("recipe",)),
    Case("flag-subcommand-typo", "flag", "launcher", ("stauts", "latest"), ("stauts",)),
]

# -- job commands: status, logs, cancel, gate, plots
JOB_COMMANDS: list[Case] = []
for command in ("status", "logs", "cancel", "gate", "plots"):
    JOB_COMMANDS += [
        Case(f"{command}-unknown-job", "job", "launcher", (command, "no-such-job", *RUNS), ("no-such-job", "fix")),
        Case(
            f"{command}-folder-without-record",
            "job",
            "launcher",
            (command, "{w}/data", *RUNS),
            ("data", "job.json"),
        ),
        Case(
            f"{command}-malformed-record",
            "os",
            "launcher",
            (command, JOB, *RUNS),
            ("job.json", "fix"),
            write("runs/tiny/done/job.json", '{"job_id": "local-1", '),
            keep=("runs/tiny/done/job.json",),
        ),
        Case(
            f"{command}-record-is-folder",
            "os",
            "launcher",
            (command, "{w}/runs/tiny/weird", *RUNS),
            ("job.json", "folder"),
            mkdir("runs/tiny/weird/job.json"),
        ),
        Case(
            f"{command}-record-wrong-fields",
            "job",
            "launcher",
            (command, JOB, *RUNS),
            ("job.json", "fix"),
            write("runs/tiny/done/job.json", json.dumps({"job": "x", "mode": "local"})),
        ),
        Case(
            f"{command}-record-binary",
            "os",
            "launcher",
            (command, JOB, *RUNS),
            ("job.json",),
            write("runs/tiny/done/job.json", b"\xff\xfe\x00garbage"),
        ),
    ]
CASES += JOB_COMMANDS

CASES += [
    Case("logs-rank-out-of-range", "job", "launcher", ("logs", JOB, "--rank", "99"), ("99", "trainer ranks 0..3")),
    Case("logs-rank-negative", "job", "launcher", ("logs", JOB, "--rank", "-1"), ("-1", "ranks 0..")),
    Case("logs-rank-text", "flag", "launcher", ("logs", JOB, "--rank", "one"), ("--rank", "one")),
    Case("logs-component-typo", "flag", "launcher", ("logs", JOB, "--component", "trainr"), ("--component", "trainr")),
    Case(
        "logs-capture-rank-9",
        "job",
        "launcher",
        ("logs", JOB, "--component", "capture", "--rank", "9"),
        ("capture", "9", "ranks 0..0"),
    ),
    Case(
        "status-malformed-local-status",
        "os",
        "launcher",
        ("status", JOB),
        ("local_status.json",),
        write("runs/tiny/done/local_status.json", "{"),
        keep=("runs/tiny/done/local_status.json",),
    ),
    Case(
        "status-runs-dir-is-file",
        "os",
        "launcher",
        ("status", "latest", "--runs-dir", "{w}/data/train.jsonl"),
        ("train.jsonl",),
    ),
    Case(
        "gate-not-smoke",
        "damage",
        "launcher",
        ("gate", JOB),
        ("not a --smoke job", "nothing was written"),
        keep=("runs/tiny/done/job.json", "runs/tiny/done/local_status.json"),
    ),
    Case(
        "cancel-finished-local-reused-pid",
        "damage",
        "launcher",
        ("cancel", JOB),
        ("local-1",),
        setup=lambda w: _record_pid(w, os.getpid()),
    ),
    Case("plots-no-steps", "empty", "launcher", ("plots", FRESH_JOB), ("metrics.jsonl",)),
    Case(
        "plots-empty-metrics",
        "empty",
        "launcher",
        ("plots", FRESH_JOB),
        ("metrics.jsonl", "no metrics record"),
        write("runs/tiny/fresh/metrics.jsonl", ""),
    ),
    Case(
        "plots-binary-metrics",
        "os",
        "launcher",
        ("plots", FRESH_JOB),
        ("metrics.jsonl", "not a text metrics file"),
        write("runs/tiny/fresh/metrics.jsonl", b"\x00\xff\xfe" * 50),
    ),
]


def _record_pid(world: Path, pid: int) -> None:
    """Make job local-1 record a supervisor pid that is alive but is not a supervisor (this test)."""
    path = world / "runs" / "tiny" / "done" / "job.json"
    data = json.loads(path.read_text())
    data["supervisor_pid"] = pid
    path.write_text(json.dumps(data))
    status = {
        c: {"state": "RUNNING", "tasks": n, "exit_codes": {}, "pids": {"0": pid}} for c, n in data["components"].items()
    }
    (path.parent / "local_status.json").write_text(json.dumps(status))


CASES += [
    # -- resolve: a job folder's recorded recipe is never rewritten
    Case(
        "resolve-other-recipe-over-job",
        "damage",
        "launcher",
        ("resolve", "tiny", "--job-dir", JOB, "--set", "trainer.seed=8"),
        ("recipe.resolved.json", "never rewritten", "new --job-dir"),
        keep=("runs/tiny/done/recipe.resolved.json",),
    ),
    Case(
        "resolve-broken-resolved",
        "damage",
        "launcher",
        ("resolve", "tiny", "--job-dir", JOB),
        ("recipe.resolved.json", "new --job-dir"),
        write("runs/tiny/done/recipe.resolved.json", "{"),
        keep=("runs/tiny/done/recipe.resolved.json",),
    ),
    Case(
        "resolve-job-dir-is-file",
        "os",
        "launcher",
        ("resolve", "tiny", "--job-dir", "{w}/recipes/tiny.yaml"),
        ("tiny.yaml",),
        keep=("recipes/tiny.yaml",),
    ),
    Case("resolve-no-job-dir", "flag", "launcher", ("resolve", "tiny"), ("--job-dir",)),
    Case(
        "resolve-bad-recipe",
        "value",
        "launcher",
        ("resolve", "tiny", "--job-dir", "{w}/new", "--set", "trainer.seed=x"),
        ("trainer.seed",),
    ),
    # -- render
    Case("render-unknown", "message", "launcher", ("render", "nosuch", "--stdout"), ("nosuch",)),
    Case(
        "render-bad-file",
        "value",
        "launcher",
        ("render", "{w}/recipes/bad.yaml", "--stdout"),
        ("bad.yaml",),
        write("recipes/bad.yaml", "job: [\n"),
    ),
    # -- eval
    Case("eval-unknown-job", "job", "launcher", ("eval", "no-such-job", *RUNS), ("no-such-job", "fix")),
    Case("eval-no-checkpoint", "empty", "launcher", ("eval", FRESH_JOB, "--local"), ("checkpoint", "fix")),
    Case(
        "eval-step-missing",
        "job",
        "launcher",
        ("eval", JOB, "--local", "--checkpoint", "step_999"),
        ("step_999",),
    ),
    Case(
        "eval-checkpoint-word",
        "job",
        "launcher",
        ("eval", JOB, "--local", "--checkpoint", "newest"),
        ("newest", "latest"),
    ),
    Case(
        "eval-set-unknown",
        "value",
        "launcher",
        ("eval", JOB, "--local", "--eval-set", "nope"),
        ("nope", "tiny-heldout"),
    ),
    Case(
        "eval-set-not-eval",
        "value",
        "launcher",
        ("eval", JOB, "--local", "--set", "trainer.seed=3"),
        ("trainer.seed", "eval."),
    ),
    Case(
        "eval-set-bad-value",
        "value",
        "launcher",
        ("eval", JOB, "--local", "--set", "eval.batch_size=zero"),
        ("eval.batch_size",),
    ),
    Case(
        "eval-out-is-file",
        "os",
        "launcher",
        ("eval", JOB, "--local", "--checkpoint", "untrained", "--out", "{w}/recipes/tiny.yaml"),
        ("tiny.yaml", "--out"),
        keep=("recipes/tiny.yaml",),
    ),
]

# -- tools/prepare_data
PREP = ("--tokenizer", "{w}/tok", "--max-length", "256")
GOOD_CHAT = (
    json.dumps(
        {"id": "a", "conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    )
    + "\n"
)
CASES += [
    Case("prep-no-args", "flag", "prepare_data", (), ("--input", "--recipe")),
    Case(
        "prep-input-missing",
        "os",
        "prepare_data",
        ("--input", "{w}/nope.jsonl", "--output", "{w}/o.jsonl", *PREP),
        ("nope.jsonl", "--input"),
    ),
    Case(
        "prep-input-folder",
        "os",
        "prepare_data",
        ("--input", "{w}/data", "--output", "{w}/o.jsonl", *PREP),
        ("data", "folder"),
    ),
    Case(
        "prep-input-binary",
        "os",
        "prepare_data",
        ("--input", "{w}/bin.jsonl", "--output", "{w}/o.jsonl", *PREP),
        ("bin.jsonl", "UTF-8"),
        write("bin.jsonl", b"\x89PNG\r\n\x1a\n\x00\x00\xff"),
    ),
    Case(
        "prep-input-bad-json",
        "data",
        "prepare_data",
        ("--input", "{w}/c.jsonl", "--output", "{w}/o.jsonl", *PREP),
        ("c.jsonl", "line 2", "JSON"),
        write("c.jsonl", GOOD_CHAT + "{oops\n"),
    ),
    Case(
        "prep-input-no-conversations",
        "data",
        "prepare_data",
        ("--input", "{w}/c.jsonl", "--output", "{w}/o.jsonl", *PREP),
        ("c.jsonl", "conversations"),
        write("c.jsonl", json.dumps({"id": "a", "messages": []}) + "\n"),
    ),
    Case(
        "prep-input-empty",
        "empty",
        "prepare_data",
        ("--input", "{w}/c.jsonl", "--output", "{w}/o.jsonl", *PREP),
        ("c.jsonl", "no rows"),
        write("c.jsonl", ""),
    ),
    Case(
        "prep-bad-role",
        "data",
        "prepare_data",
        ("--input", "{w}/c.jsonl", "--output", "{w}/o.jsonl", *PREP),
        ("c.jsonl", "robot"),
        write("c.jsonl", json.dumps({"id": "a", "conversations": [{"role": "robot", "content": "x"}]}) + "\n"),
    ),
    Case(
        "prep-output-is-folder",
        "damage",
        "prepare_data",
        ("--input", "{w}/data/chat.jsonl", "--output", "{w}/data", *PREP),
        ("data", "folder"),
        keep=("data/chat.jsonl", "data/train.jsonl"),
    ),
    Case(
        "prep-output-under-a-file",
        "os",
        "prepare_data",
        ("--input", "{w}/data/chat.jsonl", "--output", "{w}/recipes/tiny.yaml/o.jsonl", *PREP),
        ("tiny.yaml", "is a file"),
        keep=("recipes/tiny.yaml",),
    ),
    Case(
        "prep-over-verified-file",
        "damage",
        "prepare_data",
        ("--input", "{w}/c.jsonl", "--output", "{w}/data/train.jsonl", *PREP),
        ("train.jsonl", "pins", "another --output"),
        write("c.jsonl", GOOD_CHAT),
        keep=("data/train.jsonl", "data/train.jsonl.manifest.json"),
    ),
    Case(
        "prep-over-a-recipe",
        "damage",
        "prepare_data",
        ("--input", "{w}/data/chat.jsonl", "--output", "{w}/recipes/tiny.yaml", *PREP),
        ("tiny.yaml", "no data tool wrote it", "another --output"),
        keep=("recipes/tiny.yaml",),
    ),
    Case(
        "prep-over-a-chat-file",
        "damage",
        "prepare_data",
        ("--input", "{w}/c.jsonl", "--output", "{w}/data/chat.jsonl", *PREP),
        ("chat.jsonl", "no data tool wrote it"),
        write("c.jsonl", GOOD_CHAT),
        keep=("data/chat.jsonl",),
    ),
    Case(
        "prep-output-equals-input",
        "damage",
        "prepare_data",
        ("--input", "{w}/data/chat.jsonl", "--output", "{w}/data/chat.jsonl", *PREP),
        ("chat.jsonl", "--output"),
        keep=("data/chat.jsonl",),
    ),
    Case(
        "prep-tokenizer-missing",
        "os",
        "prepare_data",
        (
            "--input",
            "{w}/data/chat.jsonl",
            "--output",
            "{w}/o.jsonl",
            "--tokenizer",
            "{w}/no-tok",
            "--max-length",
            "64",
        ),
        ("no-tok", "--tokenizer"),
    ),
    Case(
        "prep-max-length-zero",
        "value",
        "prepare_data",
        (
            "--input",
            "{w}/data/chat.jsonl",
            "--output",
            "{w}/o.jsonl",
            "--tokenizer",
            "{w}/tok",
            "--max-length",
            "0",
        ),
        ("--max-length",),
    ),
    Case("prep-max-length-text", "flag", "prepare_data", ("--max-length", "long"), ("--max-length", "long")),
    Case(
        "prep-openai-no-url",
        "value",
        "prepare_data",
        ("--input", "{w}/data/chat.jsonl", "--output", "{w}/o.jsonl", *PREP, "--regenerate", "openai"),
        ("--server-url", "--server-model"),
    ),
    Case(
        "prep-api-key-env-unset",
        "secret",
        "prepare_data",
        (
            "--input",
            "{w}/data/chat.jsonl",
            "--output",
            "{w}/o.jsonl",
            *PREP,
            "--regenerate",
            "openai",
            "--server-url",
            "http://127.0.0.1:9",
            "--server-model",
            "m",
            "--api-key-env",
            "DSPARK_TEST_NO_SUCH_KEY",
        ),
        ("DSPARK_TEST_NO_SUCH_KEY",),
    ),
    Case("prep-recipe-unknown", "message", "prepare_data", ("--recipe", "nosuch"), ("nosuch",)),
    Case(
        "prep-negative-temperature",
        "value",
        "prepare_data",
        (
            "--input",
            "{w}/data/chat.jsonl",
            "--output",
            "{w}/o.jsonl",
            *PREP,
            "--regenerate",
            "embedded",
            "--temperature",
            "-1",
        ),
        ("--temperature",),
    ),
]

# -- tools/verify_data
CASES += [
    Case("verify-no-args", "flag", "verify_data", (), ("--recipe",)),
    Case("verify-missing", "os", "verify_data", ("{w}/nope.jsonl",), ("nope.jsonl",)),
    Case("verify-folder", "os", "verify_data", ("{w}/data",), ("data", "folder")),
    Case("verify-binary", "os", "verify_data", ("{w}/b.jsonl",), ("b.jsonl",), write("b.jsonl", b"\x00\x01\xff\xfe")),
    Case("verify-empty", "empty", "verify_data", ("{w}/e.jsonl",), ("e.jsonl", "no rows"), write("e.jsonl", "")),
    Case("verify-bad-json", "data", "verify_data", ("{w}/b.jsonl",), ("b.jsonl", "line 1"), write("b.jsonl", "{x\n")),
    Case(
        "verify-missing-ids",
        "data",
        "verify_data",
        ("{w}/b.jsonl",),
        ("b.jsonl", "input_ids"),
        write("b.jsonl", json.dumps({"id": "a", "loss_mask": [1]}) + "\n"),
    ),
    Case(
        "verify-sha-short",
        "value",
        "verify_data",
        ("{w}/data/train.jsonl", "--expected-sha256", "abc"),
        ("abc", "64"),
    ),
    Case(
        "verify-sha-manifest-missing",
        "data",
        "verify_data",
        ("{w}/t.jsonl", "--expected-sha256", "manifest"),
        ("manifest",),
        lambda w: shutil.copy(w / "data" / "train.jsonl", w / "t.jsonl"),
    ),
    Case(
        "verify-vocab-zero",
        "value",
        "verify_data",
        ("{w}/data/train.jsonl", "--vocab-size", "0"),
        ("--vocab-size",),
    ),
    Case(
        "verify-vocab-text", "flag", "verify_data", ("{w}/data/train.jsonl", "--vocab-size", "big"), ("--vocab-size",)
    ),
    Case(
        "verify-rows-negative",
        "value",
        "verify_data",
        ("{w}/data/train.jsonl", "--rows", "-1"),
        ("--rows",),
    ),
    Case("verify-recipe-unknown", "message", "verify_data", ("--recipe", "nosuch"), ("nosuch",)),
    Case(
        "verify-max-length-zero",
        "value",
        "verify_data",
        ("{w}/data/train.jsonl", "--max-length", "0"),
        ("--max-length",),
    ),
    Case(
        "verify-unreadable",
        "os",
        "verify_data",
        ("{w}/data/train.jsonl",),
        ("train.jsonl", "permission"),
        chmod("data/train.jsonl", 0),
        not_root=True,
    ),
]

# -- tools/compare_runs
CASES += [
    Case("compare-missing", "os", "compare_runs", ("{w}/nope",), ("nope", "metrics.jsonl")),
    Case("compare-folder-without-metrics", "empty", "compare_runs", ("{w}/data",), ("metrics.jsonl",)),
    Case("compare-no-steps", "empty", "compare_runs", (FRESH_JOB,), ("metrics.jsonl",)),
    Case(
        "compare-empty-metrics",
        "empty",
        "compare_runs",
        (FRESH_JOB,),
        ("no metrics record",),
        write("runs/tiny/fresh/metrics.jsonl", ""),
    ),
    Case(
        "compare-binary",
        "os",
        "compare_runs",
        (FRESH_JOB,),
        ("not a text metrics file",),
        write("runs/tiny/fresh/metrics.jsonl", b"\xff\x00" * 40),
    ),
    Case(
        "compare-line-without-step",
        "data",
        "compare_runs",
        (FRESH_JOB,),
        ("metrics.jsonl:2", "step"),
        write(
            "runs/tiny/fresh/metrics.jsonl",
            json.dumps({"step": 1, "loss": 1.0}) + "\n" + json.dumps({"loss": 2}) + "\n",
        ),
    ),
    Case("compare-b-missing", "os", "compare_runs", (JOB, "{w}/nope"), ("nope",)),
    Case(
        "compare-out-is-file",
        "os",
        "compare_runs",
        (JOB, "--out", "{w}/recipes/tiny.yaml"),
        ("tiny.yaml", "--out"),
        keep=("recipes/tiny.yaml",),
    ),
    Case("compare-top-negative", "value", "compare_runs", (JOB, JOB, "--top", "-1", "--no-plots"), ("--top",)),
    Case("compare-top-text", "flag", "compare_runs", (JOB, "--top", "many"), ("--top",)),
    Case(
        "compare-metrics-is-folder",
        "os",
        "compare_runs",
        (FRESH_JOB,),
        ("metrics.jsonl", "folder"),
        mkdir("runs/tiny/fresh/metrics.jsonl"),
    ),
    Case(
        "compare-step-not-integer",
        "data",
        "compare_runs",
        (FRESH_JOB,),
        ("metrics.jsonl:1",),
        write("runs/tiny/fresh/metrics.jsonl", json.dumps({"step": "one", "loss": 1.0}) + "\n"),
    ),
]

# -- tools/derive_smoke_data
CASES += [
    Case("smoke-data-no-args", "flag", "derive_smoke_data", (), ("--recipe",)),
    Case(
        "smoke-data-input-missing",
        "os",
        "derive_smoke_data",
        ("--input", "{w}/nope.jsonl", "--expected-sha256", SHA_OF_NOTHING, "--rows", "2", "--output", "{w}/s.jsonl"),
        ("nope.jsonl",),
    ),
    Case(
        "smoke-data-too-few-rows",
        "data",
        "derive_smoke_data",
        ("--input", "{w}/e.jsonl", "--expected-sha256", SHA_OF_NOTHING, "--rows", "2", "--output", "{w}/s.jsonl"),
        ("e.jsonl", "2"),
        write("e.jsonl", ""),
    ),
    Case(
        "smoke-data-sha-mismatch",
        "data",
        "derive_smoke_data",
        (
            "--input",
            "{w}/data/train.jsonl",
            "--expected-sha256",
            SHA_OF_NOTHING,
            "--rows",
            "2",
            "--output",
            "{w}/s.jsonl",
        ),
        ("train.jsonl", "--expected-sha256"),
    ),
    Case(
        "smoke-data-output-over-input",
        "damage",
        "derive_smoke_data",
        (
            "--input",
            "{w}/data/train.jsonl",
            "--expected-sha256",
            "manifest",
            "--rows",
            "2",
            "--output",
            "{w}/data/train.jsonl",
        ),
        ("train.jsonl", "--output"),
        keep=("data/train.jsonl", "data/train.jsonl.manifest.json"),
    ),
    Case(
        "smoke-data-over-a-chat-file",
        "damage",
        "derive_smoke_data",
        (
            "--input",
            "{w}/data/train.jsonl",
            "--expected-sha256",
            "manifest",
            "--rows",
            "2",
            "--output",
            "{w}/data/chat.jsonl",
        ),
        ("chat.jsonl", "no data tool wrote it"),
        keep=("data/chat.jsonl", "data/train.jsonl"),
    ),
    Case(
        "smoke-data-rows-zero",
        "value",
        "derive_smoke_data",
        ("--input", "{w}/data/train.jsonl", "--expected-sha256", "manifest", "--rows", "0", "--output", "{w}/s.jsonl"),
        ("--rows",),
    ),
    Case("smoke-data-recipe-unknown", "message", "derive_smoke_data", ("--recipe", "nosuch"), ("nosuch",)),
]


def fifo(relative: str) -> Callable[[Path], None]:
    """A setup step making a FIFO (a reader that opens it waits for a writer for ever)."""
    return lambda world: os.mkfifo(world / relative)


def symlink(relative: str, target: str) -> Callable[[Path], None]:
    """A setup step making a symbolic link (``target`` as given: relative to the link's folder)."""
    return lambda world: (world / relative).symlink_to(target)


SHELL_MARK = "touch PWN #"
CASES += [
    # -- issue 37: values a batch script line cannot hold safely are refused at load time (the
    # quoted ones are run under bash in tests/test_shell_safety.py)
    *[
        Case(
            f"script-newline-in-{field.replace('.', '-')}",
            "value",
            "launcher",
            ("{w}/recipes/bad.yaml", *DRY),
            (field, "control character", "one line"),
            setup=tiny_with(anchor, anchor + text),
        )
        for field, anchor, text in [
            ("job.partition", "  runs_dir: runs\n", f'  partition: "gpu\\n{SHELL_MARK}"\n'),
            ("job.account", "  runs_dir: runs\n", f'  account: "acct\\n{SHELL_MARK}"\n'),
            ("job.qos", "  runs_dir: runs\n", f'  qos: "\\r{SHELL_MARK}"\n'),
            ("job.trainer.constraint", "    tasks_per_node: 4\n", f'    constraint: "h200\\n{SHELL_MARK}"\n'),
            (
                "job.trainer.extra_sbatch",
                "    tasks_per_node: 4\n",
                f'    extra_sbatch: {{comment: "x\\n{SHELL_MARK}"}}\n',
            ),
            ("job.setup", "  setup:\n", '    - "echo a\\u0000b"\n'),
            ("job.container_image", "  runs_dir: runs\n", f'  container_image: "img\\n{SHELL_MARK}"\n'),
        ]
    ],
    Case(
        "script-newline-in-sbatch-key",
        "value",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("job.trainer.extra_sbatch", "sbatch option name"),
        setup=tiny_with(
            "    tasks_per_node: 4\n", f'    tasks_per_node: 4\n    extra_sbatch: {{"x\\n{SHELL_MARK}": y}}\n'
        ),
    ),
    Case(
        "script-name-trailing-newline",
        "value",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("job.name", "plain folder name"),
        setup=tiny_with("  name: tiny\n", '  name: "tiny\\n"\n'),
    ),
    *[
        Case(
            f"script-python-{name}",
            "value",
            "launcher",
            ("tiny", *DRY, "--set", f"job.python={value}"),
            ("job.python", "plain command name"),
        )
        for name, value in [
            ("command", "python3; touch PWN;"),
            ("space", "/opt/my env/bin/python3"),
            ("substitution", "$(touch PWN)"),
            ("empty", "''"),
        ]
    ],
    *[
        Case(
            f"bind-address-{name}",
            "value",
            "launcher",
            ("tiny", *DRY, "--set", f"transport.bind_address={value}"),
            ("transport.bind_address", "not an address"),
        )
        for name, value in [("command", "0.0.0.0; rm -rf /"), ("substitution", "$(touch PWN)"), ("space", "ib0 ib1")]
    ],
    Case(
        "runs-dir-empty",
        "empty",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("job.runs_dir", "repository root"),
        setup=tiny_with("  runs_dir: runs\n", "  runs_dir: ''\n"),
    ),
    Case(
        "runs-dir-other-home",
        "value",
        "launcher",
        ("tiny", *DRY, "--set", "job.runs_dir=~nobody/x"),
        ("job.runs_dir", "another user's home"),
    ),
    Case(
        "recipe-path-newline",
        "os",
        "launcher",
        ("{w}/recipes/r\ntouch PWN.yaml", *DRY),
        ("control character", "rename"),
        setup=lambda world: shutil.copy(TINY, world / "recipes" / "r\ntouch PWN.yaml"),
    ),
    Case(
        "recipe-fifo",
        "os",
        "launcher",
        ("{w}/recipes/pipe.yaml", *DRY),
        ("pipe.yaml", "fifo", "not a regular file"),
        setup=fifo("recipes/pipe.yaml"),
    ),
    Case(
        "recipe-symlink-loop",
        "os",
        "launcher",
        ("{w}/recipes/loop.yaml", *DRY),
        ("loop.yaml", "symbolic-link loop"),
        setup=steps(symlink("recipes/loop.yaml", "loop2.yaml"), symlink("recipes/loop2.yaml", "loop.yaml")),
    ),
    # -- issue 37: credentials beyond variable names, refused and never echoed
    *[
        Case(
            f"secret-{name}",
            "secret",
            "launcher",
            ("tiny", *DRY, "--set", override),
            (field, "credential"),
            forbid=(FAKE_KEY,),
        )
        for name, field, override in [
            (
                "netrc-heredoc",
                "job.setup",
                f"job.setup=['printf \"machine h login u password {FAKE_KEY}\" > ~/.netrc']",
            ),
            ("curl-user", "job.setup", f"job.setup=['curl -u bob:{FAKE_KEY} https://h/x']"),
            ("printf-v", "job.setup", f"job.setup=['printf -v HF_TOKEN %s {FAKE_KEY}']"),
            ("key-file", "job.setup", f"job.setup=['printf {FAKE_KEY} > ~/.wandb_key']"),
            (
                "srun-export",
                "job.trainer.srun_args",
                f"job.trainer.srun_args=['--export=ALL,WANDB_API_KEY={FAKE_KEY}']",
            ),
            (
                "sbatch-export",
                "job.trainer.extra_sbatch",
                f"job.trainer.extra_sbatch={{comment: 'ALL,HF_TOKEN={FAKE_KEY}'}}",
            ),
            ("url-chat-path", "data.chat_path", f"data.chat_path=https://user:{FAKE_KEY}@h/chat.jsonl"),
            ("url-revision", "capture.target_revision", f"capture.target_revision=https://bob:{FAKE_KEY}@h/r"),
            ("url-image", "job.container_image", f"job.container_image=https://u:{FAKE_KEY}@registry/img"),
        ]
    ],
    Case(
        "secret-server-env-got",
        "secret",
        "launcher",
        ("tiny", *DRY, "--set", f"capture.sglang.server_env={{HF_TOKEN: {FAKE_KEY}, X: [1]}}"),
        ("capture.sglang.server_env",),
        forbid=(FAKE_KEY,),
    ),
    Case(
        "tokens-field-not-redacted",
        "message",
        "launcher",
        ("tiny", *DRY, "--set", "eval.max_new_tokens=many"),
        ("eval.max_new_tokens=many", "eval.max_new_tokens"),
        forbid=("<redacted>",),
    ),
]

CASES += [
    # -- issue 37: a command writes only where it may (runtime.user_errors.output_place)
    Case(
        "tiny-out-is-a-file",
        "damage",
        "make_tiny_target",
        ("--out", "{w}/victim.txt", "--chat-out", "{w}/c.jsonl", "--eval-out", "{w}/e.jsonl"),
        ("--out", "is a file"),
        setup=write("victim.txt", "keep me\n"),
        keep=("victim.txt",),
    ),
    Case(
        "tiny-out-is-a-user-folder",
        "damage",
        "make_tiny_target",
        ("--out", "{w}/victim", "--chat-out", "{w}/c.jsonl", "--eval-out", "{w}/e.jsonl"),
        ("--out", "not a tiny target", "nothing was touched"),
        setup=steps(write("victim/keep.txt", "keep\n"), write("victim/sub/data.bin", b"\x00\x01")),
        keep=("victim/keep.txt", "victim/sub/data.bin"),
    ),
    Case(
        "tiny-out-links-to-root",
        "damage",
        "make_tiny_target",
        ("--out", "{w}/rootlink", "--chat-out", "{w}/c.jsonl", "--eval-out", "{w}/e.jsonl"),
        ("--out", "filesystem root", "symbolic link"),
        setup=symlink("rootlink", "/"),
    ),
    Case(
        "tiny-chat-and-eval-one-file",
        "damage",
        "make_tiny_target",
        ("--out", "{w}/t", "--chat-out", "{w}/data/chat.jsonl", "--eval-out", "{w}/data/./chat.jsonl"),
        ("--chat-out", "--eval-out", "same file"),
        keep=("data/chat.jsonl",),
    ),
    Case(
        "tiny-chat-inside-out",
        "damage",
        "make_tiny_target",
        ("--out", "{w}/t", "--chat-out", "{w}/t/chat.jsonl", "--eval-out", "{w}/e.jsonl"),
        ("--chat-out", "inside --out"),
    ),
    Case(
        "tiny-eval-out-fifo",
        "os",
        "make_tiny_target",
        ("--out", "{w}/t", "--chat-out", "{w}/c.jsonl", "--eval-out", "{w}/pipe"),
        ("--eval-out", "fifo", "not a regular file"),
        setup=fifo("pipe"),
    ),
    Case(
        "tiny-train-steps-negative",
        "value",
        "make_tiny_target",
        ("--train-steps", "-5"),
        ("--train-steps", "at least 1"),
    ),
    Case(
        "resolve-job-dir-links-to-root",
        "damage",
        "launcher",
        ("resolve", "tiny", "--job-dir", "{w}/rootlink"),
        ("--job-dir", "filesystem root"),
        setup=symlink("rootlink", "/"),
    ),
    *[
        Case(
            f"resolve-slurm-job-id-{name}",
            "flag",
            "launcher",
            ("resolve", "tiny", "--job-dir", "{w}/newjob", "--slurm-job-id", value),
            ("--slurm-job-id", "not a slurm job id", "nothing was written"),
        )
        for name, value in [("path", "../../recipes/tiny.yaml"), ("slash", "a/b"), ("newline", "12\n34")]
    ],
]


def edit_record(**changes: object) -> Callable[[Path], None]:
    """A setup step editing job local-1's job.json (a damaged or hand-edited record)."""

    def step(world: Path) -> None:
        path = world / "runs" / "tiny" / "done" / "job.json"
        data = json.loads(path.read_text())
        data.update(changes)
        path.write_text(json.dumps(data))

    return step


def facts(name: str, measured: object, skipped: object = None) -> Callable[[Path], None]:
    """A setup step writing ``facts/<name>``: a probe facts file with these measured facts."""
    body = {"component": "trainer", "host": "n1", "time": "t", "measured": measured, "skipped": skipped or {}}
    return write(f"facts/{name}", json.dumps(body))


GOOD_FACT = {"value": 5.0, "how": "a put"}
CASES += [
    # -- issue 37: every failure one line (these were tracebacks)
    *[
        Case(f"record-{name}", "job", "launcher", (command, "local-1", *RUNS), (field, "job.json", "fix"), setup=edit)
        for name, command, field, edit in [
            ("pid-text", "cancel", "supervisor_pid", edit_record(supervisor_pid="123")),
            ("pid-bool", "cancel", "supervisor_pid", edit_record(supervisor_pid=True)),
            ("tasks-text", "status", "components", edit_record(components={"capture": 1, "trainer": "4"})),
            ("components-list", "logs", "components", edit_record(components=["capture", "trainer"])),
            ("tasks-huge", "logs", "components", edit_record(components={"capture": 1, "trainer": 10**9})),
            ("mode-weird", "status", "mode", edit_record(mode="weird")),
        ]
    ],
    Case(
        "record-fifo",
        "os",
        "launcher",
        ("status", "{w}/runs/tiny/fifo", *RUNS),
        ("job.json", "fifo", "not a regular file"),
        setup=steps(mkdir("runs/tiny/fifo"), fifo("runs/tiny/fifo/job.json")),
    ),
    Case(
        "local-status-fifo",
        "os",
        "launcher",
        ("status", "local-1", *RUNS),
        ("local_status.json", "fifo", "not a regular file"),
        setup=lambda w: (
            (w / "runs/tiny/done/local_status.json").unlink(),
            os.mkfifo(w / "runs/tiny/done/local_status.json"),
        ),
    ),
    Case(
        "plots-metrics-fifo",
        "os",
        "launcher",
        ("plots", "local-1", *RUNS),
        ("metrics.jsonl", "fifo", "not a regular file"),
        setup=lambda w: ((w / "runs/tiny/done/metrics.jsonl").unlink(), os.mkfifo(w / "runs/tiny/done/metrics.jsonl")),
    ),
    Case(
        "compare-fifo", "os", "compare_runs", ("{w}/pipe", "{w}/runs/tiny/done"), ("pipe", "fifo"), setup=fifo("pipe")
    ),
    Case(
        "compare-symlink-loop",
        "os",
        "compare_runs",
        ("{w}/loop", "{w}/runs/tiny/done"),
        ("loop", "symbolic-link loop"),
        setup=steps(symlink("loop", "loop2"), symlink("loop2", "loop")),
    ),
    Case("compare-same-run", "flag", "compare_runs", (JOB, JOB + "/"), ("same run", "two different")),
    *[
        Case(
            f"site-facts-{name}",
            "load-time",
            "launcher",
            (
                "tiny",
                "--plan",
                "--site-facts",
                "{w}/facts/" + ("facts_b.json" if name == "disagree" else "facts_a.json"),
            ),
            expect,
            setup=setup,
        )
        for name, expect, setup in [
            (
                "value-list",
                ("store_put_gbps", "not a number"),
                facts("facts_a.json", {"store_put_gbps": {"value": [1], "how": "x"}}),
            ),
            ("bare-number", ("store_put_gbps", '"value"'), facts("facts_a.json", {"store_put_gbps": 5})),
            ("no-how", ("store_put_gbps", '"how"'), facts("facts_a.json", {"store_put_gbps": {"value": 5}})),
            ("no-value", ("store_put_gbps", '"value"'), facts("facts_a.json", {"store_put_gbps": {"how": "x"}})),
            (
                "value-text",
                ("store_put_gbps", "not a number"),
                facts("facts_a.json", {"store_put_gbps": {"value": "fast", "how": "x"}}),
            ),
            (
                "value-bool",
                ("store_put_gbps", "not a number"),
                facts("facts_a.json", {"store_put_gbps": {"value": True, "how": "x"}}),
            ),
            ("measured-list", ("measured",), facts("facts_a.json", [1, 2])),
            ("skipped-list", ("skipped",), facts("facts_a.json", {}, [1])),
        ]
    ],
    Case(
        "site-facts-disagree",
        "load-time",
        "launcher",
        ("tiny", "--plan", "--site-facts", "{w}/facts"),
        ("facts_a.json", "facts_b.json", "disagree", "store_put_gbps"),
        setup=steps(
            facts("facts_a.json", {"store_put_gbps": GOOD_FACT}),
            facts("facts_b.json", {"store_put_gbps": {"value": 9.0, "how": "a put"}}),
        ),
    ),
    *[
        Case(
            f"yaml-{name}",
            "message",
            "launcher",
            ("{w}/recipes/bad.yaml", "--plan"),
            expect,
            setup=write("recipes/bad.yaml", text),
        )
        for name, expect, text in [
            ("complex-key", ("complex key", "not a name"), (TINY.read_text() + "? [a, b]\n: 1\n")),
            (
                "recursive-alias",
                ("cycle",),
                TINY.read_text().replace("smoke:\n", "smoke: &s\n  smoke: *s\nsmoke_old:\n", 1),
            ),
            ("deep-nesting", ("nested",), TINY.read_text() + "deep: " + "[" * 5000 + "]" * 5000 + "\n"),
            (
                "expansion-bomb",
                ("expands to more than", "expansion bomb"),
                "".join(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}" if i else "lol"] * 9) + "]\n" for i in range(9)),
            ),
            ("too-many-aliases", ("aliases",), "a: &a 1\nb: [" + ", ".join(["*a"] * 300) + "]\n"),
        ]
    ],
    Case(
        "yaml-unquoted-digits",
        "message",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("job.partition", "quote it"),
        setup=tiny_with("  runs_dir: runs\n", "  runs_dir: runs\n  partition: 12345\n"),
    ),
    Case(
        "yaml-base-60-epochs",
        "message",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("trainer.epochs", "1:30"),
        setup=lambda w: (w / "recipes" / "bad.yaml").write_text(
            re.sub(r"\n  epochs: \d+\n", "\n  epochs: 1:30\n", TINY.read_text(), count=1)
        ),
    ),
    Case(
        "checkpoint-copy-named-tmp",
        "job",
        "launcher",
        ("eval", "local-1", *RUNS, "--checkpoint", "{w}/mydraft"),
        ("mydraft", "step_", "fix"),
        setup=write("mydraft/trainer_state.json", "{}"),
    ),
]
CASES.append(
    Case(
        "checkpoint-tmp-folder-ignored",
        "job",
        "launcher",
        ("eval", "local-1", *RUNS, "--checkpoint", "latest"),
        ("latest", "no complete checkpoint"),
        setup=write("runs/tiny/done/checkpoints/step_00000040.tmp/trainer_state.json", "{}"),
    )
)

CHAT_ROW = {"id": "r1", "conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
CASES += [
    # -- issue 37: values that cannot work are refused at load time, before anything starts
    *[
        Case(f"load-{name}", "load-time", "launcher", ("tiny", *DRY, "--set", override), expect)
        for name, override, expect in [
            ("seed-beyond-64-bit", f"trainer.seed={10**26}", ("trainer.seed", "9223372036854775807")),
            ("prompt-seed-negative", "trainer.prompt_seed=-3", ("trainer.prompt_seed", ">= 0")),
            ("eval-seed-beyond-64-bit", f"eval.seed={2**64}", ("eval.seed",)),
            ("eos-outside-vocab", "capture.special_tokens.eos_id=99999", ("eos_id", "vocabulary", "2047")),
            ("stop-id-outside-vocab", "eval.stop_token_ids=[2, 99999]", ("eval.stop_token_ids[1]", "vocabulary")),
            ("stop-id-negative", "eval.stop_token_ids=[-8]", ("eval.stop_token_ids",)),
            ("warmup-beyond-run", "trainer.schedule.warmup_steps=100", ("warmup_steps", "96 optimizer steps")),
        ]
    ],
    Case(
        "eval-stop-id-outside-vocab",
        "load-time",
        "launcher",
        ("eval", "local-1", *RUNS, "--set", "eval.stop_token_ids=[99999]"),
        ("eval.stop_token_ids[0]", "vocabulary"),
    ),
    Case("flag-resume-empty", "flag", "launcher", ("tiny", *DRY, "--resume", ""), ("--resume", "empty")),
    Case(
        "flag-set-twice",
        "flag",
        "launcher",
        ("tiny", *DRY, "--set", "trainer.seed=1", "--set", "trainer.seed=2"),
        ("trainer.seed", "set twice", "trainer.seed=1", "trainer.seed=2"),
    ),
    Case(
        "eval-set-twice",
        "flag",
        "launcher",
        ("eval", "local-1", *RUNS, "--set", "eval.seed=1", "--set", "eval.seed=2"),
        ("eval.seed", "set twice"),
    ),
    Case(
        "known-jobs-without-locks",
        "job",
        "launcher",
        ("status", "nope", *RUNS),
        ("known jobs: latest, local-1, local-2, local-3.",),
        setup=write("runs/jobs/.local-start.lock", ""),
        forbid=(".local-start.lock",),
    ),
    Case(
        "prep-duplicate-ids",
        "data",
        "prepare_data",
        ("--input", "{w}/dup.jsonl", "--output", "{w}/o.jsonl", *PREP),
        ("dup.jsonl", "line 2", "given again", "line 1"),
        setup=write("dup.jsonl", (json.dumps(CHAT_ROW) + "\n") * 2),
    ),
    Case(
        "prep-input-fifo",
        "os",
        "prepare_data",
        ("--input", "{w}/pipe", "--output", "{w}/o.jsonl", *PREP),
        ("--input", "fifo", "not a regular file"),
        setup=fifo("pipe"),
    ),
]


def test_a_chat_file_with_a_byte_order_mark_reads_as_without(tmp_path: Path) -> None:
    """A UTF-8 BOM (Windows editors write one) is not data: the rows are the same as without it."""
    from tools.data_prepare import read_chat_rows

    plain, marked = tmp_path / "plain.jsonl", tmp_path / "bom.jsonl"
    plain.write_text(json.dumps(CHAT_ROW) + "\n")
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    strip = [{k: v for k, v in row.items() if k != "_where"} for row in read_chat_rows(plain)]
    assert [{k: v for k, v in row.items() if k != "_where"} for row in read_chat_rows(marked)] == strip


@pytest.mark.skipif(__import__("importlib").util.find_spec("torch") is None, reason="the eval runner needs torch")
def test_eval_on_cuda_without_a_gpu_is_one_user_error() -> None:
    import torch

    from runtime.evaluate.runner import pick_device
    from runtime.user_errors import UserError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(UserError, match="eval.device=cpu"):
        pick_device("cuda")


SERVER = ("--input", "{w}/data/chat.jsonl", "--output", "{w}/o.jsonl", *PREP, "--regenerate", "openai")
CASES += [
    # -- issue 37: prepare_data's server address and key, never echoed
    Case(
        "prep-server-url-password",
        "secret",
        "prepare_data",
        (*SERVER, "--server-url", f"http://user:{FAKE_KEY}@127.0.0.1:9/v1", "--server-model", "m"),
        ("--server-url", "password", "--api-key-env"),
        forbid=(FAKE_KEY,),
    ),
    Case(
        "prep-server-url-file",
        "value",
        "prepare_data",
        (*SERVER, "--server-url", "file:///etc/passwd", "--server-model", "m"),
        ("--server-url", "http://"),
    ),
    Case(
        "prep-api-key-given-as-name",
        "secret",
        "prepare_data",
        (*SERVER, "--server-url", "http://127.0.0.1:9", "--server-model", "m", "--api-key-env", FAKE_SK),
        ("--api-key-env", "name of an environment variable"),
        forbid=(FAKE_SK,),
    ),
    # -- environment names and YAML that is not a plain value
    *[
        Case(f"env-{name}", "value", "launcher", ("tiny", *DRY, "--set", override), expect)
        for name, override, expect in [
            ("name-with-space", "job.env={A B=C: x}", ("job.env", "not an environment variable name")),
            ("name-empty", "job.env={'': x}", ("job.env", "not an environment variable name")),
            ("contract-name", "job.env.DSPARK_JOB_DIR=/x", ("job.env", "environment contract")),
            ("path-empty", "job.env.PATH=", ("job.env", "PATH")),
        ]
    ],
    Case(
        "set-python-tag",
        "message",
        "launcher",
        ("tiny", *DRY, "--set", "trainer.seed=!!python/name:os.system"),
        ("trainer.seed", "remove the tag"),
    ),
    Case(
        "set-undefined-alias",
        "message",
        "launcher",
        ("tiny", *DRY, "--set", "trainer.seed=*nothing"),
        ("trainer.seed", "anchor"),
    ),
    Case(
        "set-duplicate-key-in-value",
        "message",
        "launcher",
        ("tiny", *DRY, "--set", "trainer.optimizer={lr: 1e-3, lr: 2e-3}"),
        ("trainer.optimizer", "duplicate key"),
    ),
    *[
        Case(
            f"yaml-key-{name}",
            "message",
            "launcher",
            ("{w}/recipes/bad.yaml", "--plan"),
            ("not a name", "quote"),
            setup=tiny_with("  name: tiny\n", "  name: tiny\n" + key),
        )
        for name, key in [("int", "  123: x\n"), ("null", "  ~: x\n")]
    ],
]


def test_a_merge_key_works_in_a_recipe(tmp_path: Path) -> None:
    """``<<: *anchor`` (a YAML merge key) merges, the mapping's own keys winning: the trainer's
    resources written as the capture's plus its own task count give the very same recipe."""
    text = TINY.read_text()
    capture = "  capture:\n    nodes: 1\n    gpus_per_node: 0\n    tasks_per_node: 1\n    cpus_per_task: 1\n"
    trainer = "  trainer:\n    nodes: 1\n    gpus_per_node: 0\n    tasks_per_node: 4\n    cpus_per_task: 1\n"
    assert capture in text and trainer in text
    merged = text.replace(capture, capture.replace("  capture:", "  capture: &resources"), 1)
    merged = merged.replace(trainer, "  trainer:\n    <<: *resources\n    tasks_per_node: 4\n", 1)
    (tmp_path / "merged.yaml").write_text(merged)
    assert load_recipe(tmp_path / "merged.yaml").digest == load_recipe(TINY).digest


def test_yaml_reads_digits_dates_and_base_60_as_text() -> None:
    from runtime.recipe.loader import parse_yaml

    data = parse_yaml("a: 0755\nb: 1:30\nc: 2024-01-01\nd: no\ne: true\nf: 12\ng: 1.5\n")
    assert data == {"a": "0755", "b": "1:30", "c": "2024-01-01", "d": "no", "e": True, "f": 12, "g": 1.5}


CASES += [
    Case(
        "set-bool-in-id-list",
        "value",
        "launcher",
        ("tiny", *DRY, "--set", "capture.aux_layer_ids=[true, 3, 5]"),
        ("capture.aux_layer_ids[0]", "true/false is a boolean"),
    ),
    *[
        Case(f"compare-{name}", "data", "compare_runs", ("{w}/m.jsonl", JOB), expect, setup=write("m.jsonl", text))
        for name, text, expect in [
            ("loss-text", '{"step": 1, "loss": "high", "lr": 0.001}\n', ("m.jsonl:1", "loss", "not a number")),
            ("step-negative", '{"step": -4, "loss": 1.0}\n', ("m.jsonl:1", "step -4")),
        ]
    ],
]


CASES += [
    Case("verify-fifo", "os", "verify_data", ("{w}/pipe",), ("pipe", "fifo", "not a regular file"), setup=fifo("pipe")),
    Case(
        "plan-rate-denormal",
        "value",
        "launcher",
        ("tiny", "--plan", "--set", "plan.link_gbps=5e-324"),
        ("plan.link_gbps", "0.001"),
    ),
    Case(
        "set-list-index",
        "flag",
        "launcher",
        ("tiny", *DRY, "--set", "capture.aux_layer_ids[1]=4"),
        ("capture.aux_layer_ids", "whole list"),
    ),
]

CASES.append(
    Case(
        "prep-device-missing",
        "value",
        "prepare_data",
        (
            "--input",
            "{w}/data/chat.jsonl",
            "--output",
            "{w}/o.jsonl",
            *PREP,
            "--regenerate",
            "embedded",
            "--device",
            "cuda:7",
        ),
        ("--device", "cuda:7", "cuda device"),
    )
)

CASES += [
    Case(
        "verify-manifest-is-a-list",
        "data",
        "verify_data",
        ("{w}/data/train.jsonl", "--expected-sha256", "manifest"),
        ("manifest", "json list", "regenerate"),
        setup=write("data/train.jsonl.manifest.json", "[1, 2]"),
    ),
    Case(
        "plots-link-leaves-the-job",
        "damage",
        "launcher",
        ("plots", "local-1", *RUNS),
        ("plots", "outside", "remove the link"),
        setup=steps(mkdir("outside_plots"), symlink("runs/tiny/done/plots", "../../../outside_plots")),
    ),
]

CASES.append(
    Case(
        "secret-resolve-url",
        "secret",
        "launcher",
        ("resolve", "tiny", "--job-dir", "{w}/newjob", "--set", f"data.chat_path=https://u:{FAKE_KEY}@h/chat.jsonl"),
        ("data.chat_path", "credential"),
        forbid=(FAKE_KEY,),
    )
)

CASES += [
    Case(
        "eval-set-name-newline",
        "value",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("eval.sets[0].name", "one line"),
        setup=tiny_with("    - name: tiny-heldout\n", '    - name: "tiny\\nheldout"\n'),
    ),
    Case(
        "store-id-path",
        "value",
        "launcher",
        ("tiny", *DRY, "--set", "transport.store_id=../x"),
        ("transport.store_id", "no '/'"),
    ),
]

CASES += [
    Case(
        "compare-out-links-to-root",
        "damage",
        "compare_runs",
        (JOB, "--out", "{w}/rootlink"),
        ("--out", "filesystem root"),
        setup=symlink("rootlink", "/"),
    ),
    Case(
        "eval-out-links-to-root",
        "damage",
        "launcher",
        ("eval", "local-1", *RUNS, "--local", "--checkpoint", "untrained", "--out", "{w}/rootlink"),
        ("--out", "filesystem root"),
        setup=symlink("rootlink", "/"),
    ),
]

# -- issue 44: the classes closed by construction, with variants of their own ---------------------
# One write gate: the root, a home folder, the checkout, its checked-in folders and files, for every writer.
CASES += [
    Case(f"gate-{name}", "damage", command, argv, expect)
    for name, command, argv, expect in [
        (
            "chat-out-recipe",
            "make_tiny_target",
            ("--chat-out", str(TINY)),
            ("--chat-out", "checked-in folder recipes/"),
        ),
        (
            "eval-out-readme",
            "make_tiny_target",
            ("--eval-out", str(REPO / "README.md")),
            ("--eval-out", "checked-in file"),
        ),
        ("chat-out-pyproject", "make_tiny_target", ("--chat-out", str(REPO / "pyproject.toml")), ("checked-in file",)),
        (
            "target-out-tools",
            "make_tiny_target",
            ("--out", str(REPO / "tools" / "t")),
            ("--out", "checked-in folder tools/"),
        ),
        ("target-out-checkout", "make_tiny_target", ("--out", str(REPO)), ("--out", "repository itself")),
        (
            "ckpt-recipes",
            "launcher",
            ("tiny", *DRY, "--set", "trainer.checkpoint.dir=recipes"),
            ("trainer.checkpoint.dir", "recipes/"),
        ),
        (
            "ckpt-root",
            "launcher",
            ("tiny", "--plan", "--set", "trainer.checkpoint.dir=/"),
            ("trainer.checkpoint.dir", "filesystem root"),
        ),
        (
            "ckpt-git",
            "launcher",
            ("tiny", "--plan", "--set", "trainer.checkpoint.dir=.git/x"),
            ("trainer.checkpoint.dir", ".git/"),
        ),
        (
            "ckpt-dotdot",
            "launcher",
            ("tiny", "--plan", "--set", f"trainer.checkpoint.dir={REPO}/runs/../patches"),
            ("patches/",),
        ),
        (
            "runs-sbatch",
            "launcher",
            ("tiny", *DRY, "--set", f"job.runs_dir={REPO / 'sbatch'}"),
            ("job.runs_dir", "sbatch/"),
        ),
        (
            "runs-home-other",
            "launcher",
            ("tiny", "--plan", "--set", "job.runs_dir=/home/someone"),
            ("job.runs_dir", "home folder"),
        ),
        (
            "cache-tests",
            "launcher",
            (
                "tiny",
                "--plan",
                "--set",
                "trainer.feature_cache.enabled=true",
                "--set",
                f"trainer.feature_cache.dir={REPO / 'tests'}",
            ),
            ("trainer.feature_cache.dir", "tests/"),
        ),
        (
            "prepare-out-runtime",
            "prepare_data",
            ("--input", "{w}/data/chat.jsonl", "--output", str(REPO / "runtime" / "x.jsonl"), *PREP),
            ("--output", "checked-in folder runtime/"),
        ),
        (
            "smoke-out-launcher",
            "derive_smoke_data",
            (
                "--input",
                "{w}/data/train.jsonl",
                "--expected-sha256",
                "manifest",
                "--rows",
                "2",
                "--output",
                str(REPO / "launcher" / "x.jsonl"),
            ),
            ("--output", "launcher/"),
        ),
        ("compare-out-tests", "compare_runs", (JOB, "--out", str(REPO / "tests" / "plots")), ("--out", "tests/")),
        (
            "eval-out-patches",
            "launcher",
            ("eval", "local-1", *RUNS, "--local", "--checkpoint", "untrained", "--out", str(REPO / "patches" / "e")),
            ("--out", "patches/"),
        ),
    ]
]
# One Slurm argument builder: options the launcher sets, leading dashes, timing that Slurm would misread.
CASES += [
    Case(f"slurm-{name}", "value", "launcher", ("tiny", *DRY, *[a for o in sets for a in ("--set", o)]), expect)
    for name, sets, expect in [
        ("python-option", ["job.python=--export=NONE"], ("job.python", "leading -")),
        ("python-short-option", ["job.python=-u"], ("job.python", "leading -")),
        ("extra-time", ["job.trainer.extra_sbatch.time='99999'"], ("extra_sbatch", "--time", "job.time_limit_min")),
        ("extra-mem-prefix", ["job.capture.extra_sbatch.me=1G"], ("extra_sbatch", "--mem")),
        ("extra-output", ["job.trainer.extra_sbatch.output=/etc/cron.d/x"], ("extra_sbatch", "--output")),
        ("extra-chdir", ["job.capture.extra_sbatch.chdir=/"], ("extra_sbatch", "--chdir")),
        ("extra-export", ["job.capture.extra_sbatch.export=NONE"], ("extra_sbatch", "--export")),
        ("extra-gres", ["job.trainer.extra_sbatch.gres=gpu:1"], ("extra_sbatch", "--gres")),
        ("extra-dependency", ["job.trainer.extra_sbatch.dependency=afterok:1"], ("extra_sbatch", "--dependency")),
        ("signal-beyond-limit", ["job.signal_delay_s=7200"], ("job.signal_delay_s", "half")),
        (
            "grace-beyond-signal",
            ["job.stop_grace_s=3600", "job.signal_delay_s=10"],
            ("job.stop_grace_s", "job.signal_delay_s"),
        ),
        (
            "heartbeat-beyond-idle",
            ["transport.heartbeat_interval_s=600", "transport.idle_timeout_s=5"],
            ("heartbeat_interval_s",),
        ),
        (
            "partition-line-separator",
            ["job.partition=gpu\u2028#SBATCH --uid=0"],
            ("job.partition", "control character"),
        ),
        ("qos-nel", ["job.qos=normal\u0085x"], ("job.qos", "control character")),
        ("account-bidi", ["job.account=acct\u202e#x"], ("job.account", "control character")),
        ("constraint-zero-width", ["job.capture.constraint=a\u200bb"], ("job.capture.constraint", "control character")),
    ]
]


def _record_with(**fields: object) -> Callable[[Path], None]:
    """A setup step: the finished job's record with other fields (a tampered or foreign job.json)."""

    def step(world: Path) -> None:
        path = world / "runs" / "tiny" / "done" / "job.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))

    return step


CASES += [
    Case(
        f"job-id-{name}-{command}",
        "job",
        "launcher",
        (command, JOB, *RUNS),
        ("field 'job_id'", "fix"),
        _record_with(job_id=job_id, mode=mode),
    )
    for name, job_id, mode in [
        ("me", "--me", "slurm"),
        ("user", "--user=root", "slurm"),
        ("list", "4242,4243", "slurm"),
        ("negative", "-1", "slurm"),
        ("escape", "\x1b]0;PWNED\x07", "slurm"),
        ("local-option", "--all", "local"),
    ]
    for command in ("cancel", "status")
]
# One secret rule: forms the refusal missed, none of them echoed.
CASES += [
    Case(
        f"secret44-{name}",
        "secret",
        "launcher",
        ("tiny", *DRY, "--set", override),
        (field, "credential"),
        forbid=(FAKE_KEY,),
    )
    for name, field, override in [
        ("append", "job.setup", f"job.setup=['export WANDB_API_KEY+={FAKE_KEY}']"),
        ("default", "job.setup", f"job.setup=[': ${{WANDB_API_KEY:={FAKE_KEY}}}']"),
        ("default-dash", "job.setup", f"job.setup=['echo ${{HF_TOKEN:-{FAKE_KEY}}}']"),
        ("ansi-c", "job.setup", f"job.setup=[\"export WANDB_API_KEY=$'{FAKE_KEY}'\"]"),
        ("declare", "job.setup", f"job.setup=['declare -x HF_TOKEN={FAKE_KEY}']"),
        ("wandb-login", "job.setup", f"job.setup=['wandb login {FAKE_KEY}']"),
        ("hf-login", "job.setup", f"job.setup=['huggingface-cli login --add-to-git-credential {FAKE_KEY}']"),
        ("bearer", "job.setup", f"job.setup=['curl -H \"Authorization: Bearer {FAKE_KEY}\" https://x/y']"),
        ("api-key-header", "job.setup", f"job.setup=['curl -H \"X-Api-Key: {FAKE_KEY}\" https://x/y']"),
        ("docker-p", "job.setup", f"job.setup=['docker login -u me -p {FAKE_KEY} registry.x']"),
        ("sshpass", "job.setup", f"job.setup=['sshpass -p {FAKE_KEY} rsync -a u@h:/d /d']"),
        ("mysql-p", "job.setup", f"job.setup=['mysql -u root -p{FAKE_KEY} -e select']"),
        ("url-quote", "capture.target_revision", f"capture.target_revision=https://alice:p'{FAKE_KEY}@host.example/x"),
        ("url-at", "data.chat_path", f"data.chat_path=https://alice:p@{FAKE_KEY}@host.example/x.jsonl"),
        ("jwt", "description", f"description=eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.{FAKE_KEY}"),
        ("stripe", "trainer.metrics.wandb_entity", f"trainer.metrics.wandb_entity=sk_live_{FAKE_KEY}"),
        ("google", "trainer.metrics.wandb_project", f"trainer.metrics.wandb_project=AIzaSyD{FAKE_KEY}"),
        ("list-flag", "capture.sglang.extra_args", f'capture.sglang.extra_args=["--api-key","{FAKE_KEY}"]'),
        ("list-flag-spaced", "capture.sglang.extra_args", f"capture.sglang.extra_args=['--hf-token', '{FAKE_KEY}']"),
    ]
]
# Messages that named the wrong fix, and values echoed whole.
CASES += [
    Case(
        "set-empty", "message", "launcher", ("tiny", "--plan", "--set", ""), ("key.path=VALUE", "trainer.optimizer.lr")
    ),
    Case("no-wait-without-smoke", "flag", "launcher", ("tiny", "--plan", "--no-wait"), ("--no-wait", "--smoke")),
    Case(
        "render-stdout-and-out",
        "flag",
        "launcher",
        ("render", "tiny", "--stdout", "--out", "{w}/o"),
        ("--stdout", "--out"),
    ),
    Case(
        "dotted-top-level-key",
        "load-time",
        "launcher",
        ("{w}/recipes/bad.yaml", "--plan"),
        ("trainer.seed", "nest it", "under the 'trainer:' section"),
        tiny_with("\ntrainer:\n", '\n"trainer.seed": 5\ntrainer:\n'),
    ),
    Case(
        "integer-of-5000-digits",
        "load-time",
        "launcher",
        ("{w}/recipes/bad.yaml", *DRY),
        ("cannot be converted", "fix"),
        tiny_with("\njob:\n", "\nextra_digits: " + "9" * 5000 + "\njob:\n"),
    ),
    Case(
        "resume-a-probe",
        "job",
        "launcher",
        ("--resume", JOB, "--plan"),
        ("--probe job", "run the probe again"),
        _record_with(probe=True),
    ),
]

# Every entry point ends a user error in one line (issue 44: tracebacks came from these).
_TAMPERED_RESULTS = {"passes": [], "dtype": "save", "stop_token_ids": [2], "max_new_tokens": 100000}
CASES += [
    Case("transport-status-root", "job", "transport", ("status", "--job", "/"), ("recipe.resolved.json", "fix")),
    Case(
        "transport-status-yaml",
        "flag",
        "transport",
        ("status", "--recipe", "{w}/recipes/tiny.yaml"),
        ("recipe file", "--job"),
    ),
    Case(
        "transport-master-yaml", "flag", "transport", ("master", "--recipe", "{w}/recipes/tiny.yaml"), ("recipe file",)
    ),
    Case(
        "transport-status-passwd",
        "load-time",
        "transport",
        ("status", "--recipe", "/etc/passwd"),
        ("/etc/passwd", "json"),
    ),
    Case(
        "transport-master-every-interface",
        "value",
        "transport",
        ("master", "--recipe", f"{JOB}/recipe.resolved.json", "--host", "0.0.0.0"),
        ("every interface", "nothing was started"),
    ),
    Case(
        "probe-outside-a-job",
        "flag",
        "probe",
        ("--recipe", f"{JOB}/recipe.resolved.json", "--component", "trainer"),
        ("lacks the job's environment", "--probe"),
    ),
    Case(
        "room-walk-unknown-room", "flag", "room_walk", ("--rooms", "nope", "--", "tiny", "--plan"), ("--rooms", "nope")
    ),
    Case(
        "replay-dtype-attribute",
        "data",
        "replay_decodes",
        ("{w}/ev",),
        ("'dtype' is 'save'", "results.json"),
        steps(write("ev/results.json", json.dumps(_TAMPERED_RESULTS)), write("ev/decodes.jsonl", "")),
    ),
    Case(
        "replay-line-not-a-decode",
        "data",
        "replay_decodes",
        ("{w}/ev",),
        ("decodes.jsonl:1", "not a decode"),
        steps(
            write("ev/results.json", json.dumps({**_TAMPERED_RESULTS, "dtype": "float32"})),
            write("ev/decodes.jsonl", "5\n"),
        ),
    ),
    Case("replay-negative-limit", "value", "replay_decodes", ("{w}/ev", "--limit", "-30"), ("--limit -30",)),
    Case("speedup-no-job", "job", "speedup", ("--job", "nope"), ("no job 'nope'",)),
    Case("speedup-negative-prompts", "value", "speedup", ("--job", "x", "--max-prompts", "-1"), ("--max-prompts",)),
]


# -- running one case ----------------------------------------------------------------------------


def _snapshot(world: Path, relative: tuple[str, ...]) -> dict[str, str]:
    return {name: hashlib.sha256((world / name).read_bytes()).hexdigest() for name in relative}


def run_case(case: Case, world: Path, capfd: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Run the case's command in-process; returns (exit code, stdout + stderr, a child's included)."""
    argv = [part.replace("{w}", str(world)) for part in case.argv]
    capfd.readouterr()
    try:
        code = COMMANDS[case.command](argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code if isinstance(exc.code, int) else 2
    captured = capfd.readouterr()
    return code, captured.out + captured.err


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built once per module (see :func:`build_world`)."""
    world = tmp_path_factory.mktemp("bad-inputs-template")
    build_world(world)
    return world


@pytest.fixture
def world(template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    target = tmp_path / "w"
    shutil.copytree(template, target, symlinks=True)
    for record in target.glob("runs/tiny/*/job.json"):  # the template's records name the template's folders
        data = json.loads(record.read_text())
        data["job_dir"] = str(record.parent)
        record.write_text(json.dumps(data))
    monkeypatch.setenv("DSPARK_TEST_EMPTY_DIR", "")
    monkeypatch.delenv("DSPARK_TEST_UNSET_DIR", raising=False)
    monkeypatch.delenv("DSPARK_TEST_NO_SUCH_KEY", raising=False)
    monkeypatch.chdir(target)
    # The world is the repository whose recipes the data tools read for pinned digests.
    monkeypatch.setattr(data_prepare, "RECIPES_DIR", target / "recipes")
    return target


def _tracked_digests() -> dict[str, str]:
    """SHA-256 of every file of the checkout that git tracks (several cases aim at them on purpose)."""
    import subprocess

    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    names = [n for n in listed.decode().split("\0") if n and (REPO / n).is_file()]
    return {n: hashlib.sha256((REPO / n).read_bytes()).hexdigest() for n in names}


@pytest.fixture(scope="module", autouse=True)
def checkout_untouched() -> object:
    """After the whole corpus, every tracked file of the checkout is byte-identical and nothing was
    added to its checked-in folders (the write-gate cases name README.md, recipes/, tools/, ...)."""
    from runtime.user_errors import CHECKED_IN_FOLDERS

    def untracked() -> set[str]:
        import subprocess

        listed = subprocess.run(
            ["git", "ls-files", "--others", "--exclude-standard", "-z", "--", *CHECKED_IN_FOLDERS[2:]],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
        return {n for n in listed.decode().split("\0") if n}

    before, extra = _tracked_digests(), untracked()
    yield
    changed = sorted(n for n, digest in _tracked_digests().items() if before.get(n) != digest)
    assert not changed, f"the corpus changed tracked files: {changed}"
    assert untracked() == extra, f"the corpus added files: {sorted(untracked() - extra)}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, world: Path, capfd: pytest.CaptureFixture[str]) -> None:
    if case.not_root and os.geteuid() == 0:
        pytest.skip("root reads files without read permission")
    if case.setup:
        case.setup(world)
    before = _snapshot(world, case.keep)
    existing = {p for p in world.rglob("*")}
    try:
        code, output = run_case(case, world, capfd)
    finally:
        for path in world.rglob("*"):  # let tmp_path's cleanup remove what a permission case locked
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | stat.S_IRWXU)
    assert code != 0, f"{case.id}: exit 0\n{output}"
    assert "Traceback" not in output, output
    lowered = output.lower()
    missing = [word for word in case.expect if word.lower().replace("{w}", str(world)) not in lowered]
    assert not missing, f"{case.id}: the message lacks {missing}:\n{output}"
    # A fix: the launcher's and the tools' messages say "fix"; argparse's errors show the usage.
    assert "fix" in lowered or "usage:" in lowered, f"{case.id}: no fix in the message:\n{output}"
    leaked = [word for word in case.forbid if word in output]
    assert not leaked, f"{case.id}: the message repeats {leaked}"
    assert _snapshot(world, case.keep) == before, f"{case.id}: a file that existed was changed"
    leftovers = [p for p in world.rglob("*") if ".tmp" in p.name and p not in existing]
    assert not leftovers, f"{case.id}: temporary files left: {leftovers}"


def test_corpus_covers_every_command_and_kind() -> None:
    """The corpus keeps its breadth: at least 150 cases, every command and kind present."""
    assert len({c.id for c in CASES}) == len(CASES), "case ids are unique"
    by_command = Counter(c.command for c in CASES)
    by_kind = Counter(c.kind for c in CASES)
    assert len(CASES) >= 150, len(CASES)
    assert set(by_command) == set(COMMANDS), by_command
    assert set(by_kind) == set(KINDS), by_kind


def test_a_copied_job_folder_is_its_own_job(world: Path) -> None:
    """``plots``/``status`` on a copy of a job folder read the copy, not the folder its record names."""
    from launcher.jobs import find_record

    copy = world / "copy"
    shutil.copytree(world / "runs" / "tiny" / "done", copy, symlinks=True)
    assert find_record(str(copy), world / "runs").job_dir == str(copy.resolve())


@pytest.mark.parametrize(
    ("raised", "code", "words"),
    [
        (KeyboardInterrupt(), 130, ("interrupted", "nothing is half-written")),
        (IsADirectoryError(21, "Is a directory", "/x/data"), 2, ("/x/data", "is a folder", "fix")),
        (PermissionError(13, "Permission denied", "/x/f"), 2, ("/x/f", "permission denied", "fix")),
        (OSError(28, "No space left on device", "/x/tmp.1", None, "/x/out"), 2, ("/x/out", "no space", "fix")),
    ],
)
def test_the_shared_error_path_renders_one_line(
    raised: BaseException, code: int, words: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    from runtime.user_errors import run_command

    def main(argv: list[str] | None) -> int:
        raise raised

    assert run_command(main, []) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err.lower() for w in words), err


def test_an_eval_prompt_of_empty_turns_is_refused() -> None:
    """An eval set of empty prompts was decoded and reported with acceptance figures."""
    from runtime.shared.chat_tokenize import ChatFormatError, tokenize_prompt

    empty = [{"role": "user", "content": "  "}, {"role": "assistant", "content": "reference"}]
    with pytest.raises(ChatFormatError, match="every turn of the prompt is empty"):
        tokenize_prompt(None, empty, "eval.jsonl: line 1")


def test_check_patch_names_a_tree_that_is_a_link_loop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tools import patch_check

    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    assert patch_check.main(["--tree", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "symbolic-link loop" in err and "fix" in err and "Traceback" not in err, err


def test_logs_skip_a_log_that_is_a_fifo(world: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A task log replaced by a FIFO: ``logs`` names it and goes on (reading it would wait for ever)."""
    log = world / "runs" / "tiny" / "done" / "logs" / "local-1_trainer_1.out"
    log.unlink()
    os.mkfifo(log)
    assert launcher_cli.main(["logs", "local-1", "--runs-dir", str(world / "runs")]) == 0
    out = capsys.readouterr().out
    assert "FIFO" in out and "trainer 2 done" in out, out
