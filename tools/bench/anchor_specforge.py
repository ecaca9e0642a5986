"""Side by side with SpecForge: our DSpark micro-step vs SpecForge's own DSpark draft and loss.

Both sides get the same shapes (the K3 draft of ``recipes/kimi_k3_v1c.yaml``: 5 layers, hidden
7,168, vocab 163,840, 5 aux layers, 512 anchors x 7 slots, objective chunks of 128 blocks, one
T = 65,536 sample), the same frozen bf16 embedding / lm_head, the same sample (ids, loss mask, hs,
lhs drawn from fixed seeds, resident on the GPU as the trainer's side-stream prefetch leaves it),
the same GPU and flex_attention. Each variant runs in its own process, one after the other (in a
shared process whichever compiles second can recompile with dynamic shapes and run slower), and
each process times a bf16 8192^3 matmul for its MFU. MFU uses this project's useful-FLOP count
(:func:`tools.bench.trainer.microstep_flops`) for every variant, so MFU ratios are speed ratios.

Variants (``--variants``, comma separated):

- ``ours``: this checkout's trainer as the recipe runs it on a GPU: single-rank FSDP2 (fp32 master
  weights, bf16 compute), compiled regions (``trainer.compile_regions: auto``).
- ``ours_eager``: the same with ``compile_regions`` off.
- ``ours_plain``: compiled regions on a plain bf16 module (no FSDP2).
- ``baseline``: ``ours_eager`` run from another checkout (``--baseline-root``, e.g. ``main`` before
  a change), to measure a change in the same run.
- ``specforge``: SpecForge's ``OnlineDSparkModel`` over ``DSparkDraftModel`` in bf16, imported at
  run time from ``--anchors`` (a folder holding SpecForge's ``specforge`` package and
  ``kimi-k3-dspark.json``; never copied into this repository). Its anchor sampling, labels and
  block mask run inside its forward, as SpecForge trains. Skipped, with a line saying so, when the
  folder is absent.

The report prints, per variant: median seconds per micro-step, peak memory, TFLOP/s, MFU, and the
ratio SpecForge time / variant time (> 1: faster than SpecForge). ``--profile`` adds the GPU
kernel-time split of one step (bf16 GEMMs, flex_attention, fp32 GEMMs, elementwise, ...).

``--quick`` runs tiny shapes on the CPU (fp32, SDPA, plain modules, nothing compiled) to prove the
wiring of both sides; its times mean nothing.

Examples::

    python3 -m tools.bench.anchor_specforge --anchors ../shared/anchors/specforge-a6b6b02
    python3 -m tools.bench.anchor_specforge --anchors PATH --variants ours,specforge --profile ours
    python3 -m tools.bench.anchor_specforge --quick --anchors PATH --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

THIS_ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
VARIANTS = ("ours", "ours_eager", "ours_plain", "baseline", "specforge")
ANCHOR_CONFIG = "kimi-k3-dspark.json"


# ----------------------------------------------------------------------------------------------
# parent: one process per variant
# ----------------------------------------------------------------------------------------------


def anchors_present(anchors: Path | None) -> bool:
    """True when ``anchors`` holds SpecForge's package and the K3 draft config."""
    return anchors is not None and (anchors / "specforge").is_dir() and (anchors / ANCHOR_CONFIG).is_file()


def run_variant(variant: str, args: argparse.Namespace, result_path: Path) -> dict[str, Any]:
    """Run one variant in a fresh Python process and read its result."""
    root = Path(args.baseline_root).resolve() if variant == "baseline" else THIS_ROOT
    # -P: the script folder (tools/bench, whose module names are generic) is not put on sys.path
    command = [sys.executable, "-P", str(Path(__file__).resolve()), "--worker", variant, "--result", str(result_path)]
    command += ["--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    if args.quick:
        command.append("--quick")
    if args.tokens:
        command += ["--tokens", str(args.tokens)]
    if args.anchors:
        command += ["--anchors", str(Path(args.anchors).resolve())]
    if variant in args.profile:
        command += ["--profile-out", str(Path(args.profile_dir).resolve() / f"profile_{variant}.txt")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    print(f"[side-by-side] {variant}: own process, code from {root}", flush=True)
    started = time.perf_counter()
    completed = subprocess.run(command, env=env, cwd=root, timeout=args.variant_timeout_s)
    if completed.returncode != 0 or not result_path.is_file():
        return {"variant": variant, "ok": False, "error": f"worker exited with {completed.returncode}"}
    result = json.loads(result_path.read_text())
    result["process_s"] = time.perf_counter() - started
    return result


def report(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Print the table and the ratios against SpecForge; return the summary."""
    reference = next((r for r in results if r["variant"] == "specforge" and r.get("ok")), None)
    print("\n==== side by side (same shapes, same sample, each variant in its own process) ====")
    print(
        f"{'variant':<11} {'s/micro-step':>12} {'peak GiB':>9} {'TFLOP/s':>8} {'matmul':>7} {'MFU':>6} {'SpecForge/this':>14}"
    )
    summary: dict[str, Any] = {}
    for r in results:
        if not r.get("ok"):
            print(f"{r['variant']:<11} FAILED: {r.get('error', '?')[:300]}")
            continue
        ratio = reference["median_s"] / r["median_s"] if reference else None
        r["speed_vs_specforge"] = ratio
        ratio_text = f"{ratio:.3f}" if ratio else "n/a"
        summary[r["variant"]] = {k: r.get(k) for k in ("median_s", "mfu", "peak_gib", "speed_vs_specforge")}
        print(
            f"{r['variant']:<11} {r['median_s']:>12.4f} {r['peak_gib']:>9.2f} {r['tflops']:>8.1f} "
            f"{r['matmul_tflops']:>7.1f} {r['mfu']:>6.3f} {ratio_text:>14}"
        )
        for name, share in (r.get("profile") or {}).get("shares", {}).items():
            print(f"    {name:<30} {share['ms']:8.1f} ms  {100 * share['fraction']:5.1f}%")
    if reference is None:
        print("(no SpecForge result: ratios are n/a)")
    return summary


def parent(args: argparse.Namespace) -> int:
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    if "baseline" in variants and not args.baseline_root:
        raise SystemExit("variant 'baseline' needs --baseline-root (a checkout of the code to compare against)")
    if "specforge" in variants and not anchors_present(Path(args.anchors) if args.anchors else None):
        print(
            f"[side-by-side] SpecForge anchors not found at {args.anchors!r} (need specforge/ and {ANCHOR_CONFIG}): "
            "skipping the specforge variant; pass --anchors PATH to compare",
            flush=True,
        )
        variants.remove("specforge")
    if not args.quick:
        import torch

        if not torch.cuda.is_available():
            print("[side-by-side] no CUDA device: run with --quick on CPU, or on the H200 machine")
            return 0
    Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="anchor_specforge_") as tmp:
        for variant in variants:
            results.append(run_variant(variant, args, Path(tmp) / f"{variant}.json"))
    summary = report(results)
    if args.json:
        partial = Path(args.json).with_name(Path(args.json).name + ".partial")
        partial.write_text(json.dumps({"results": results, "summary": summary}, indent=1, default=str))
        partial.replace(args.json)
    return 0 if all(r.get("ok") for r in results) else 1


# ----------------------------------------------------------------------------------------------
# worker: one variant
# ----------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    import torch

    from runtime.trainer.layout import anchor_generator, build_layout
    from runtime.trainer.objective import loss_coefficients
    from tools.bench.trainer import Shapes, k3_shapes, microstep_flops, quick_shapes, synthetic_sample

    variant = args.worker
    if args.quick:
        device, shapes = torch.device("cpu"), quick_shapes()
    else:
        device, shapes = torch.device("cuda", 0), k3_shapes()
        torch.cuda.set_device(device)
    if args.tokens:
        shapes = Shapes(**{**shapes.__dict__, "tokens": args.tokens})
    result: dict[str, Any] = {"variant": variant, "T": shapes.tokens, "device": str(device), "ok": False}
    try:
        result["matmul_tflops"] = matmul_tflops(shapes, device)
        d = shapes.draft
        frozen = torch.Generator(device=device).manual_seed(7)
        embed = (torch.randn(shapes.vocab, d.hidden_size, device=device, generator=frozen) * 0.02).to(shapes.dtype)
        head = (torch.randn(shapes.vocab, d.hidden_size, device=device, generator=frozen) * 0.02).to(shapes.dtype)
        ids, mask, hs_host, lhs_host = synthetic_sample(shapes, device)
        hs, lhs = hs_host.to(device).to(shapes.dtype), lhs_host.to(device).to(shapes.dtype)
        del hs_host, lhs_host
        layout = build_layout(
            ids,
            mask,
            num_anchors=shapes.num_anchors,
            block_size=d.block_size,
            mask_token_id=d.mask_token_id,
            loss_decay_gamma=4.0,
            generator=anchor_generator(0, 0),
        )
        flops = sum(microstep_flops(shapes, layout).values())
        started = time.perf_counter()
        if variant == "specforge":
            step, model = specforge_step(shapes, device, embed, head, ids, mask, hs, lhs, Path(args.anchors))
        else:
            coefficients = loss_coefficients(
                ce_weight=0.1,
                l1_weight=0.9,
                confidence_weight=1.0,
                global_weight_sum=float(layout.weights.sum()),
                gradient_scale=1.0,
                chunk_rows=shapes.chunk_blocks * d.block_size,
            )
            step, model = our_step(variant, shapes, device, embed, head, hs, lhs, layout.to(device), coefficients)
        result["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        result["first_loss"] = step()
        sync(device)
        result["compile_and_first_step_s"] = time.perf_counter() - started
        for _ in range(args.warmup):
            step()
        resident = reset_peak(device)
        times = []
        for _ in range(args.repeats):
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        result.update(
            ok=True,
            times_s=times,
            median_s=median,
            resident_gib=resident,
            peak_gib=torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0,
            model_tflop=flops / 1e12,
            tflops=flops / median / 1e12,
        )
        result["mfu"] = result["tflops"] / result["matmul_tflops"]
        print(
            f"[{variant}] {median:.4f} s/micro-step (median of {len(times)}: {', '.join(f'{t:.4f}' for t in times)}); "
            f"peak {result['peak_gib']:.2f} GiB; {result['tflops']:.1f} TFLOP/s; MFU {result['mfu']:.3f}; "
            f"first loss {result['first_loss']:.5f}; compile + first step {result['compile_and_first_step_s']:.1f} s",
            flush=True,
        )
        if args.profile_out and device.type == "cuda":
            result["profile"] = profile_step(step, device, Path(args.profile_out))
    except Exception as exc:  # noqa: BLE001 - reported as this variant's result
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    partial = Path(args.result).with_name(Path(args.result).name + ".partial")
    partial.write_text(json.dumps(result, indent=1, default=str))
    partial.replace(args.result)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0 if result["ok"] else 1


def our_step(variant, shapes, device, embed, head, hs, lhs, layout, coefficients) -> tuple[Any, Any]:
    """Our model as the trainer builds it (single-rank FSDP2 unless ``ours_plain``) and its step."""
    import torch

    from runtime.trainer.model import DSparkDraft, SampleInputs

    on_gpu = device.type == "cuda"
    compile_regions = on_gpu and variant in ("ours", "ours_plain")
    extra = {"compile_regions": True} if compile_regions else {}  # a baseline checkout may predate it
    torch.manual_seed(0)
    with torch.device(device):
        model = DSparkDraft(
            shapes.draft,
            vocab_size=shapes.vocab,
            num_aux_layers=shapes.num_aux,
            attention_backend="flex" if on_gpu else "sdpa",
            max_length=shapes.tokens,
            **extra,
        )
    model.attach_frozen_vocab(embed, head)
    if on_gpu and variant != "ours_plain":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from tools.bench.trainer import init_single_rank

        init_single_rank(device)
        mesh = init_device_mesh("cuda", (1,))
        policy = MixedPrecisionPolicy(param_dtype=shapes.dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    else:
        model = model.to(shapes.dtype)
    inputs = SampleInputs(hs=hs, lhs=lhs, layout=layout)

    def step() -> float:
        terms = model(inputs, coefficients)
        terms.loss.backward()
        model.zero_grad(set_to_none=True)
        return float(terms.loss.detach())

    return step, model


def specforge_step(shapes, device, embed, head, ids, mask, hs, lhs, anchors: Path) -> tuple[Any, Any]:
    """SpecForge's OnlineDSparkModel at our shapes, fed the same frozen tensors and sample."""
    import torch
    from torch import nn
    from transformers import Qwen3Config

    sys.path.insert(0, str(anchors))
    from specforge.algorithms.common.dflash_family_model import OnlineDSparkModel
    from specforge.modeling.draft.dspark import DSparkDraftModel

    on_gpu = device.type == "cuda"
    d = shapes.draft
    raw = json.loads((anchors / ANCHOR_CONFIG).read_text())
    raw.pop("auto_map", None)
    raw.update(
        hidden_size=d.hidden_size,
        num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads,
        head_dim=d.head_dim,
        intermediate_size=d.intermediate_size,
        num_hidden_layers=d.num_layers,
        layer_types=["full_attention"] * d.num_layers,
        max_position_embeddings=max(d.max_position_embeddings, shapes.tokens),
        vocab_size=shapes.vocab,
        block_size=d.block_size,
    )
    dflash = dict(raw["dflash_config"], markov_rank=d.markov_rank, mask_token_id=d.mask_token_id)
    if shapes.num_aux != len(dflash["target_layer_ids"]):
        dflash["target_layer_ids"] = list(range(shapes.num_aux))
    raw["dflash_config"] = dflash
    config = Qwen3Config(**raw)
    attention = "flex_attention" if on_gpu else "sdpa"
    config._attn_implementation = attention
    torch.manual_seed(0)
    with torch.device(device):
        draft = DSparkDraftModel(config)
    with torch.no_grad():  # N(0, 0.02) as ours (never time on zeros)
        for module in draft.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, 0.02)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
    with torch.device("meta"):
        lm_head = nn.Linear(d.hidden_size, shapes.vocab, bias=False)
        embedding = nn.Embedding(shapes.vocab, d.hidden_size)
    lm_head.weight = nn.Parameter(head, requires_grad=False)
    embedding.weight = nn.Parameter(embed, requires_grad=False)
    model = OnlineDSparkModel(
        draft_model=draft,
        target_lm_head=lm_head,
        target_embed_tokens=embedding,
        mask_token_id=d.mask_token_id,
        block_size=d.block_size,
        attention_backend="flex_attention" if on_gpu else "sdpa",
        num_anchors=shapes.num_anchors,
        loss_decay_gamma=4.0,
        dspark_ce_loss_alpha=0.1,
        dspark_l1_loss_alpha=0.9,
        dspark_confidence_head_alpha=1.0,
        objective_chunk_blocks=shapes.chunk_blocks,
    ).to(device=device, dtype=shapes.dtype)
    model.train()
    input_ids = ids[None].to(device)
    loss_mask = mask[None].to(device).to(torch.float32)
    hidden, last_hidden = hs[None], lhs[None]

    def step() -> float:
        loss, _accuracy, _metrics = model(
            input_ids=input_ids, hidden_states=hidden, loss_mask=loss_mask, target_last_hidden_states=last_hidden
        )
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, model


# ----------------------------------------------------------------------------------------------
# measurement helpers
# ----------------------------------------------------------------------------------------------


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: Any) -> float:
    import torch

    if device.type != "cuda":
        return 0.0
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / GIB


def matmul_tflops(shapes: Any, device: Any) -> float:
    """The MFU baseline of this process: bf16 8192^3 on GPU (a small fp32 one on CPU)."""
    import torch

    n = shapes.matmul_n
    a = torch.randn(n, n, device=device, dtype=shapes.dtype)
    b = torch.randn(n, n, device=device, dtype=shapes.dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10 if device.type == "cuda" else 3):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e12


KERNEL_CLASSES = (
    ("flex_attention backward", ("flex_attention_backward",)),
    ("flex_attention forward", ("flex_attention", "triton_tem")),
    ("fp32 GEMM (no tensor cores)", ("sgemm", "f32f32", "ffma", "gemmsn")),
    ("bf16 GEMM", ("nvjet", "gemm", "cutlass", "xmma", "cublas", "gemv")),
    ("memcpy / memset", ("memcpy", "memset")),
    ("NCCL / FSDP copies", ("nccl", "chunk_cat", "split_with_sizes", "foreach")),
    ("fused (compiled triton)", ("triton",)),
    ("reductions / softmax / norms", ("reduce", "softmax", "norm", "cat", "scatter", "gather", "argmax")),
)


def kernel_class(name: str) -> str:
    """Which share of the step a CUDA kernel counts towards."""
    lowered = name.lower()
    for label, keys in KERNEL_CLASSES:
        if any(key in lowered for key in keys):
            return label
    return "elementwise (aten)"


def profile_step(step: Any, device: Any, out: Path) -> dict[str, Any]:
    """GPU kernel time of one step by class, the top kernels written to ``out``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    kernels = []
    for event in prof.key_averages():
        if getattr(event, "device_type", None) != DeviceType.CUDA:
            continue  # CPU rows repeat their kernels' time: count kernels only
        self_us = getattr(event, "self_device_time_total", 0)
        if self_us > 0:
            kernels.append((event.key, self_us, event.count))
    kernels.sort(key=lambda k: -k[1])
    total = sum(k[1] for k in kernels) or 1
    shares: dict[str, dict[str, float]] = {}
    for name, self_us, _count in kernels:
        entry = shares.setdefault(kernel_class(name), {"ms": 0.0, "fraction": 0.0})
        entry["ms"] += self_us / 1e3
        entry["fraction"] += self_us / total
    shares = dict(sorted(shares.items(), key=lambda kv: -kv[1]["ms"]))
    lines = [f"GPU kernel time of one step: {total / 1e3:.1f} ms"]
    lines += [f"  {name:<30} {s['ms']:8.1f} ms {100 * s['fraction']:5.1f}%" for name, s in shares.items()]
    lines += ["top kernels:"] + [f"  {us / 1e3:8.2f} ms x{count:<4} {name[:140]}" for name, us, count in kernels[:40]]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return {"kernel_ms": total / 1e3, "shares": shares}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m tools.bench.anchor_specforge",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--anchors", help="folder with SpecForge's specforge/ package and kimi-k3-dspark.json")
    parser.add_argument("--variants", default="ours,specforge", help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--baseline-root", help="checkout whose code the 'baseline' variant runs")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on CPU, to prove the wiring")
    parser.add_argument("--tokens", type=int, help="override T (default: the recipe's max_length)")
    parser.add_argument("--repeats", type=int, default=5, help="timed micro-steps per variant (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed micro-steps after the compiling one")
    parser.add_argument("--profile", default="", help="comma list of variants to profile (one extra step each)")
    parser.add_argument("--profile-dir", default=".", help="where profile_<variant>.txt files go")
    parser.add_argument("--json", help="write every result here")
    parser.add_argument("--variant-timeout-s", type=float, default=900.0, help="limit per variant process")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.profile = [v for v in args.profile.split(",") if v]
    if args.worker:
        return worker(args)
    return parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
