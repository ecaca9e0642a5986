"""Quick CPU runs of the multi-GPU benchmark scripts (issue 9), so the GPU runs work the first time:
``tools/bench/trainer_scaling.py`` as real 1- and 2-rank torchrun groups over gloo plus its
``--compare``, and ``tools/bench/capture_ep.py --quick`` (EP = 2 over two CPU replicas). No timed
assertions: the tests check the numbers are consistent with each other, not how fast they are."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.trainer.checkpoints import SAVE_PHASES
from runtime.transport.loopback import free_port
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.distributed

TIMEOUT_S = 180


def run_cmd(args: list[str], timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


def torchrun(ranks: int, *bench_args: str) -> subprocess.CompletedProcess[str]:
    return run_cmd(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={ranks}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            "-m",
            "tools.bench.trainer_scaling",
            *bench_args,
        ]
    )


# The tests that read the two torchrun runs of ``scaling_runs`` (~15 s) are all slow, so the module
# fixture runs in the slow tier only (whose xdist run keeps a file on one worker: --dist loadfile).
@pytest.fixture(scope="module")
def scaling_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, dict]]:
    folder = tmp_path_factory.mktemp("scaling")
    out = {}
    for ranks in (1, 2):
        path = folder / f"tiny-{ranks}.json"
        done = torchrun(
            ranks, "--shapes", "tiny", "--steps", "2", "--warmup", "1", "--accumulation", "2", "--json", str(path)
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "step 3/3 (timed)" in done.stdout and "ETA" in done.stdout  # progress lines
        out[ranks] = (path, json.loads(path.read_text()))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_trainer_scaling_result_is_consistent(scaling_runs, ranks: int) -> None:
    _, r = scaling_runs[ranks]
    assert r["world_size"] == ranks and r["backend"] == "gloo" and r["shapes"] == "tiny"
    assert r["tokens_per_sample"] == 256 and r["accumulation"] == 2 and r["timed_steps"] == 2
    assert len(r["step_times_s"]) == 2 and r["step_time_s"] == pytest.approx(statistics.median(r["step_times_s"]))
    assert r["tokens_per_step"] == ranks * 2 * 256
    assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_time_s"])
    assert r["tokens_per_s_per_rank"] == pytest.approx(r["tokens_per_s"] / ranks)
    assert len(r["matmul_tflops_per_rank"]) == ranks and all(t > 0 for t in r["matmul_tflops_per_rank"])
    # MFU is each rank's model FLOP/s over its own matmul FLOP/s.
    per_rank_tflop = r["model_tflop_per_step"] / ranks
    for achieved, matmul, mfu in zip(
        r["model_tflops_per_rank"], r["matmul_tflops_per_rank"], r["mfu_per_rank"], strict=True
    ):
        assert achieved == pytest.approx(per_rank_tflop / r["step_time_s"], rel=0.05)
        assert mfu == pytest.approx(achieved / matmul)
    assert r["peak_allocated_gib_per_rank"] == [None] * ranks  # CUDA only
    assert all(math.isfinite(x) for x in r["loss"] + r["grad_norm"]) and len(r["loss"]) == 2
    assert r["param_dtype"] == "float32" and r["attention_backend"] == "sdpa"
    assert r["parameters"] > 0


@pytest.mark.slow
def test_two_ranks_do_twice_the_model_work_of_one(scaling_runs) -> None:
    one, two = scaling_runs[1][1], scaling_runs[2][1]
    assert one["parameters"] == two["parameters"]  # sharding does not change the model
    # Same per-rank batch: each rank's samples have their own anchors, so about (not exactly) twice.
    assert two["model_tflop_per_step"] / one["model_tflop_per_step"] == pytest.approx(2.0, rel=0.1)


@pytest.mark.slow
def test_compare_prints_the_efficiency_of_the_two_files(scaling_runs) -> None:
    (one_path, one), (two_path, two) = scaling_runs[1], scaling_runs[2]
    done = run_cmd([sys.executable, "-m", "tools.bench.trainer_scaling", "--compare", str(one_path), str(two_path)])
    assert done.returncode == 0, done.stderr
    printed = float(re.search(r"scaling efficiency = .* = ([0-9.]+)", done.stdout).group(1))
    assert printed == pytest.approx(two["tokens_per_s"] / (2 * one["tokens_per_s"]), abs=1e-3)


@pytest.mark.slow
def test_compare_refuses_files_that_do_not_compare(scaling_runs, tmp_path: Path) -> None:
    (one_path, one), (two_path, _) = scaling_runs[1], scaling_runs[2]
    swapped = run_cmd([sys.executable, "-m", "tools.bench.trainer_scaling", "--compare", str(two_path), str(one_path)])
    assert swapped.returncode == 2 and "field 'world_size' is 2, expected 1" in swapped.stderr
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**one, "world_size": 2, "tokens_per_sample": 512}))
    mismatch = run_cmd([sys.executable, "-m", "tools.bench.trainer_scaling", "--compare", str(one_path), str(other)])
    assert mismatch.returncode == 2 and f"{other}: field 'tokens_per_sample' is 512" in mismatch.stderr
    junk = tmp_path / "junk.json"
    junk.write_text(json.dumps({"format": "something else"}))
    wrong = run_cmd([sys.executable, "-m", "tools.bench.trainer_scaling", "--compare", str(one_path), str(junk)])
    assert wrong.returncode == 2 and "field 'format'" in wrong.stderr


def test_k3_shapes_follow_the_recipe_at_the_bench_batch() -> None:
    from tools.bench.trainer_scaling import bench_recipe, recipe_shapes

    recipe = bench_recipe("k3", world_size=2, accumulation=2, tokens=None)
    shapes = recipe_shapes(recipe, torch.device("cuda"))
    assert (shapes.tokens, shapes.draft.hidden_size, shapes.vocab, shapes.num_aux, shapes.num_anchors) == (
        65536,
        7168,
        163840,
        5,
        512,
    )
    assert recipe.trainer.global_batch_size == 4 and recipe.trainer_world_size == 2
    assert (shapes.matmul_n, shapes.dtype) == (8192, torch.bfloat16)
    from tools.bench.trainer_scaling import RankSetup, run_settings

    gpu_rank = RankSetup(rank=1, local_rank=1, world_size=2, device=torch.device("cuda", 1))
    k3 = run_settings(recipe, gpu_rank, total_steps=4)
    assert (k3.param_dtype, k3.reduce_dtype, k3.attention_backend, k3.chunk_rows) == (
        torch.bfloat16,
        torch.float32,
        "flex",
        128 * 7,
    )
    tiny = run_settings(bench_recipe("tiny", 2, 2, None), gpu_rank, total_steps=4)
    assert (tiny.param_dtype, tiny.attention_backend) == (torch.float32, "sdpa")  # as recipes/tiny.yaml says
    cpu = run_settings(recipe, RankSetup(0, 0, 1, torch.device("cpu")), total_steps=4)
    assert (cpu.param_dtype, cpu.attention_backend) == (torch.float32, "sdpa")  # flex has no CPU backward
    shorter = bench_recipe("k3", world_size=1, accumulation=1, tokens=32768)
    assert shorter.data.max_length == 32768 and shorter.trainer.draft.max_position_embeddings == 65536  # RoPE unchanged


def test_k3_shapes_are_refused_without_a_gpu() -> None:  # run_cmd hides any GPU
    done = run_cmd([sys.executable, "-m", "tools.bench.trainer_scaling", "--shapes", "k3"])
    assert done.returncode != 0 and "--shapes k3 needs a CUDA GPU" in done.stderr


@pytest.mark.slow
def test_capture_ep_quick_runs_ep2_on_cpu_replicas(tmp_path: Path) -> None:
    path = tmp_path / "ep.json"
    done = run_cmd(
        [sys.executable, "-m", "tools.bench.capture_ep", "--quick", "--configs", "hf1,ep1,ep2,dp2", "--json", str(path)]
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(path.read_text())
    results = {r["config"]: r for r in report["results"]}
    assert list(results) == ["hf1", "ep1", "ep2", "dp2"]
    experts = report["preset"]["experts"]
    assert results["ep2"]["replicas"] == 2 and results["ep2"]["expert_parallel"] == 2
    assert results["ep2"]["experts_per_replica"] == experts // 2 and results["ep1"]["experts_per_replica"] == experts
    assert results["dp2"]["plain_hf_model"] and "exchange_share" not in results["dp2"]
    assert len({r["tokens"] for r in results.values()}) == 1  # every configuration captured the same requests
    for name in ("ep1", "ep2"):
        r = results[name]
        assert r["instrumented_features_identical"] is True  # the timers do not change results
        parts = r["per_replica"]
        assert len(parts) == r["replicas"]
        for part in parts:
            assert 0 < part["exchange_share"] < 1 and 0 < part["experts_share"] < 1
            assert part["rendezvous_share"] + part["local_share"] == pytest.approx(part["exchange_share"])
            assert part["exchange_share"] + part["experts_share"] < 1  # attention and the rest take the remainder
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"])
    for name in ("ep1", "ep2", "dp2"):  # fp32 on CPU: the expert-parallel path equals the plain model
        assert results[name]["lhs_rel_diff_vs_base"] < 1e-5
    assert "exchange = dispatch + combine" in done.stdout and "ETA" in done.stdout


def test_capture_ep_gpu_preset_skips_cleanly_without_cuda() -> None:  # run_cmd hides any GPU
    done = run_cmd([sys.executable, "-m", "tools.bench.capture_ep"])
    assert done.returncode == 0 and "skipped" in done.stdout


def test_parameter_count_of_the_presets_matches_the_built_model() -> None:
    from tools.bench.capture_ep import PRESETS, build_random_model, parameter_counts

    model = build_random_model(PRESETS["quick"], "cpu")
    total, experts = parameter_counts(PRESETS["quick"])
    assert total == sum(p.numel() for p in model.parameters())
    assert experts == sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    h200_total, h200_experts = parameter_counts(PRESETS["h200"])
    assert (
        2 * h200_total < 0.5 * 141e9 and h200_experts / h200_total > 0.98
    )  # fits one H200 twice over; experts dominate


def test_exchange_timers_time_nested_calls_and_put_the_methods_back() -> None:
    from runtime.moe.exchange_nccl import AllToAllExchange
    from runtime.moe.experts import LocalExperts
    from runtime.moe.routing import route_topk
    from tools.bench.capture_ep import TIMED_METHODS, ExchangeTimers

    gen = torch.Generator().manual_seed(0)
    exchange = AllToAllExchange(None, num_experts=4)  # one rank, no process group
    experts = LocalExperts(torch.randn(4, 16, 8, generator=gen), torch.randn(4, 8, 8, generator=gen))
    hidden = torch.randn(32, 8, generator=gen)
    routing = route_topk(torch.randn(32, 4, generator=gen), 2, renormalize=True)
    expected = exchange.run(hidden, routing, experts)
    timers = ExchangeTimers(exchange, "cpu")
    torch.testing.assert_close(exchange.run(hidden, routing, experts), expected, rtol=0, atol=0)
    seconds = dict(timers.seconds)
    assert seconds["run"] >= seconds["dispatch"] + seconds["combine"] > 0  # nested inside run
    rendezvous = seconds["exchange_counts"] + seconds["_all_to_all"]
    assert 0 < rendezvous <= seconds["dispatch"] + seconds["combine"]  # nested inside dispatch and combine
    shares = timers.breakdown(wall_s=2 * seconds["run"])
    assert shares["exchange_share"] + shares["experts_share"] == pytest.approx(0.5)
    timers.remove()
    assert not any(name in exchange.__dict__ for name in TIMED_METHODS)
    exchange.run(hidden, routing, experts)
    assert timers.seconds["run"] == seconds["run"]  # no longer timed


def test_streaming_quick_streams_most_experts_and_matches_resident(tmp_path: Path) -> None:
    path = tmp_path / "streaming.json"
    done = run_cmd([sys.executable, "-m", "tools.bench.streaming", "--quick", "--repeats", "1", "--json", str(path)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "built 5/5 layers" in done.stdout and "ETA" in done.stdout  # progress lines
    result = json.loads(path.read_text())
    assert result["expert_bytes"] == result["layer_bytes"] * result["shapes"]["layers"]
    assert (result["resident_layers"], result["streamed_layers"], result["num_buffers"]) == (1, 4, 2)
    assert result["host_fraction"] >= 0.75 and result["misses"] == 1
    assert [r["tokens"] for r in result["results"]] == [16, 48]
    for row in result["results"]:
        assert row["outputs_equal"] is True
        assert row["throughput_ratio"] == pytest.approx(row["resident_s"] / row["streamed_s"])
        assert row["expert_compute_s_per_layer"] == pytest.approx(row["resident_s"] / 5)


def test_streaming_gpu_preset_refuses_cleanly_without_cuda() -> None:  # run_cmd hides any GPU
    done = run_cmd([sys.executable, "-m", "tools.bench.streaming"])
    assert done.returncode == 2 and "needs a CUDA GPU (use --quick on a CPU)" in done.stderr


@pytest.mark.slow
def test_checkpoint_bench_saves_with_the_trainers_code_and_accounts_for_its_parts(tmp_path: Path) -> None:
    """``tools.bench.trainer --section checkpoint --quick``: the save the bench times is the trainer's
    (a complete checkpoint with its state file), its own parts add up to no more than the whole, and the
    scratch folder is emptied afterwards."""
    scratch = tmp_path / "scratch"
    done = run_cmd(
        [sys.executable, "-m", "tools.bench.trainer", "--quick", "--section", "checkpoint", "--scratch", str(scratch)]
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    state_gib = float(re.search(r"checkpoint: \d+ tensors, ([0-9.]+) GiB", out).group(1))  # type: ignore[union-attr]
    save_s, written_gib = map(
        float, re.search(r"save_checkpoint on 1 rank\(s\): ([0-9.]+) s for ([0-9.]+) GiB", out).groups()
    )  # type: ignore[union-attr]
    parts = dict(re.findall(r"\[bench\]   part: ([^:]+): ([0-9.]+) s", out))
    assert list(parts) == list(SAVE_PHASES), out
    # the save times its own parts inside the whole (each printed to 0.5 ms, the whole to 5 ms)
    assert sum(map(float, parts.values())) <= save_s + 0.005 + 0.0005 * len(parts), out
    assert written_gib >= state_gib > 0  # what is on disk holds at least the tensors
    assert "ratio to the plain write" in out and "at 4 ranks (the recipe's), each rank's save: about" in out
    # the disk's scaling is measured: 4 processes writing a quarter each, against one writer
    assert re.search(r"disk: 4 processes writing 1/4 each at once took [0-9.]+ s, [0-9.]+x one writer's", out)
    assert not any(scratch.rglob("*.distcp")) and not any(scratch.rglob("*.bin"))


def test_speedup_synthetic_quick_times_the_three_costs_and_derives_the_break_even(tmp_path: Path) -> None:
    """``tools.bench.speedup --synthetic --quick``: a plain decode step, a verify forward over the block
    and a block proposal, each timed; the speed-ups it prints follow from them."""
    path = tmp_path / "speedup.json"
    done = run_cmd(
        [sys.executable, "-m", "tools.bench.speedup", "--synthetic", "--quick", "--repeats", "2", "--json", str(path)]
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(path.read_text())
    plain, verify, propose = result["plain_step_ms"], result["verify_forward_ms"], result["propose_ms"]
    assert min(plain, verify, propose) > 0 and result["block_size"] == 7
    assert result["break_even_acceptance"] == pytest.approx((verify + propose) / plain)
    for acceptance, speedup in result["speedup_at"].items():
        assert speedup == pytest.approx(float(acceptance) * plain / (verify + propose))
    assert "break-even acceptance length" in done.stdout
