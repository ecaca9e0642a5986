"""Trainer scaling benchmark: N FSDP2 ranks on one host vs 1 rank, at the same per-rank batch.

Every rank runs the trainer's own optimizer step (:meth:`runtime.trainer.loop.Trainer._train_step`:
prefetch thread and GPU copy stream, block layouts, the global weight all-reduce, forward +
backward per sample with FSDP2 reducing gradients in fp32, gradient clipping, the finite-update
check, AdamW over fp32 master weights) on synthetic samples held in pinned host memory instead of
Mooncake. Shapes come from a recipe: ``k3`` (``recipes/kimi_k3_v1c.yaml``: the K3 draft, vocab
163,840, T = 65,536) or ``tiny`` (``recipes/tiny.yaml``). On GPU the ranks run over NCCL with the
recipe's dtypes and attention (K3: bf16 compute, fp32 reduction, flex_attention; tiny: fp32, SDPA);
on CPU fp32 with SDPA over gloo (the form the tests use).

Reported, after warm-up steps (flex_attention compiles in the first): step time (slowest rank),
tokens/s in total and per rank, model TFLOP/s per rank and MFU against a bf16 8192^3 matmul timed
in the same run on each rank's GPU (the baseline), peak memory per rank. ``--json`` writes it all;
``--compare ONE.json N.json`` prints the scaling efficiency
``N-rank tokens/s / (N x 1-rank tokens/s)`` (target >= 0.9). ``--trace DIR`` (GPU) profiles one
extra step and lists where the GPU sat idle (:mod:`tools.bench.gpu_gaps`).

Examples::

    python3 -m torch.distributed.run --nproc-per-node 1 -m tools.bench.trainer_scaling --shapes k3 --json k3-1.json
    python3 -m torch.distributed.run --nproc-per-node 2 -m tools.bench.trainer_scaling --shapes k3 --json k3-2.json
    python3 -m tools.bench.trainer_scaling --compare k3-1.json k3-2.json
    python3 -m torch.distributed.run --nproc-per-node 1 -m tools.bench.trainer_scaling --shapes k3 --accumulation 4 --trace out/
    python3 -m torch.distributed.run --nproc-per-node 2 -m tools.bench.trainer_scaling --shapes tiny --steps 2   # CPU, gloo
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runtime.files import atomic_write_text
from runtime.recipe import load_recipe
from runtime.recipe.loader import ResolvedRecipe
from runtime.recipe.schema import Recipe
from runtime.shared.contracts import CapturedSample, step_sample_indices
from runtime.trainer.distributed import gather_objects, init_process_group, shard_model
from runtime.trainer.guard import FiniteGuard
from runtime.trainer.loop import Trainer
from runtime.trainer.model import DSparkDraft
from runtime.trainer.settings import RunSettings
from runtime.trainer.setup import TrainerSetup, setup_for_run
from runtime.transport.loopback import free_port
from tools.bench.gpu_gaps import trace_gpu_gaps
from tools.bench.trainer import (
    GIB,
    Shapes,
    matmul_tflops,
    microstep_flops,
    recipe_shapes,
    sync,
    synthetic_sample,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES = {"k3": "kimi_k3_v1c", "tiny": "tiny"}
JSON_FORMAT = "dspark-bench-trainer-scaling/1"
EFFICIENCY_TARGET = 0.9
MFU_TARGET = 0.45
COLLECTIVE_TIMEOUT_S = 0.0
"""Added to the trainer's collective margin (600 s): a stuck rank fails the run in ten minutes."""


@dataclass(frozen=True)
class RankSetup:
    """This process's place in the run."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device


# ----------------------------------------------------------------------------------------------
# setup
# ----------------------------------------------------------------------------------------------


def rank_setup() -> RankSetup:
    """Rank and device from torchrun's environment (a plain ``python -m`` run is one rank)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(
                f"rank {rank}: LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible"
            )
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return RankSetup(rank, local_rank, world, device)


def bench_recipe(
    shapes_name: str, world_size: int, accumulation: int, tokens: int | None, extra: list[str] | None = None
) -> Recipe:
    """The recipe behind the shapes, set to ``world_size`` ranks of one sample per micro-step
    (``extra``: further ``key=value`` overrides, e.g. ``trainer.compile_regions=off``)."""
    overrides = [
        *(extra or []),
        "job.trainer.nodes=1",
        f"job.trainer.tasks_per_node={world_size}",
        "trainer.micro_batch_size=1",
        f"trainer.gradient_accumulation_steps={accumulation}",
        f"trainer.global_batch_size={accumulation * world_size}",
    ]
    path = REPO_ROOT / "recipes" / f"{RECIPES[shapes_name]}.yaml"
    if tokens is not None:
        overrides.append(f"data.max_length={tokens}")
        if (
            tokens > load_recipe(path).recipe.trainer.draft.max_position_embeddings
        ):  # else RoPE stays as the recipe has it
            overrides.append(f"trainer.draft.max_position_embeddings={tokens}")
    return load_recipe(path, overrides).recipe


def run_settings(recipe: Recipe, setup: RankSetup, total_steps: int) -> RunSettings:
    """What :func:`runtime.trainer.setup.derive_settings` would give on this device, without a
    job folder or data file: the recipe's dtypes and attention backend on GPU (K3: bf16 compute,
    fp32 reduction, flex; tiny: fp32, SDPA), fp32 + SDPA on CPU (flex has no CPU backward)."""
    cfg = recipe.trainer
    on_gpu = setup.device.type == "cuda"
    backend = cfg.attention_backend if cfg.attention_backend != "auto" else ("flex" if on_gpu else "sdpa")
    return RunSettings(
        rank=setup.rank,
        local_rank=setup.local_rank,
        world_size=setup.world_size,
        device=setup.device,
        param_dtype=getattr(torch, cfg.param_dtype) if on_gpu else torch.float32,
        reduce_dtype=getattr(torch, cfg.reduce_dtype) if on_gpu else torch.float32,
        attention_backend=backend if on_gpu else "sdpa",
        num_rows=recipe.data.num_rows or 1,
        total_steps=total_steps,
        chunk_rows=cfg.loss.objective_chunk_blocks * cfg.draft.block_size,
        job_dir=REPO_ROOT,
        checkpoint_dir=REPO_ROOT,
        data_digest="synthetic",
        smoke=False,
        compile_regions=cfg.compile_regions == "on" or (cfg.compile_regions == "auto" and on_gpu),
    )


def build_model(trainer_settings: TrainerSetup) -> DSparkDraft:
    """The draft as :meth:`Trainer._build_model` builds it, with random frozen embedding / lm_head
    in place of the target's (a K3 vocabulary pair is 4.7 GiB to read; its values do not matter)."""
    settings, spec = trainer_settings.run, trainer_settings.draft_spec
    torch.manual_seed(trainer_settings.seed)
    with torch.device(settings.device):
        model = spec.build(attention_backend=settings.attention_backend, compile_regions=settings.compile_regions)
    vocab, hidden = spec.vocab_size, spec.draft.hidden_size
    embed = (torch.randn(vocab, hidden, device=settings.device) * 0.02).to(settings.param_dtype)
    lm_head = (torch.randn(vocab, hidden, device=settings.device) / hidden**0.5).to(settings.param_dtype)
    model.attach_frozen_vocab(embed, lm_head)
    return shard_model(model, settings)


class SyntheticSource:
    """A :class:`~runtime.shared.contracts.SampleConsumer` that serves one synthetic sample held
    in (pinned) host memory under every g; ``fetch(g, device)`` copies it to the GPU like the
    Mooncake consumer does."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, hs: torch.Tensor, lhs: torch.Tensor) -> None:
        self.fields = {"ids": ids, "mask": mask, "hs": hs, "lhs": lhs}

    def fetch(self, g: int, device: torch.device | str | None = None) -> CapturedSample:
        """Sample ``g`` (the same tensors under every g), on ``device`` when given."""
        moved = {k: (v if device is None else v.to(device, non_blocking=True)) for k, v in self.fields.items()}
        return CapturedSample(g=g, meta={"g": g, "row_index": g, "engine": "synthetic"}, **moved)

    def commit_step(self, step: int) -> None:
        """Nothing to delete or publish."""

    def publish_cursor(self, cursor: int) -> None:
        """Nothing to publish."""


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------


def rank_flops(
    trainer: Trainer, source: SyntheticSource, shapes: Shapes, steps: range, setup: RankSetup, accumulation: int
) -> float:
    """Model FLOPs this rank computes over ``steps`` (each sample's own layout: anchors depend on g)."""
    total = 0.0
    for step in steps:
        for g in step_sample_indices(step, setup.rank, setup.world_size, 1, accumulation):
            total += sum(microstep_flops(shapes, trainer._layout(source.fetch(g))).values())
    return total


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run the benchmark on this rank; rank 0 returns the results (other ranks None)."""
    setup = rank_setup()
    say = print if setup.rank == 0 else (lambda *_a, **_k: None)
    if args.shapes == "k3" and setup.device.type != "cuda":
        raise SystemExit(
            "--shapes k3 needs a CUDA GPU per rank (H200-class: tens of GiB each); on CPU use --shapes tiny"
        )
    recipe = bench_recipe(args.shapes, setup.world_size, args.accumulation, args.tokens, args.set)
    total_steps = args.warmup + args.steps
    settings = run_settings(recipe, setup, total_steps)
    init_process_group(settings, COLLECTIVE_TIMEOUT_S)
    started = time.monotonic()
    shapes = recipe_shapes(recipe, setup.device)
    device_name = (
        torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else platform.processor() or "CPU"
    )
    say(
        f"[scaling] {setup.world_size} rank(s) ({dist.get_backend()}) on {device_name}, torch {torch.__version__}; "
        f"shapes {args.shapes}: {shapes.draft.num_layers} layers x hidden {shapes.draft.hidden_size}, vocab {shapes.vocab:,}, "
        f"T {shapes.tokens:,}, {shapes.num_anchors} anchors; {args.accumulation} micro-step(s) of 1 sample per rank per step; "
        f"{args.warmup} warm-up + {args.steps} timed steps",
        flush=True,
    )

    with contextlib.redirect_stdout(io.StringIO()):  # every rank times its own GPU; rank 0 prints them all
        matmul = matmul_tflops(shapes, setup.device)
    matmuls = gather_objects(matmul, setup.world_size)
    say(
        f"[scaling] baseline {str(shapes.dtype).removeprefix('torch.')} {shapes.matmul_n}^3 matmul per rank: "
        + ", ".join(f"{t:.4g}" for t in matmuls)
        + " TFLOP/s",
        flush=True,
    )

    resolved = ResolvedRecipe(
        recipe=recipe,
        digest="bench",
        path=REPO_ROOT / "recipes" / f"{RECIPES[args.shapes]}.yaml",
        repo_root=REPO_ROOT,
        source=f"tools.bench.trainer_scaling --shapes {args.shapes}",
        smoke=False,
        overrides=[],
    )
    trainer_settings = setup_for_run(resolved, settings)
    trainer = Trainer(trainer_settings)
    model = build_model(trainer_settings)
    opt = trainer_settings.optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
    )
    guard = FiniteGuard(smoke=False, max_consecutive_skips=trainer_settings.max_consecutive_skips)
    parameters = sum(p.numel() for p in model.parameters())  # sharded DTensors report their global size
    source = SyntheticSource(*synthetic_sample(shapes, setup.device))
    say(
        f"[scaling] model {parameters:,} trainable parameters, fp32 master weights, compute {str(settings.param_dtype).removeprefix('torch.')}, "
        f"attention {settings.attention_backend}; setup {time.monotonic() - started:.1f} s",
        flush=True,
    )

    step_s: list[float] = []
    losses: list[float] = []
    grad_norms: list[float] = []
    timed_started = 0.0
    warmup_peak: float | None = None
    for step in range(total_steps):
        warm = step < args.warmup
        if step == args.warmup:
            sync(setup.device)
            if setup.device.type == "cuda":  # the warm-up's peak includes compiling; the timed steps get their own
                warmup_peak = torch.cuda.max_memory_allocated(setup.device) / GIB
                torch.cuda.reset_peak_memory_stats(setup.device)
            dist.barrier()
            timed_started = time.monotonic()
        sync(setup.device)
        t0 = time.perf_counter()
        outcome = trainer._train_step(step, model, optimizer, source, guard)
        sync(setup.device)
        seconds = time.perf_counter() - t0
        if not outcome.applied:
            raise SystemExit(
                f"step {step}: the update was skipped as non-finite ({outcome.rank_terms}); the benchmark needs finite steps"
            )
        if not warm:
            step_s.append(seconds)
            losses.append(outcome.sums["loss_total"])
            grad_norms.append(outcome.grad_norm)
        done_timed = len(step_s)
        eta = (
            (time.monotonic() - timed_started) / done_timed * (args.steps - done_timed) if done_timed else float("nan")
        )
        say(
            f"[scaling] step {step + 1}/{total_steps} ({'warm-up' if warm else 'timed'}): {seconds:.3f} s on rank 0, "
            f"loss {outcome.sums['loss_total']:.4f}, grad norm {outcome.grad_norm:.3f}"
            + ("" if warm else f"; ETA {eta:.0f} s"),
            flush=True,
        )

    if args.trace is not None and setup.device.type == "cuda":
        # One more step under the profiler (not timed): where the GPU waits inside a production step.
        step = total_steps

        def traced_step() -> None:
            trainer._train_step(step, model, optimizer, source, guard)

        trace_gpu_gaps(traced_step, setup.device, args.trace, f"train_step_rank{setup.rank}")
    peak = torch.cuda.max_memory_allocated(setup.device) / GIB if setup.device.type == "cuda" else None
    reserved = torch.cuda.max_memory_reserved(setup.device) / GIB if setup.device.type == "cuda" else None
    capacity = (
        torch.cuda.get_device_properties(setup.device).total_memory / GIB if setup.device.type == "cuda" else None
    )
    flops = rank_flops(trainer, source, shapes, range(args.warmup, args.warmup + args.steps), setup, args.accumulation)
    per_rank = gather_objects(
        {
            "step_s": step_s,
            "flops": flops,
            "peak": peak,
            "reserved": reserved,
            "capacity": capacity,
            "warmup_peak": warmup_peak,
        },
        setup.world_size,
    )
    dist.barrier()
    dist.destroy_process_group()
    if setup.rank != 0:
        return None

    # Ranks meet in collectives every micro-step, so a step lasts as long as its slowest rank.
    slowest = [max(r["step_s"][i] for r in per_rank) for i in range(args.steps)]
    step_time = statistics.median(slowest)
    tokens_per_rank_step = args.accumulation * shapes.tokens
    flops_per_step = [r["flops"] / args.steps for r in per_rank]
    achieved = [f / step_time / 1e12 for f in flops_per_step]
    mfu = [a / m for a, m in zip(achieved, matmuls, strict=True)]
    return {
        "format": JSON_FORMAT,
        "shapes": args.shapes,
        "world_size": setup.world_size,
        "backend": "nccl" if setup.device.type == "cuda" else "gloo",
        "device": device_name,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "tokens_per_sample": shapes.tokens,
        "hidden_size": shapes.draft.hidden_size,
        "vocab_size": shapes.vocab,
        "num_anchors": shapes.num_anchors,
        "accumulation": args.accumulation,
        "micro_batch": 1,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "parameters": parameters,
        "param_dtype": str(settings.param_dtype).removeprefix("torch."),
        "attention_backend": settings.attention_backend,
        "step_times_s": slowest,
        "step_time_s": step_time,
        "tokens_per_step": tokens_per_rank_step * setup.world_size,
        "tokens_per_s": tokens_per_rank_step * setup.world_size / step_time,
        "tokens_per_s_per_rank": tokens_per_rank_step / step_time,
        "model_tflop_per_step": sum(flops_per_step) / 1e12,
        "model_tflops_per_rank": achieved,
        "matmul_tflops_per_rank": matmuls,
        "mfu_per_rank": mfu,
        "mfu": statistics.mean(mfu),
        "peak_allocated_gib_per_rank": [r["peak"] for r in per_rank],
        "peak_reserved_gib_per_rank": [r["reserved"] for r in per_rank],
        "warmup_peak_allocated_gib_per_rank": [r["warmup_peak"] for r in per_rank],
        "device_memory_gib_per_rank": [r["capacity"] for r in per_rank],
        "loss": losses,
        "grad_norm": grad_norms,
        "wall_s": time.monotonic() - started,
    }


def print_report(result: dict[str, Any]) -> None:
    """The human summary of one run."""
    r = result
    print(
        f"[scaling] {r['world_size']} rank(s), {r['shapes']} shapes, T={r['tokens_per_sample']:,}, {r['accumulation']} micro-step(s) per step:"
    )
    print(f"    step time            {r['step_time_s']:.3f} s (median of {r['timed_steps']}; slowest rank each step)")
    print(f"    tokens/s             {r['tokens_per_s']:,.0f} total, {r['tokens_per_s_per_rank']:,.0f} per rank")
    print(
        f"    model FLOPs          {r['model_tflop_per_step']:.4g} TFLOP per step; per rank "
        + ", ".join(f"{t:.4g}" for t in r["model_tflops_per_rank"])
        + " TFLOP/s"
    )
    print(
        "    MFU vs the matmul    "
        + ", ".join(f"{m:.3f}" for m in r["mfu_per_rank"])
        + f" (mean {r['mfu']:.3f}; target >= {MFU_TARGET}: {'met' if r['mfu'] >= MFU_TARGET else 'NOT met'})"
    )
    if r["peak_allocated_gib_per_rank"][0] is not None:
        print(
            "    peak memory          "
            + ", ".join(
                f"{p:.1f} GiB (reserved {q:.1f} of {c:.1f}; warm-up {w:.1f})"
                for p, q, c, w in zip(
                    r["peak_allocated_gib_per_rank"],
                    r["peak_reserved_gib_per_rank"],
                    r["device_memory_gib_per_rank"],
                    r["warmup_peak_allocated_gib_per_rank"],
                    strict=True,
                )
            )
            + " per rank"
        )
    else:
        print("    peak memory          n/a (CUDA only)")


def write_json(path: Path, result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` through a temporary name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------
# scaling efficiency from two runs
# ----------------------------------------------------------------------------------------------


class CompareError(ValueError):
    """Two result files that cannot be compared; the message names the file, the field and the fix."""


MUST_MATCH = (
    "shapes",
    "tokens_per_sample",
    "accumulation",
    "micro_batch",
    "param_dtype",
    "attention_backend",
    "backend",
)


def read_result(path: Path) -> dict[str, Any]:
    """A result file of this benchmark."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CompareError(f"{path}: no such file; fix: write it with --json {path}") from None
    except json.JSONDecodeError as exc:
        raise CompareError(f"{path}: not JSON ({exc}); fix: run the benchmark again with --json {path}") from None
    if not isinstance(data, dict) or data.get("format") != JSON_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CompareError(
            f"{path}: field 'format' is {found!r}, expected {JSON_FORMAT!r}; fix: pass files written by this benchmark's --json"
        )
    return data


def scaling_efficiency(one: dict[str, Any], many: dict[str, Any], one_path: Path, many_path: Path) -> float:
    """``many.tokens_per_s / (many.world_size x one.tokens_per_s)`` after checking they compare."""
    if one["world_size"] != 1:
        raise CompareError(
            f"{one_path}: field 'world_size' is {one['world_size']}, expected 1; fix: pass the 1-rank run first"
        )
    if many["world_size"] < 2:
        raise CompareError(
            f"{many_path}: field 'world_size' is {many['world_size']}; fix: pass a run with 2 or more ranks second"
        )
    for key in MUST_MATCH:
        if one[key] != many[key]:
            raise CompareError(
                f"{many_path}: field '{key}' is {many[key]!r} but {one_path} has {one[key]!r}; the runs must differ "
                "only in the number of ranks; fix: run both with the same --shapes/--tokens/--accumulation"
            )
    return many["tokens_per_s"] / (many["world_size"] * one["tokens_per_s"])


def compare(one_path: Path, many_path: Path) -> float:
    """Print the comparison of a 1-rank and an N-rank result; returns the efficiency."""
    one, many = read_result(one_path), read_result(many_path)
    efficiency = scaling_efficiency(one, many, one_path, many_path)
    n = many["world_size"]
    print(
        f"[scaling] {one['shapes']} shapes, T={one['tokens_per_sample']:,}, {one['accumulation']} micro-step(s) per rank per step, {one['device']}"
    )
    print(f"    {'ranks':>5} {'step s':>8} {'tokens/s':>12} {'tok/s/rank':>11} {'MFU':>6} {'peak GiB (max rank)':>20}")
    for r in (one, many):
        peaks = [p for p in r["peak_allocated_gib_per_rank"] if p is not None]
        peak = f"{max(peaks):.1f}" if peaks else "n/a"
        print(
            f"    {r['world_size']:>5} {r['step_time_s']:>8.3f} {r['tokens_per_s']:>12,.0f} {r['tokens_per_s_per_rank']:>11,.0f} {r['mfu']:>6.3f} {peak:>20}"
        )
    verdict = "met" if efficiency >= EFFICIENCY_TARGET else "NOT met"
    print(
        f"    scaling efficiency = {n}-rank tokens/s / ({n} x 1-rank tokens/s) = {efficiency:.3f} (target >= {EFFICIENCY_TARGET}: {verdict})"
    )
    return efficiency


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(
        prog="python3 -m tools.bench.trainer_scaling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--shapes", choices=sorted(RECIPES), default="tiny", help="recipe the shapes come from (default tiny)"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps (default 3)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed steps first (default 1: compiles flex_attention)"
    )
    parser.add_argument(
        "--accumulation",
        type=int,
        default=2,
        help="micro-steps (1 sample each) per rank per optimizer step (default 2)",
    )
    parser.add_argument("--tokens", type=int, help="tokens per sample T (default: the recipe's data.max_length)")
    parser.add_argument("--json", type=Path, help="write the results here (rank 0)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override (repeatable)")
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="DIR",
        help="GPU only: profile one extra step; GPU idle gaps and a chrome trace go to DIR (tools/bench/gpu_gaps.py)",
    )
    parser.add_argument(
        "--compare",
        type=Path,
        nargs=2,
        metavar=("ONE.json", "N.json"),
        help="print the scaling efficiency of two results",
    )
    args = parser.parse_args(argv)
    if args.compare:
        try:
            compare(*args.compare)
        except CompareError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.steps < 1 or args.warmup < 0 or args.accumulation < 1 or (args.tokens is not None and args.tokens < 16):
        parser.error("--steps and --accumulation must be at least 1, --warmup at least 0, --tokens at least 16")
    result = run(args)
    if result is not None:
        print_report(result)
        if args.json:
            write_json(args.json, result)
            print(f"[scaling] wrote {args.json}")
    return 0


if __name__ == "__main__":
    code = main()
    # As runtime/trainer/__main__.py does: results are written and the process group is gone;
    # skip interpreter finalization, where late gloo teardown can abort a finished rank (SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
