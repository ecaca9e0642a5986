"""Unit tests of the trainer's parts: frozen tensors by name, schedules, start plans, checkpoint
files (atomic, latest, keep-K), sample checks, settings and metrics errors."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from runtime.recipe import load_recipe, write_resolved
from runtime.recipe.schema import ScheduleConfig
from runtime.shared.checkpoint_folders import SEQUENTIAL_HASH_SCHEME
from runtime.trainer import checkpoints, state_hash
from runtime.trainer.distributed import exit_without_finalization
from runtime.trainer.file_source import FileSampleSource
from runtime.trainer.frozen_vocab import TargetTensorError, load_frozen_vocab, read_target_tensor
from runtime.trainer.guard import FiniteGuard, NonFiniteUpdate, inspect_update
from runtime.trainer.metrics import MetricsSetupError, MetricsWriter
from runtime.trainer.resume import plan_start
from runtime.trainer.schedules import build_schedule
from runtime.trainer.settings import TrainerSetupError
from runtime.trainer.setup import derive_settings
from runtime.trainer.sources import SampleShapeError, check_sample
from runtime.trainer.synthetic import synthetic_sample, write_target_checkpoint

REPO_ROOT = Path(__file__).resolve().parent.parent
SHA = "ab" * 32


def tiny(*overrides: str):
    return load_recipe(REPO_ROOT / "recipes" / "tiny.yaml", overrides=[f"data.expected_sha256={SHA}", *overrides])


# ----------------------------------------------------------------------------------------------
# frozen embedding / lm_head by name
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sharded", [True, False])
def test_frozen_tensors_are_read_by_name(tmp_path: Path, sharded: bool) -> None:
    write_target_checkpoint(
        tmp_path, vocab_size=50, hidden_size=8, sharded=sharded, embed_name="language_model.model.embed_tokens.weight"
    )
    embed, head = load_frozen_vocab(
        tmp_path,
        embed_tensor_name="language_model.model.embed_tokens.weight",
        lm_head_tensor_name="lm_head.weight",
        vocab_size=50,
        hidden_size=8,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    assert embed.shape == head.shape == (50, 8) and embed.dtype == torch.bfloat16
    assert not torch.equal(embed, head)


def test_missing_tensor_error_names_file_tensor_and_field(tmp_path: Path) -> None:
    write_target_checkpoint(tmp_path, vocab_size=50, hidden_size=8)
    with pytest.raises(TargetTensorError) as info:
        read_target_tensor(tmp_path, "language_model.lm_head.weight", recipe_field="trainer.lm_head_tensor_name")
    text = str(info.value)
    assert str(tmp_path / "model.safetensors.index.json") in text
    assert "'language_model.lm_head.weight'" in text and "trainer.lm_head_tensor_name" in text
    assert "close names: lm_head.weight" in text
    with pytest.raises(TargetTensorError, match=r"has shape \(50, 8\), but the recipe says \[capture.vocab_size 64"):
        load_frozen_vocab(
            tmp_path,
            embed_tensor_name="model.embed_tokens.weight",
            lm_head_tensor_name="lm_head.weight",
            vocab_size=64,
            hidden_size=8,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
    with pytest.raises(TargetTensorError, match="neither model.safetensors.index.json nor model.safetensors"):
        read_target_tensor(tmp_path / "nowhere", "x", recipe_field="trainer.embed_tensor_name")


# ----------------------------------------------------------------------------------------------
# schedules
# ----------------------------------------------------------------------------------------------


def test_schedules() -> None:
    def factors(kind: str, **kw) -> list[float]:
        schedule = build_schedule(ScheduleConfig(type=kind, **kw), base_lr=2.0, run_total_steps=10)
        return [schedule.lr(s) / 2.0 for s in range(10)]

    assert factors("constant") == [1.0] * 10
    assert factors("constant_with_warmup", warmup_steps=4)[:5] == [0.25, 0.5, 0.75, 1.0, 1.0]
    linear = factors("linear", warmup_steps=2, min_lr_ratio=0.1)
    assert linear[:2] == [0.5, 1.0] and linear[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(linear[1:], linear[2:], strict=False))
    cosine = factors("cosine", warmup_steps=2, min_lr_ratio=0.1)
    assert cosine[-1] == pytest.approx(0.1) and cosine[5] == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8))
    )
    wsd = factors("wsd", warmup_steps=1, decay_steps=4, min_lr_ratio=0.0)
    assert wsd == pytest.approx([1.0] * 6 + [0.75, 0.5, 0.25, 0.0])
    assert build_schedule(ScheduleConfig(type="wsd"), base_lr=1.0, run_total_steps=30).decay_steps == 3


# ----------------------------------------------------------------------------------------------
# start plans and checkpoint files
# ----------------------------------------------------------------------------------------------


def save(
    checkpoint_dir: Path, step: int, model: torch.nn.Module, digest: str, keep_last: int = 2
) -> checkpoints.SavedCheckpoint:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = {
        "step": step,
        "cursor": step * 4,
        "world_size": 1,
        "recipe_digest": digest,
        "schedule": {"type": "constant"},
    }
    return checkpoints.save_checkpoint(
        checkpoint_dir,
        step=step,
        model=model,
        optimizer=optimizer,
        state=state,
        rng_states=[checkpoints.rng_state()],
        keep_last=keep_last,
        is_main=True,
    )


def test_checkpoint_files_latest_keep_last_and_stale_tmp(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="dspark.trainer.checkpoints")
    model = torch.nn.Linear(3, 2)
    (tmp_path / ".tmp-step_00000009").mkdir(parents=True)  # a crashed save: never taken for a checkpoint
    assert checkpoints.find_latest(tmp_path) is None
    for step in (2, 4, 6):
        with torch.no_grad():
            model.weight.add_(1.0)
        saved = save(tmp_path, step, model, "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000004", "step_00000006"]
    removals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("removed step_")]
    assert removals == ["removed step_00000002 (trainer.checkpoint.keep_last is 2)"], "a removal is announced"
    assert (tmp_path / "latest").is_symlink() and checkpoints.find_latest(tmp_path).name == "step_00000006"
    state = checkpoints.read_state(saved.path)
    assert state["step"] == 6 and state["weights_sha256"] == saved.weights_sha256 == checkpoints.model_sha256(model)
    assert checkpoints.loaded_weights_sha256(saved.path, model) == saved.weights_sha256
    fresh = torch.nn.Linear(3, 2)
    checkpoints.load_weights(saved.path, fresh)
    assert torch.equal(fresh.weight, model.weight)
    # a crash after the rename but before the link update: the newest complete one still wins
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").symlink_to("step_00000004")
    assert checkpoints.find_latest(tmp_path).name == "step_00000006"


def _reference_hashes(tensors: dict[str, torch.Tensor]) -> tuple[str, str]:
    """The two hash schemes written out plainly: (sequential, per tensor)."""
    sequential, per_tensor = hashlib.sha256(), hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        header = f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode()
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        sequential.update(header + data)
        per_tensor.update(header + hashlib.sha256(data).digest())
    return sequential.hexdigest(), per_tensor.hexdigest()


def test_weight_hashes_follow_their_scheme_and_old_checkpoints_still_load(tmp_path: Path) -> None:
    """Checkpoints hash tensors in parallel now (a K3 save took 53 s hashing on one thread); those that
    recorded no hash_scheme were hashed sequentially and must still load, and be checked that way."""
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(3 + i, 5, generator=g) for i in range(12)}
    tensors["b"] = torch.randn(7, generator=g).to(torch.bfloat16)
    tensors["empty"] = torch.zeros(0)
    sequential, per_tensor = _reference_hashes(tensors)
    assert state_hash.state_dict_sha256(tensors) == per_tensor
    assert state_hash.state_dict_sha256(tensors, SEQUENTIAL_HASH_SCHEME) == sequential
    with pytest.raises(state_hash.UnknownHashSchemeError, match="unknown hash_scheme 'md5'"):
        state_hash.state_dict_sha256(tensors, "md5")

    model = torch.nn.Linear(3, 2)
    saved = save(tmp_path, 1, model, "d")
    state = checkpoints.read_state(saved.path)
    assert state["hash_scheme"] == state_hash.HASH_SCHEME
    assert len(state["files"]) > 2  # the ranks' data files are written on several threads, each hashed
    # an older checkpoint: no hash_scheme, its hashes sequential
    model_state = {k: v.detach() for k, v in model.state_dict().items()}
    old = {**state, "weights_sha256": _reference_hashes(model_state)[0]}
    old.pop("hash_scheme"), old.pop("optimizer_sha256")
    state_file = saved.path / "trainer_state.json"
    state_file.write_text(json.dumps(old))
    fresh = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    checkpoints.load_full(saved.path, fresh, optimizer, old)
    assert torch.equal(fresh.weight, model.weight)
    assert checkpoints.loaded_weights_sha256(saved.path, fresh) == old["weights_sha256"]
    # the same file claiming the new scheme does not match: the scheme decides how a load is checked
    with pytest.raises(checkpoints.CheckpointError, match="the loaded weights hash to sha256"):
        checkpoints.load_full(saved.path, fresh, optimizer, {**old, "hash_scheme": state_hash.HASH_SCHEME})
    with pytest.raises(checkpoints.CheckpointError, match="hash_scheme 'sha512-tree/9' is not one this trainer knows"):
        checkpoints.load_full(saved.path, fresh, optimizer, {**old, "hash_scheme": "sha512-tree/9"})


def test_start_plans(tmp_path: Path) -> None:
    digest = "d" * 64
    ckpt_dir = tmp_path / "ckpt"
    checkpoint = tiny().recipe.trainer.checkpoint
    assert plan_start(checkpoint, ckpt_dir, digest).kind == "fresh"
    auto = tiny("trainer.checkpoint.resume_from=auto").recipe.trainer.checkpoint
    assert plan_start(auto, ckpt_dir, digest).kind == "fresh"
    warm_dir = tmp_path / "warm"
    save(warm_dir, 3, torch.nn.Linear(2, 2), "other")
    warm = plan_start(tiny(f"trainer.checkpoint.init_from={warm_dir}").recipe.trainer.checkpoint, ckpt_dir, digest)
    assert warm.kind == "init" and warm.path.name == "step_00000003"
    save(ckpt_dir, 5, torch.nn.Linear(2, 2), digest)
    restart = plan_start(checkpoint, ckpt_dir, digest)  # same job restarted (requeue): resumes by itself
    assert restart.kind == "resume" and restart.path.name == "step_00000005"
    # launch-time checks refuse this pair; at run time auto wins
    both = tiny(f"trainer.checkpoint.init_from={warm_dir}").recipe.trainer.checkpoint
    auto_over_init = plan_start(both.model_copy(update={"resume_from": "auto"}), ckpt_dir, digest)
    assert auto_over_init.kind == "resume" and auto_over_init.path.name == "step_00000005"
    with pytest.raises(checkpoints.CheckpointError, match="written by another recipe"):
        plan_start(checkpoint, ckpt_dir, "e" * 64)
    with pytest.raises(ValueError, match="exclude each other"):
        tiny(f"trainer.checkpoint.resume_from={ckpt_dir}", f"trainer.checkpoint.init_from={warm_dir}")
    with pytest.raises(
        checkpoints.CheckpointError, match="trainer.checkpoint.resume_from is .*no complete checkpoint there"
    ):
        missing = tiny(f"trainer.checkpoint.resume_from={tmp_path / 'missing'}").recipe.trainer.checkpoint
        plan_start(missing, ckpt_dir, digest)


# ----------------------------------------------------------------------------------------------
# guard, samples, settings, metrics
# ----------------------------------------------------------------------------------------------


def test_guard_decisions() -> None:
    finite = [{"ce": True, "l1": True, "confidence": True}] * 2
    bad = [{"ce": True, "l1": True, "confidence": True}, {"ce": True, "l1": False, "confidence": True}]
    guard = FiniteGuard(smoke=False, max_consecutive_skips=2)
    assert guard.decide(inspect_update(0, finite, 1.0)) is True
    assert guard.decide(inspect_update(1, bad, 1.0)) is False and guard.skipped_total == 1
    assert guard.decide(inspect_update(2, finite, 1.0)) is True and guard.consecutive == 0
    assert guard.decide(inspect_update(3, finite, float("inf"))) is False
    with pytest.raises(
        NonFiniteUpdate, match="step 4 .*'l1' is not finite on rank\\(s\\) \\[1\\].*2 skipped updates in a row"
    ):
        guard.decide(inspect_update(4, bad, float("nan")))
    with pytest.raises(
        NonFiniteUpdate, match="smoke gate: non-finite update at optimizer step 0 .*gradient norm is nan"
    ):
        FiniteGuard(smoke=True, max_consecutive_skips=3).decide(inspect_update(0, finite, float("nan")))


def test_sample_checks_and_file_source_timeout(tmp_path: Path) -> None:
    sample = synthetic_sample(3, num_tokens=20, vocab_size=100, hidden_size=8, num_aux_layers=2)
    check_sample(sample, num_aux_layers=2, hidden_size=8, vocab_size=100)
    with pytest.raises(SampleShapeError, match=r"sample g=3: field hs has shape \(20, 16\), expected \(20, 24\)"):
        check_sample(sample, num_aux_layers=3, hidden_size=8, vocab_size=100)
    with pytest.raises(SampleShapeError, match="leaves the vocabulary 0..9"):
        check_sample(sample, num_aux_layers=2, hidden_size=8, vocab_size=10)
    # a range the prefetch thread already read on the host is used as given (ids not read again)
    check_sample(sample, num_aux_layers=2, hidden_size=8, vocab_size=10, ids_range=(0, 9))
    with pytest.raises(SampleShapeError, match=r"token ids range -1\.\.5 leaves"):
        check_sample(sample, num_aux_layers=2, hidden_size=8, vocab_size=100, ids_range=(-1, 5))
    source = FileSampleSource(tmp_path, global_batch_size=4, idle_timeout_s=0.3, poll_interval_s=0.05)
    with pytest.raises(TimeoutError, match="sample g=7 did not appear"):
        source.fetch(7)
    source.commit_step(2)
    assert source.read_cursor() == 12


def test_settings_check_world_size_and_derive_steps(tmp_path: Path) -> None:
    loaded = tiny("data.num_rows=10", "trainer.epochs=3")
    resolved_path = write_resolved(loaded, tmp_path / "job", REPO_ROOT)
    from runtime.recipe import load_resolved

    resolved = load_resolved(resolved_path)
    with pytest.raises(TrainerSetupError, match="WORLD_SIZE is 2, but the recipe's trainer has 4 ranks"):
        derive_settings(resolved, {"WORLD_SIZE": "2", "RANK": "0"})
    flex = load_resolved(write_resolved(tiny("trainer.attention_backend=flex"), tmp_path / "flex", REPO_ROOT))
    with pytest.raises(TrainerSetupError, match="'flex' on a CPU trainer"):
        derive_settings(flex, {"WORLD_SIZE": "4"})
    settings = derive_settings(resolved, {"WORLD_SIZE": "4", "RANK": "3", "DSPARK_JOB_DIR": str(tmp_path / "job")})
    assert settings.total_steps == 3 * 10 // 8 and settings.rank == 3 and settings.attention_backend == "sdpa"
    assert settings.checkpoint_dir == tmp_path / "job" / "checkpoints" and settings.data_digest == SHA
    assert settings.chunk_rows == 8 * 7
    assert not settings.compile_regions  # auto: compiled regions on CUDA only, eager (and exact) on CPU
    forced = load_resolved(write_resolved(tiny("trainer.compile_regions=on"), tmp_path / "on", REPO_ROOT))
    assert derive_settings(forced, {"WORLD_SIZE": "4"}).compile_regions


def test_wandb_needs_key_from_environment(tmp_path: Path) -> None:
    config = tiny("trainer.metrics.wandb_project=dspark").recipe.trainer.metrics
    with pytest.raises(MetricsSetupError, match="WANDB_API_KEY is not in the environment"):
        MetricsWriter(tmp_path, config, run_name="x", enabled=True, env={})
    writer = MetricsWriter(
        tmp_path, tiny("trainer.metrics.tensorboard=true").recipe.trainer.metrics, run_name="x", enabled=True, env={}
    )
    writer.write({"step": 1, "loss": 2.0, "note": "text is kept out of TensorBoard"})
    writer.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 2.0
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    silent = MetricsWriter(tmp_path / "other", config, run_name="x", enabled=False, env={})  # ranks > 0 write nothing
    silent.write({"step": 1, "loss": 2.0})
    assert not (tmp_path / "other").exists()


def test_prefetcher_keeps_order_two_samples_resident_and_reraises() -> None:
    import threading
    import time

    from runtime.trainer.prefetch import StepPrefetcher

    live, peak, lock = [0], [0], threading.Lock()

    class Held:
        def __init__(self, g: int) -> None:
            self.g = g

        def __del__(self) -> None:
            with lock:
                live[0] -= 1

    def fetch(g: int) -> Held:
        if g == 7:
            raise RuntimeError("sample g=7 is broken")
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.005)
        return Held(g)

    prefetch = StepPrefetcher(fetch, list(range(10)))  # type: ignore[arg-type]
    seen = []
    with pytest.raises(RuntimeError, match="g=7 is broken"):
        for _ in range(10):
            item = prefetch.next()
            seen.append(item.g)
            time.sleep(0.02)  # "training" on it while the next one is fetched
            del item
    prefetch.close()
    assert seen == list(range(7)) and peak[0] == 2


def _shared_hash_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank: the tensors as DTensors sharded over the ranks, hashed together; a folder's files
    digested together."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        sharded = {name: distribute_tensor(t, mesh, [Shard(0)]) for name, t in _hash_inputs().items()}
        result = {
            "digest": state_hash.state_dict_sha256(sharded),
            "files": checkpoints.shared_file_digests(Path(out_dir) / "files"),
        }
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    exit_without_finalization(0)  # as a trainer rank leaves: DTensor gathers over gloo can abort at exit


def _hash_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {f"w{i}": torch.randn(4 + i, 3, generator=g) for i in range(9)}


def test_ranks_share_the_hashing_and_get_the_one_rank_digests(tmp_path: Path) -> None:
    """At a stop every rank hashes its share of the tensors (tensor i on rank i % N) and reads back its
    share of the files; the digests equal those of one process hashing everything, on every rank."""
    import torch.multiprocessing as mp

    from runtime.shared.checkpoint_integrity import file_digests
    from runtime.transport.loopback import free_port

    files = tmp_path / "files"
    (files / "sub").mkdir(parents=True)
    for i in range(7):
        (files / ("sub" if i % 3 == 0 else "") / f"f{i}.bin").write_bytes(bytes([i]) * (1000 * (i + 1)))
    mp.spawn(_shared_hash_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = {"digest": _reference_hashes(_hash_inputs())[1], "files": file_digests(files)}
    assert got == [expected] * 2
