"""DSpark trainer benchmarks: one micro-step at Kimi K3 draft shapes, and the chunked loss's memory.

Sections (each prints a ratio against a baseline measured in the same run):

- ``matmul``: the baseline, a bf16 8192^3 matmul (TFLOP/s). MFU below is measured against it.
- ``microstep``: one trainer micro-step (forward + backward of one sample) of the K3 draft
  (shapes from ``recipes/kimi_k3_v1c.yaml``: 5 layers, hidden 7,168, 64/16 heads of 64, MLP
  14,336, YaRN; vocab 163,840; 5 aux layers; 512 anchors x 7 slots; chunks of 128 blocks) on a
  T = 65,536 sample, under FSDP2 on one rank (bf16 compute, fp32 master weights and gradients),
  flex_attention. Reports time, peak memory, model TFLOP/s and MFU = model FLOP/s / matmul
  FLOP/s, and a per-phase time breakdown (sample copy, context projection, embedding + RoPE +
  block mask, decoder layers, loss terms, backward).
- ``loss``: the vocabulary terms (CE + full L1, fp32 softmaxes, forward + backward) at the same
  shapes, chunked (this trainer) vs unchunked (plain autograd over [3584, 163840]): peak memory
  above the inputs and time; the ratio chunked / unchunked peak (target <= 0.15).

- ``checkpoint`` (only when asked for): the trainer's ``save_checkpoint`` of the draft with its AdamW
  moments, against a plain write (with fsync) of the same bytes, with its parts (DCP write, the weights
  and optimizer hashes, the file digests); a stop must fit in it before SIGKILL (``job.stop_grace_s``,
  Slurm's KillWait). Under ``torchrun --nproc-per-node 4`` the recipe's 4 ranks save at once (each its
  share, on its own GPU); on one rank it projects the recipe's ranks.

``--quick`` runs everything at tiny shapes on CPU (fp32, SDPA, gloo) to prove the tool works; CUDA
memory statistics are reported on GPU only.

Examples::

    python3 -m tools.bench.trainer --quick
    python3 -m tools.bench.trainer                      # H200; about 2-4 minutes
    python3 -m tools.bench.trainer --section loss
    python3 -m tools.bench.trainer --section checkpoint   # H200; about 2 minutes, 25 GiB of disk
    torchrun --nproc-per-node 4 -m tools.bench.trainer --section checkpoint   # the recipe's 4 ranks
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.user_errors import exit_without_package

try:  # a stock python3 instead of the venv's: one line, not a traceback
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from runtime.recipe import Recipe, load_recipe
    from runtime.recipe.backbones import BACKBONE_SETS
    from runtime.recipe.fit.trainer_memory import draft_parameter_counts, layer_shapes
    from runtime.recipe.schema import DraftConfig
    from runtime.trainer.layout import BlockLayout, anchor_generator, build_layout
    from runtime.trainer.model import DSparkDraft, LatentAttention, SampleInputs
    from runtime.trainer.objective import loss_coefficients
    from runtime.trainer.vocab_objective import chunked_vocab_objective
    from runtime.transport.loopback import free_port
except ModuleNotFoundError as _missing:
    exit_without_package(_missing, "tools.bench.trainer")

REPO_ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


@dataclass(frozen=True)
class Shapes:
    """Everything the benchmark sizes."""

    draft: DraftConfig
    vocab: int
    num_aux: int
    tokens: int
    num_anchors: int
    chunk_blocks: int
    matmul_n: int
    dtype: torch.dtype


def recipe_shapes(recipe: Recipe, device: torch.device) -> Shapes:
    """The micro-step shapes of ``recipe`` (what :func:`tools.bench.trainer.microstep_flops` reads).
    The matmul baseline is bf16 8192^3 on GPU, a small fp32 one on CPU."""
    on_gpu = device.type == "cuda"
    return Shapes(
        draft=recipe.trainer.draft,
        vocab=recipe.capture.vocab_size,
        num_aux=recipe.num_aux_layers,
        tokens=recipe.data.max_length,
        num_anchors=recipe.trainer.loss.num_anchors,
        chunk_blocks=recipe.trainer.loss.objective_chunk_blocks,
        matmul_n=8192 if on_gpu else 512,
        dtype=torch.bfloat16 if on_gpu else torch.float32,
    )


def k3_shapes(attention: str = "gqa") -> Shapes:
    """K3 draft shapes, read from the recipe so the benchmark follows it; ``attention`` picks the draft
    backbone (the recipe's GQA16, or the K3 MLA draft of runtime/recipe/backbones.py)."""
    sets = list(BACKBONE_SETS[attention]["kimi_k3_v1c"])
    return recipe_shapes(load_recipe(REPO_ROOT / "recipes" / "kimi_k3_v1c.yaml", sets).recipe, torch.device("cuda"))


def quick_shapes(attention: str = "gqa") -> Shapes:
    """Tiny shapes for a CPU run (with ``mla``, the tiny recipe's MLA shape)."""
    tiny = load_recipe(REPO_ROOT / "recipes" / "tiny.yaml", list(BACKBONE_SETS[attention]["tiny"])).recipe.trainer.draft
    draft = k3_shapes(attention).draft.model_copy(
        update=dict(
            num_layers=2,
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=256,
            max_position_embeddings=4096,
            mask_token_id=3,
            markov_rank=16,
            mla=tiny.mla,
        )
    )
    return Shapes(
        draft=draft,
        vocab=4096,
        num_aux=3,
        tokens=1024,
        num_anchors=64,
        chunk_blocks=8,
        matmul_n=512,
        dtype=torch.float32,
    )


# ----------------------------------------------------------------------------------------------
# timing helpers
# ----------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class PhaseClock:
    """Marks named points in a micro-step (CUDA events on GPU, wall clock on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list[tuple[str, object]] = []

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event))
        else:
            self.marks.append((name, time.perf_counter()))

    def durations(self) -> list[tuple[str, float]]:
        """Seconds between consecutive marks, named by the later mark."""
        sync(self.device)
        out = []
        for (_, a), (name, b) in zip(self.marks, self.marks[1:], strict=False):
            seconds = a.elapsed_time(b) / 1000.0 if self.device.type == "cuda" else b - a  # type: ignore[union-attr]
            out.append((name, seconds))
        return out


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def reset_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / GIB


def fmt_gib(value: float | None) -> str:
    return "n/a (CUDA only)" if value is None else f"{value:.2f} GiB"


# ----------------------------------------------------------------------------------------------
# matmul baseline
# ----------------------------------------------------------------------------------------------


def matmul_tflops(shapes: Shapes, device: torch.device) -> float:
    n = shapes.matmul_n
    a = torch.randn(n, n, device=device, dtype=shapes.dtype)
    b = torch.randn(n, n, device=device, dtype=shapes.dtype)
    seconds = timed(lambda: a @ b, device, repeats=10 if device.type == "cuda" else 3, warmup=3)
    tflops = 2 * n**3 / seconds / 1e12
    print(
        f"[matmul] {str(shapes.dtype).removeprefix('torch.')} {n}^3: {seconds * 1e3:.3f} ms, {tflops:.2f} TFLOP/s (baseline)"
    )
    return tflops


# ----------------------------------------------------------------------------------------------
# model FLOPs of one micro-step (useful work, fwd + bwd, no recompute counted)
# ----------------------------------------------------------------------------------------------


def microstep_flops(shapes: Shapes, layout: BlockLayout) -> dict[str, float]:
    d = shapes.draft
    T, H, V, r = layout.seq_len, d.hidden_size, shapes.vocab, d.markov_rank
    Q = layout.num_blocks * layout.block_size
    M = int(layout.eval_mask.sum())
    layers = layer_shapes(d)
    layer_params = sum(shape.params + 3 * H * d.intermediate_size for shape in layers)
    visible = int(((layout.anchors * layout.keep).sum() + Q) * layout.block_size)  # keys seen, summed over queries
    attention_fwd = sum(
        2 * visible * shape.heads * (shape.score_dim + shape.value_dim)
        if shape.attends_context
        else Q * shape.recurrent_flops_per_slot
        for shape in layers
    )
    return {
        "fc (fwd + weight grad)": 4.0 * T * shapes.num_aux * H * H,
        "context k/v (fwd + bwd)": 6.0 * T * sum(shape.context_params for shape in layers),
        "draft layers (fwd + bwd)": 6.0 * Q * layer_params,
        "attention (fwd + bwd)": 3.0 * attention_fwd,
        "lm_head draft (fwd + input grad)": 4.0 * M * H * V,
        "lm_head teacher (fwd)": 2.0 * M * H * V,
        "markov bias (fwd + bwd)": 6.0 * M * r * V,
    }


# ----------------------------------------------------------------------------------------------
# micro-step
# ----------------------------------------------------------------------------------------------


def init_single_rank(device: torch.device) -> None:
    """The process group: torchrun's ranks when it started this process (``WORLD_SIZE`` set), else one rank."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group(backend, rank=0, world_size=1)


def synthetic_sample(
    shapes: Shapes, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, an assistant-heavy mask (every block of a long sample gets all slots), hs, lhs (host)."""
    T, H = shapes.tokens, shapes.draft.hidden_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shapes.vocab, (T,), generator=g)
    mask = torch.ones(T, dtype=torch.uint8)
    mask[: T // 16] = 0  # a system/user prefix
    # drawn on the device (a 64K K3 hs is 2.3e9 values), kept in pinned host memory like a fetched sample
    features = torch.Generator(device=device).manual_seed(1)
    out = []
    for width in (shapes.num_aux * H, H):
        drawn = torch.randn(T, width, device=device, generator=features, dtype=torch.bfloat16)
        host = torch.empty(drawn.shape, dtype=drawn.dtype, pin_memory=device.type == "cuda")
        out.append(host.copy_(drawn))
        del drawn
    return ids, mask, out[0], out[1]


def attention_backend(device: torch.device) -> str:
    """The draft's attention on ``device``: compiled flex_attention on a GPU, SDPA on the CPU."""
    return "flex" if device.type == "cuda" else "sdpa"


def build_draft(shapes: Shapes, device: torch.device, use_fsdp: bool) -> DSparkDraft:
    """The draft at ``shapes`` with its frozen vocabulary, under single-rank FSDP2 (fp32 master weights,
    compute in ``shapes.dtype``) or as a plain module in the compute dtype."""
    torch.manual_seed(0)
    with torch.device(device):
        model = DSparkDraft(
            shapes.draft,
            vocab_size=shapes.vocab,
            num_aux_layers=shapes.num_aux,
            attention_backend=attention_backend(device),
            max_length=shapes.tokens,
        )
    embed = (torch.randn(shapes.vocab, shapes.draft.hidden_size, device=device) * 0.02).to(shapes.dtype)
    head = (torch.randn(shapes.vocab, shapes.draft.hidden_size, device=device) * 0.02).to(shapes.dtype)
    model.attach_frozen_vocab(embed, head)
    if use_fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        init_single_rank(device)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=shapes.dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    else:
        model = model.to(shapes.dtype)
    return model


def run_microstep(shapes: Shapes, device: torch.device, matmul: float, repeats: int, use_fsdp: bool) -> None:
    model = build_draft(shapes, device, use_fsdp)
    backend = attention_backend(device)
    params = sum(p.numel() for p in model.parameters())
    ids, mask, hs_host, lhs_host = synthetic_sample(shapes, device)
    layout_started = time.perf_counter()
    layout = build_layout(
        ids,
        mask,
        num_anchors=shapes.num_anchors,
        block_size=shapes.draft.block_size,
        mask_token_id=shapes.draft.mask_token_id,
        loss_decay_gamma=4.0,
        generator=anchor_generator(0, 0),
    )
    layout_s = time.perf_counter() - layout_started
    dev_layout = layout.to(device)
    coefficients = loss_coefficients(
        ce_weight=0.1,
        l1_weight=0.9,
        confidence_weight=1.0,
        global_weight_sum=float(layout.weights.sum()),
        gradient_scale=1.0,
        chunk_rows=shapes.chunk_blocks * shapes.draft.block_size,
    )
    clock_ref: list[PhaseClock] = []

    def hook(name: str) -> Callable[..., None]:
        def mark(*_args: object) -> None:
            if clock_ref:
                clock_ref[-1].mark(name)

        return mark

    model.fc.register_forward_pre_hook(hook("sample copy + FSDP unshard"))
    model.hidden_norm.register_forward_hook(hook("context projection (fc + norm)"))
    model.layers[0].register_forward_pre_hook(hook("embedding + RoPE + block mask"))
    model.norm.register_forward_hook(hook("decoder layers (fwd)"))

    resident_sample: list[torch.Tensor] = []

    def step() -> None:
        clock = PhaseClock(device)
        clock_ref.append(clock)
        clock.mark("start")
        if resident_sample:  # the trainer's prefetch has the sample on the GPU already
            hs, lhs = resident_sample
        else:
            hs, lhs = hs_host.to(device, non_blocking=True), lhs_host.to(device, non_blocking=True)
        inputs = SampleInputs(hs=hs, lhs=lhs, layout=dev_layout)
        terms = model(inputs, coefficients)
        clock.mark("loss terms (fwd, with their grads)")
        terms.loss.backward()
        clock.mark("backward")
        model.zero_grad(set_to_none=True)

    started = time.perf_counter()
    step()  # warmup: compiles flex_attention
    sync(device)
    print(
        f"[microstep] warmup (compile) {time.perf_counter() - started:.1f} s; {params:,} parameters; attention {backend}; fsdp {use_fsdp}"
    )
    resident = reset_peak(device)
    seconds = timed(step, device, repeats=repeats, warmup=0)
    peak = peak_gib(device)
    # The trainer copies the next sample to the GPU on a side stream while this one computes
    # (runtime/trainer/prefetch.py), so the step it runs starts with the sample resident.
    resident_sample.extend([hs_host.to(device), lhs_host.to(device)])
    clock_count = len(clock_ref)
    prefetched_seconds = timed(step, device, repeats=repeats, warmup=0)
    del clock_ref[clock_count:]
    resident_sample.clear()

    phases: dict[str, list[float]] = {}
    for clock in clock_ref[1:]:
        for name, value in clock.durations():
            phases.setdefault(name, []).append(value)
    flops = microstep_flops(shapes, layout)
    total = sum(flops.values())
    achieved = total / seconds / 1e12
    print(
        f"[microstep] T={layout.seq_len:,} anchors={int(layout.keep.sum())} slots={layout.num_blocks * layout.block_size:,} "
        f"supervised={int(layout.eval_mask.sum()):,} vocab={shapes.vocab:,}: {seconds:.3f} s per micro-step (median of {repeats})"
    )
    print(f"[microstep] peak memory {fmt_gib(peak)} (resident before the step {fmt_gib(resident)})")
    if device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory / GIB
        print(f"[microstep] fits one GPU: {peak <= capacity} ({peak:.1f} of {capacity:.1f} GiB)")
    print(
        f"[microstep] model FLOPs {total / 1e12:.3f} TFLOP -> {achieved:.2f} TFLOP/s; MFU vs the matmul baseline = {achieved / matmul:.3f} (target >= 0.45)"
    )
    prefetched = total / prefetched_seconds / 1e12
    print(
        f"[microstep] with the sample already on the GPU (the trainer's side-stream prefetch): {prefetched_seconds:.3f} s, "
        f"{prefetched:.2f} TFLOP/s, MFU {prefetched / matmul:.3f}"
    )
    for name, value in flops.items():
        print(f"    {name:<36} {value / 1e9:11.1f} GFLOP ({100 * value / total:4.1f}%)")
    print(f"[microstep] phases (median ms; layout on the host: {layout_s * 1e3:.1f} ms, not in the step):")
    for name, values in phases.items():
        ms = statistics.median(values) * 1e3
        print(f"    {name:<36} {ms:9.1f} ms ({100 * ms / (seconds * 1e3):4.1f}%)")


# ----------------------------------------------------------------------------------------------
# chunked vs unchunked loss
# ----------------------------------------------------------------------------------------------


def unchunked_terms(h, latent, w2, lm_head, teacher, labels, weights) -> torch.Tensor:
    """The baseline: plain autograd over the whole [slots, vocab] in fp32."""
    logits = (h @ lm_head.t()).float() + (latent @ w2.t()).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    p = torch.softmax(logits, dim=-1)
    q = torch.softmax((teacher @ lm_head.t()).float(), dim=-1)
    l1 = (p - q).abs().sum(-1)
    return (weights * (0.1 * ce + 0.9 * l1)).sum()


def run_loss(shapes: Shapes, device: torch.device, repeats: int) -> None:
    slots = shapes.num_anchors * shapes.draft.block_size
    H, V, r, dtype = shapes.draft.hidden_size, shapes.vocab, shapes.draft.markov_rank, shapes.dtype
    g = torch.Generator(device=device).manual_seed(0)
    h = (torch.randn(slots, H, device=device, generator=g) * 0.05).to(dtype).requires_grad_()
    latent = (torch.randn(slots, r, device=device, generator=g) * 0.02).to(dtype).requires_grad_()
    w2 = (torch.randn(V, r, device=device, generator=g) * 0.02).to(dtype).requires_grad_()
    lm_head = (torch.randn(V, H, device=device, generator=g) * 0.02).to(dtype)
    teacher = (torch.randn(slots, H, device=device, generator=g) * 0.05).to(dtype)
    labels = torch.randint(0, V, (slots,), device=device, generator=g)
    weights = torch.rand(slots, device=device, generator=g)
    chunk_rows = shapes.chunk_blocks * shapes.draft.block_size

    def chunked() -> None:
        loss, *_ = chunked_vocab_objective(
            h, latent, w2, lm_head, teacher, labels, weights, ce_coef=0.1, l1_coef=0.9, chunk_rows=chunk_rows
        )
        loss.backward()
        h.grad = latent.grad = w2.grad = None

    def unchunked() -> None:
        unchunked_terms(h, latent, w2, lm_head, teacher, labels, weights).backward()
        h.grad = latent.grad = w2.grad = None

    results = {}
    for name, fn in (("unchunked (baseline)", unchunked), ("chunked", chunked)):
        fn()
        base = reset_peak(device)
        seconds = timed(fn, device, repeats=repeats, warmup=0)
        peak = peak_gib(device)
        above = None if peak is None or base is None else peak - base
        results[name] = (seconds, above)
        print(
            f"[loss] {name}: {seconds * 1e3:.1f} ms, peak above inputs {fmt_gib(above)} ({slots:,} slots x {V:,} vocab, chunk {chunk_rows} slots)"
        )
    (t_base, m_base), (t_chunk, m_chunk) = results["unchunked (baseline)"], results["chunked"]
    ratio = "n/a" if m_base is None or m_chunk is None else f"{m_chunk / m_base:.3f}"
    print(f"[loss] chunked / unchunked: peak memory {ratio} (target <= 0.15), time {t_chunk / t_base:.2f}x")


def _write_plain(path: Path, total_bytes: int, chunk_bytes: int = 256 << 20) -> float:
    """Seconds to write ``total_bytes`` into ``path`` from host memory in one sequential stream and
    fsync it, as DCP's writer does (the disk's rate for one process: the baseline of the checkpoint
    write)."""
    chunk = torch.ones(min(chunk_bytes, total_bytes), dtype=torch.uint8).numpy()
    started = time.perf_counter()
    with path.open("wb") as handle:
        left = total_bytes
        while left > 0:
            handle.write(chunk[: min(left, chunk.size)])
            left -= chunk.size
        handle.flush()
        os.fsync(handle.fileno())
    return time.perf_counter() - started


def _write_share(path: str, total_bytes: int, ready: Any, times: Any) -> None:
    """One writer of :func:`_write_plain_at_once`: waits for the others, then writes its share."""
    ready.wait()
    started = time.time()
    _write_plain(Path(path), total_bytes)
    times.put((started, time.time()))
    Path(path).unlink()


def _write_plain_at_once(scratch: Path, total_bytes: int, writers: int) -> float:
    """Seconds for ``writers`` processes to write ``total_bytes / writers`` each at once (with fsync),
    from the first start to the last end: whether the disk takes the recipe's ranks writing together."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ready, times = context.Barrier(writers), context.Queue()
    processes = [
        context.Process(
            target=_write_share, args=(str(scratch / f"share_{i}.bin"), total_bytes // writers, ready, times)
        )
        for i in range(writers)
    ]
    for process in processes:
        process.start()
    spans = [times.get(timeout=600) for _ in processes]
    for process in processes:
        process.join()
    return max(end for _, end in spans) - min(start for start, _ in spans)


def _slowest(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Seconds of ``fn`` on the slowest rank (every rank starts it together), and its result."""
    if dist.is_initialized():
        dist.barrier()
    started = time.perf_counter()
    result = fn()
    sync(device)
    seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item()), result


def run_checkpoint(shapes: Shapes, device: torch.device, scratch: Path, recipe_ranks: int) -> None:
    """The trainer's checkpoint save (``save_checkpoint``) of the draft with AdamW moments, on every rank
    of this run (``torchrun --nproc-per-node N`` for N; one rank otherwise), against a plain write of each
    rank's share of the bytes by every rank at once, with the time of each part; what a stop must fit in
    (Slurm's KillWait after a plain scancel, GraceTime on preemption). Times are the slowest rank's."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from runtime.trainer.checkpoints import SAVE_PHASES, flat_tensors, rng_state, save_checkpoint
    from runtime.trainer.state_hash import state_dict_sha256 as tensors_sha256

    model = build_draft(shapes, device, use_fsdp=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()  # the moments exist from the first step on
    optimizer.zero_grad(set_to_none=True)
    model_state, optim_state = get_state_dict(model, optimizer)
    tensors = {**flat_tensors(model_state), **flat_tensors(optim_state)}
    state_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    say(
        f"[bench] checkpoint: {len(tensors)} tensors, {state_bytes / GIB:.2f} GiB (fp32 weights + AdamW moments), {world} rank(s)"
    )
    scratch.mkdir(parents=True, exist_ok=True)
    plain = scratch / f"plain_{rank}.bin"
    plain_s, _ = _slowest(lambda: _write_plain(plain, state_bytes // world), device)
    plain.unlink()
    save_s, saved = _slowest(
        lambda: save_checkpoint(
            scratch / "checkpoints",
            step=1,
            model=model,
            optimizer=optimizer,
            state={"step": 1},
            rng_states=[rng_state()] * world,
            keep_last=1,
            is_main=rank == 0,
        ),
        device,
    )
    path = saved.path  # type: ignore[attr-defined]
    # The save's own split (save_checkpoint times its parts), the slowest rank's for each part.
    phase_s = saved.phase_s  # type: ignore[attr-defined]
    slowest = torch.tensor(list(phase_s.values()), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    parts = dict(zip(phase_s, slowest.tolist(), strict=True))
    write_s = parts[SAVE_PHASES[0]]
    hashing_s = sum(parts[name] for name in SAVE_PHASES[1:4])  # each rank hashes and reads back 1/N
    # Device tensors hash through pinned staging buffers: the digest must be their host copies' digest.
    on_host = tensors_sha256({name: tensor.full_tensor().cpu() for name, tensor in model_state.items()})
    if tensors_sha256(model_state) != on_host:
        raise SystemExit(
            f"[bench] the weights hash of the {device.type} tensors differs from that of their host copies"
        )
    say(f"[bench] the weights hash of the {device.type} tensors equals that of their host copies")
    written = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        shutil.rmtree(scratch / "checkpoints", ignore_errors=True)
    say(
        f"[bench] baseline: plain write of the same {state_bytes / GIB:.2f} GiB, {world} rank(s) each its share at once: "
        f"{plain_s:.2f} s ({state_bytes / plain_s / 1e9:.2f} GB/s)"
    )
    say(
        f"[bench] save_checkpoint on {world} rank(s): {save_s:.2f} s for {written / GIB:.2f} GiB on disk; ratio to the "
        f"plain write {save_s / plain_s:.2f}"
    )
    for name, seconds in parts.items():
        rate = f" ({written / max(seconds, 1e-9) / 1e9:.2f} GB/s)" if name == SAVE_PHASES[0] else ""
        say(f"[bench]   part: {name}: {seconds:.3f} s{rate}")
    if world == 1 and recipe_ranks > 1:
        # At N ranks each rank writes 1/N of the files and hashes 1/N of the tensors and files. How the
        # writes scale is measured: N processes writing 1/N each at once, against the one writer above.
        together_s = _write_plain_at_once(scratch, state_bytes, recipe_ranks)
        scaling = together_s / plain_s
        shared = hashing_s / recipe_ranks + parts[SAVE_PHASES[4]]
        projected = write_s * scaling + shared
        say(
            f"[bench] disk: {recipe_ranks} processes writing 1/{recipe_ranks} each at once took {together_s:.2f} s, "
            f"{scaling:.2f}x one writer's time for all of it (1/{recipe_ranks} = {1 / recipe_ranks:.2f} if the disk "
            "scales, 1.00 if it does not)"
        )
        say(
            f"[bench] at {recipe_ranks} ranks (the recipe's), each rank's save: about {projected:.1f} s (this rank's DCP "
            f"write {write_s:.2f} s x {scaling:.2f} + 1/{recipe_ranks} of the hashes and digests, plus the "
            f"state file, {shared:.2f} s); "
            f"{write_s + shared:.1f} s if the disk took the writers one at a time; Slurm's default KillWait is 30 s"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m tools.bench.trainer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes on CPU, to prove the tool runs")
    parser.add_argument(
        "--section",
        action="append",
        choices=["microstep", "loss", "checkpoint"],
        help="run only these (default: microstep and loss)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions (default 3, quick 2)")
    parser.add_argument(
        "--scratch",
        type=Path,
        default=REPO_ROOT / ".cache" / "bench_checkpoint",
        help="where the checkpoint section writes (removed after; needs about 3x the draft's fp32 bytes free)",
    )
    parser.add_argument(
        "--no-fsdp", action="store_true", help="plain module in the compute dtype instead of single-rank FSDP2"
    )
    parser.add_argument("--tokens", type=int, default=None, help="override T (default: the recipe's max_length)")
    parser.add_argument(
        "--chunk-blocks", type=int, default=None, help="override objective_chunk_blocks (default: the recipe's)"
    )
    parser.add_argument(
        "--attention",
        action="append",
        choices=sorted(BACKBONE_SETS),
        help="the draft backbone(s) of the micro-step, each timed in turn in this process (default: gqa, the "
        "recipe's); `--attention gqa --attention mla` puts them side by side",
    )
    parser.add_argument(
        "--mla-form",
        choices=["absorbed", "expanded"],
        default=None,
        help="the latent attention's form in the micro-step (the same result; default: the trainer's, expanded)",
    )
    args = parser.parse_args(argv)
    backbones = args.attention or ["gqa"]
    if args.mla_form is not None:
        LatentAttention.default_absorbed = args.mla_form == "absorbed"
    if not args.quick and not torch.cuda.is_available():
        print("no CUDA device: run with --quick on CPU, or on the H200 machine")
        return 0
    device = torch.device("cpu") if args.quick else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def shapes_of(attention: str) -> Shapes:
        shapes = quick_shapes(attention) if args.quick else k3_shapes(attention)
        if args.tokens:
            shapes = Shapes(**{**shapes.__dict__, "tokens": args.tokens})
        if args.chunk_blocks:
            shapes = Shapes(**{**shapes.__dict__, "chunk_blocks": args.chunk_blocks})
        return shapes

    shapes = shapes_of(backbones[0])
    repeats = args.repeats or (2 if args.quick else 3)
    sections = args.section or ["microstep", "loss"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"[bench] {name}, torch {torch.__version__}, shapes: {shapes.draft.num_layers} layers x hidden {shapes.draft.hidden_size}, vocab {shapes.vocab:,}, T {shapes.tokens:,}"
    )
    matmul = matmul_tflops(shapes, device)
    if "microstep" in sections:
        for attention in backbones:
            backbone = shapes_of(attention)
            params = draft_parameter_counts(backbone.draft, backbone.num_aux, backbone.vocab)["trainable"]
            print(f"[microstep] draft backbone {attention}: {params:,} trainable parameters")
            run_microstep(backbone, device, matmul, repeats, use_fsdp=not args.no_fsdp)
            # The model is gone with run_microstep's frame; compiled graphs still hold its memory until the
            # compile caches go (the next backbone found 13-28 GiB resident without this).
            gc.collect()
            torch.compiler.reset()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if "loss" in sections:
        run_loss(shapes, device, repeats)
    if "checkpoint" in sections:
        run_checkpoint(
            shapes,
            device,
            args.scratch,
            load_recipe(REPO_ROOT / "recipes" / "kimi_k3_v1c.yaml").recipe.job.trainer.tasks_per_node,
        )
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
