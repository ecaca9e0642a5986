"""Expert-parallel capture benchmark: the embedded engine with EP = GPU count vs EP = 1 on one GPU.

A randomly initialised Qwen3-MoE whose routed experts hold almost all of its weights runs through
:class:`~runtime.capture.engine_embedded.EmbeddedEngine` in these configurations, on the same
requests (each replica always gets the same padded chunks, so forward shapes match):

- ``hf1``: one GPU, the plain Hugging Face model (what ``capture.expert_parallel: 1`` runs);
- ``ep1``: one GPU, the runtime/moe expert-parallel layer with a 1-rank exchange: same expert
  kernels and exchange bookkeeping as EP = N, no peer: the baseline for the exchange's cost;
- ``epN``: N GPUs, ``capture.expert_parallel: N`` (:class:`runtime.capture.model_loading.ExpertParallelLoader`,
  replicas as threads exchanging tokens through :mod:`runtime.moe.exchange_threads`);
- ``dpN`` (``--configs``): N GPUs, N whole replicas (data parallel), when the model fits one GPU.

For every configuration: capture tokens/s (a timed pass, no instrumentation), then a second pass
with timers around the exchange's calls (device synchronised before and after each, results
unchanged: the bench checks the features are bitwise equal) giving each replica's share of wall
time in the MoE exchange (dispatch + combine), split into the rendezvous (the device-to-device
copies and the wait for the peer) and the local work (planning, permutation, weighted sums); also
the expert GEMMs' share. Ratios are against ``hf1`` timed in the same run.

Examples::

    python3 -m tools.bench.capture_ep                    # GPU: every visible GPU; about 2-3 minutes on 2 x H200
    python3 -m tools.bench.capture_ep --configs hf1,ep1,ep2,dp2 --json ep.json
    python3 -m tools.bench.capture_ep --quick            # CPU: EP = 2 over two CPU replicas, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from runtime.capture.embedded_settings import EmbeddedSettings
from runtime.capture.engine import CaptureRequest
from runtime.capture.engine_embedded import EmbeddedEngine
from runtime.capture.model_loading import ExpertParallelLoader
from runtime.files import atomic_write_text
from tools.bench.capture import NullSink, Preset, make_batches, random_decoder, synchronize

JSON_FORMAT = "dspark-bench-capture-ep/1"
GIB = 2**30

PRESETS: dict[str, Preset] = {
    # 29.3B parameters, 99% of them routed experts (24 layers x 256 experts x 3 x 2048 x 768), 58.6 GB
    # in bf16: fits one H200 for the EP = 1 baseline; at EP = 2 each GPU keeps half the experts.
    # Top-8 of 256, 1.4B active parameters per token; 32 requests of 1,024..4,096 tokens.
    "h200": Preset(2048, 24, 16, 4, 256, 8, 768, 32000, (1, 11, 21), 4, 1024, 4096, 8, "bfloat16", "cuda"),
    "quick": Preset(64, 4, 4, 2, 8, 2, 32, 300, (0, 2), 2, 8, 32, 4, "float32", "cpu"),
}
RENDEZVOUS_TIMEOUT_S = 120.0
"""A replica that fails outside its MoE layers leaves the others waiting at the next exchange
(the engine does not abort the rendezvous for it): give up after two minutes, not the default ten."""
TIMED_METHODS = ("run", "dispatch", "combine", "_all_to_all", "exchange_counts")
"""Exchange methods the timers wrap (run contains dispatch, the experts and combine; dispatch and
combine contain the rendezvous calls _all_to_all and exchange_counts)."""


def build_random_model(preset: Preset, device: str) -> torch.nn.Module:
    """The preset's random Qwen3-MoE base decoder, created directly in its dtype on ``device`` (an
    fp32 build first would need twice the memory of the bf16 model)."""
    dtype = getattr(torch, preset.dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return random_decoder(preset, device)
    finally:
        torch.set_default_dtype(previous)


def parameter_counts(preset: Preset) -> tuple[int, int]:
    """(all parameters, routed-expert parameters) of the preset's model."""
    experts = preset.layers * preset.experts * 3 * preset.hidden * preset.expert_width
    head_dim = preset.hidden // preset.heads
    attention = preset.hidden * head_dim * (2 * preset.heads + 2 * preset.kv_heads) + 2 * head_dim
    per_layer_other = attention + preset.experts * preset.hidden + 2 * preset.hidden
    return experts + preset.layers * per_layer_other + preset.vocab * preset.hidden + preset.hidden, experts


# ----------------------------------------------------------------------------------------------
# timers around the exchange
# ----------------------------------------------------------------------------------------------


class ExchangeTimers:
    """Wall seconds one replica spends in each wrapped method of its exchange, the device
    synchronised before and after each call so queued kernels count where they run. Wrapping sets
    instance attributes over the class's methods; :meth:`remove` deletes them again."""

    def __init__(self, exchange: Any, device: str) -> None:
        self.exchange = exchange
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        for name in TIMED_METHODS:
            setattr(exchange, name, self._wrap(name, getattr(exchange, name)))

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            synchronize(self.device)
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                synchronize(self.device)
                self.seconds[name] += time.perf_counter() - started

        return timed_call

    def remove(self) -> None:
        """Put the class's own methods back."""
        for name in TIMED_METHODS:
            self.exchange.__dict__.pop(name, None)

    def breakdown(self, wall_s: float) -> dict[str, float]:
        """Shares of ``wall_s``: the exchange (dispatch + combine), its rendezvous and local parts,
        and the expert GEMMs (run minus dispatch and combine)."""
        exchange = self.seconds["dispatch"] + self.seconds["combine"]
        rendezvous = self.seconds["_all_to_all"] + self.seconds["exchange_counts"]
        return {
            "exchange_s": exchange,
            "exchange_share": exchange / wall_s,
            "rendezvous_share": rendezvous / wall_s,
            "local_share": (exchange - rendezvous) / wall_s,
            "experts_share": (self.seconds["run"] - exchange) / wall_s,
        }


# ----------------------------------------------------------------------------------------------
# one configuration
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """One engine layout to measure."""

    name: str
    devices: tuple[str, ...]
    expert_parallel: int
    """0: the plain Hugging Face model on every replica (no runtime/moe layer)."""


def configs_for(names: Sequence[str], device_kind: str, gpus: int, ep: int) -> list[Config]:
    """The named configurations on this machine (``epN``/``dpN`` with N = ``ep``)."""

    def devices(count: int) -> tuple[str, ...]:
        return tuple("cpu" for _ in range(count)) if device_kind == "cpu" else tuple(f"cuda:{i}" for i in range(count))

    known = {
        "hf1": Config("hf1", devices(1), 0),
        "ep1": Config("ep1", devices(1), 1),
        f"ep{ep}": Config(f"ep{ep}", devices(ep), ep),
        f"dp{ep}": Config(f"dp{ep}", devices(ep), 0),
    }
    out = []
    for name in names:
        if name not in known:
            raise SystemExit(
                f"--configs: unknown configuration {name!r}; known here: {', '.join(known)} (N = --ep {ep})"
            )
        if device_kind == "cuda" and len(known[name].devices) > gpus:
            raise SystemExit(
                f"--configs {name} needs {len(known[name].devices)} GPUs but {gpus} are visible; fix: --ep {gpus}"
            )
        out.append(known[name])
    return out


def request_calls(requests: list[CaptureRequest], per_call: int) -> list[list[CaptureRequest]]:
    """``requests`` in capture calls of ``per_call`` (replicas x batch_size): replica i of every
    configuration then runs the same contiguous chunks."""
    return [requests[i : i + per_call] for i in range(0, len(requests), per_call)]


def resident_bytes(engine: EmbeddedEngine) -> list[int]:
    """Bytes of parameters and buffers per replica (the sharded experts are buffers)."""
    return [
        sum(t.numel() * t.element_size() for t in [*r.base.parameters(), *r.base.buffers()]) for r in engine.replicas
    ]


def first_call_features(engine: EmbeddedEngine, call: list[CaptureRequest]) -> list[torch.Tensor]:
    """``lhs`` of every sample of ``call`` on the host (for equality checks)."""
    return [f.lhs.float().cpu() for f in engine.features(call)]


def timed_pass(
    engine: EmbeddedEngine, calls: list[list[CaptureRequest]], name: str, label: str, log: Callable[[str], None]
) -> float:
    """Wall seconds of capturing every call once (devices synchronised around each call)."""
    cuda_devices = sorted({d for d in engine.settings.devices if d.startswith("cuda")})
    wall = 0.0
    done = 0
    for index, call in enumerate(calls):
        for device in cuda_devices:
            synchronize(device)
        t0 = time.perf_counter()
        engine.capture(call)
        for device in cuda_devices:
            synchronize(device)
        wall += time.perf_counter() - t0
        done += sum(len(r.input_ids) for r in call)
        if index == 0 or index + 1 == len(calls) or (index + 1) % 4 == 0:
            log(
                f"[{name}]   {label}: call {index + 1}/{len(calls)}, {done / wall:,.0f} tokens/s, "
                f"ETA {wall / (index + 1) * (len(calls) - index - 1):.0f} s"
            )
    return wall


def measure(
    config: Config, preset: Preset, requests: list[CaptureRequest], log: Callable[[str], None]
) -> dict[str, Any]:
    """Load, warm up, time a plain pass and an instrumented pass; returns the numbers."""
    cuda_devices = sorted({d for d in config.devices if d.startswith("cuda")})
    gc.collect()
    for device in cuda_devices:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    settings = EmbeddedSettings(
        target_path=Path("random"),
        aux_layer_ids=preset.aux,
        hidden_size=preset.hidden,
        pad_id=0,
        compute_dtype=preset.dtype,
        devices=config.devices,
        batch_size=preset.batch_size,
        expert_parallel=max(config.expert_parallel, 1),
    )

    def build(_settings: EmbeddedSettings, device: str) -> torch.nn.Module:
        return build_random_model(preset, device)

    loader: Any = build
    if config.expert_parallel:
        loader = ExpertParallelLoader(
            config.expert_parallel, len(config.devices), base_loader=build, rendezvous_timeout_s=RENDEZVOUS_TIMEOUT_S
        )
    started = time.monotonic()
    engine = EmbeddedEngine(settings, NullSink(), model_loader=loader)
    try:
        engine.start()
        load_s = time.monotonic() - started
        resident = resident_bytes(engine)
        # The load peaks higher than the run (expert sharding clones experts before the
        # originals go): record it, then measure the run's own peak.
        load_peak = {d: torch.cuda.max_memory_allocated(d) / GIB for d in cuda_devices}
        for device in cuda_devices:
            torch.cuda.reset_peak_memory_stats(device)
        calls = request_calls(requests, engine.max_batch)
        tokens = sum(len(r.input_ids) for r in requests)
        log(
            f"[{config.name}] {len(config.devices)} replica(s) on {','.join(config.devices)}, EP {config.expert_parallel or 1}"
            f"{' (plain HF model)' if not config.expert_parallel else ''}: loaded in {load_s:.1f} s, "
            f"{max(resident) / GIB:.2f} GiB resident per replica; {len(calls)} calls of up to {engine.max_batch} samples"
        )
        engine.capture(calls[0])  # warm-up: kernels, allocator, routing buffers
        reference = first_call_features(engine, calls[0])

        wall_s = timed_pass(engine, calls, config.name, "timed pass", log)
        result: dict[str, Any] = {
            "config": config.name,
            "devices": list(config.devices),
            "replicas": len(config.devices),
            "expert_parallel": config.expert_parallel or 1,
            "plain_hf_model": not config.expert_parallel,
            "load_s": load_s,
            "resident_gib_per_replica": [b / GIB for b in resident],
            "tokens": tokens,
            "wall_s": wall_s,
            "tokens_per_s": tokens / wall_s,
            "tokens_per_s_per_device": tokens / wall_s / len(config.devices),
        }
        if config.expert_parallel:
            models = loader.models
            timers = [ExchangeTimers(m.exchange, d) for m, d in zip(models, config.devices, strict=True)]
            try:
                instrumented_s = timed_pass(engine, calls, config.name, "instrumented pass", log)
                shares = [t.breakdown(instrumented_s) for t in timers]  # before the check's forward adds to them
                features = first_call_features(engine, calls[0])
            finally:
                for timer in timers:
                    timer.remove()
            result.update(
                instrumented_wall_s=instrumented_s,
                instrumentation_overhead=instrumented_s / wall_s - 1,
                instrumented_features_identical=all(
                    torch.equal(a, b) for a, b in zip(reference, features, strict=True)
                ),
                per_replica=shares,
                exchange_share=statistics.mean(s["exchange_share"] for s in shares),
                exchange_share_max=max(s["exchange_share"] for s in shares),
                rendezvous_share=statistics.mean(s["rendezvous_share"] for s in shares),
                local_share=statistics.mean(s["local_share"] for s in shares),
                experts_share=statistics.mean(s["experts_share"] for s in shares),
                experts_per_replica=models[0].experts_per_rank,
            )
        result["peak_gib_per_device"] = {d: torch.cuda.max_memory_allocated(d) / GIB for d in cuda_devices}
        result["load_peak_gib_per_device"] = load_peak
        result["reference_lhs"] = reference
        return result
    finally:
        engine.close()
        del engine, loader
        gc.collect()


def relative_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max |a - b| / max |b| over the samples both lists hold (a call of N replicas holds N times
    the samples of a 1-replica call; its first replica's chunk is the 1-replica call)."""
    common = min(len(a), len(b))
    diff = max(float((x - y).abs().max()) for x, y in zip(a[:common], b[:common], strict=True))
    scale = max(float(y.abs().max()) for y in b[:common])
    return diff / max(scale, 1e-30)


def report(everything: list[dict[str, Any]], log: Callable[[str], None]) -> None:
    """The comparison table (ratios against the first configuration that ran), then the failures."""
    results = [r for r in everything if "error" not in r]
    failed = [r for r in everything if "error" in r]
    if not results:
        for r in failed:
            log(f"[{r['config']}] FAILED: {r['error']}")
        return
    base = results[0]
    log(
        f"{'config':>6} {'devices':>7} {'EP':>3} {'tokens/s':>10} {'tok/s/dev':>10} {'vs ' + base['config']:>7} "
        f"{'exchange':>8} {'(max)':>6} {'rendezv.':>8} {'local':>6} {'experts':>7} {'peak GiB':>9}"
    )

    def share(r: dict[str, Any], key: str) -> str:
        return f"{100 * r[key]:.1f}%" if key in r else "-"

    for r in results:
        peaks = list(r["peak_gib_per_device"].values())
        log(
            f"{r['config']:>6} {r['replicas']:>7} {r['expert_parallel']:>3} {r['tokens_per_s']:>10,.0f} "
            f"{r['tokens_per_s_per_device']:>10,.0f} {r['tokens_per_s'] / base['tokens_per_s']:>7.2f} "
            f"{share(r, 'exchange_share'):>8} {share(r, 'exchange_share_max'):>6} {share(r, 'rendezvous_share'):>8} "
            f"{share(r, 'local_share'):>6} {share(r, 'experts_share'):>7} {(f'{max(peaks):.1f}' if peaks else 'n/a'):>9}"
        )
    log(
        "peak GiB = the largest peak allocated on one device while capturing (after loading; the load peak is in the JSON)"
    )
    log(
        "exchange = dispatch + combine per replica / wall (mean over replicas; max shown); rendezvous = device-to-device "
        "copies + waiting for the peer; local = planning, permutation, weighted sums; experts = grouped GEMMs"
    )
    for r in results:
        if "instrumented_features_identical" in r:
            log(
                f"[{r['config']}] instrumented pass: {100 * r['instrumentation_overhead']:+.1f}% wall time, features "
                f"{'bitwise identical' if r['instrumented_features_identical'] else 'DIFFERENT'} to the plain pass"
            )
        if r is not base:
            log(
                f"[{r['config']}] lhs of the first call vs {base['config']}: max |diff| / max |{base['config']}| = "
                f"{r['lhs_rel_diff_vs_base']:.2e}"
            )
    for r in failed:
        log(f"[{r['config']}] FAILED: {r['error']}")


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog="python3 -m tools.bench.capture_ep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    parser.add_argument("--quick", action="store_true", help="the quick preset on CPU: EP = 2 over two CPU replicas")
    parser.add_argument("--ep", type=int, help="N of epN/dpN (default: the GPU count; 2 with --quick)")
    parser.add_argument("--configs", help="comma-separated, first is the baseline (default hf1,ep1,epN)")
    parser.add_argument(
        "--batches", type=int, help="override the preset's batch count (requests = batches x batch size)"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    preset = PRESETS["quick" if args.quick else args.preset]
    if args.batches:
        preset = dataclasses.replace(preset, batches=args.batches)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if preset.device == "cuda" and gpus == 0:
        print("capture_ep bench: the GPU preset needs CUDA; none is visible here (skipped). Use --quick on CPU.")
        return 0
    ep = args.ep or (2 if preset.device == "cpu" else gpus)
    names = (args.configs or f"hf1,ep1,ep{ep}").split(",")
    configs = configs_for(names, preset.device, gpus, ep)
    total, experts = parameter_counts(preset)
    if preset.hidden // preset.heads * preset.heads != preset.hidden or preset.experts % ep:
        raise SystemExit(
            f"preset: {preset.experts} experts must split over EP {ep} and heads must divide the hidden size"
        )

    def log(line: str) -> None:
        print(line, flush=True)

    device_name = torch.cuda.get_device_name(0) if preset.device == "cuda" else platform.processor() or "CPU"
    requests = [r for batch in make_batches(preset, preset.vocab) for r in batch]
    log(
        f"capture_ep bench: {device_name} x {gpus or 1}, torch {torch.__version__}; random Qwen3-MoE {total / 1e9:.2f}B parameters "
        f"({100 * experts / total:.1f}% routed experts: {preset.layers} layers x {preset.experts} experts, top-{preset.top_k}, "
        f"hidden {preset.hidden}, width {preset.expert_width}), {preset.dtype}; {len(requests)} requests "
        f"({sum(len(r.input_ids) for r in requests):,} tokens, {preset.min_len}..{preset.max_len}), "
        f"{preset.batch_size} per replica forward; configs {', '.join(c.name for c in configs)}"
    )
    torch.set_grad_enabled(False)
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    for config in configs:
        try:
            results.append(measure(config, preset, requests, log))
        except Exception as exc:  # one configuration failing (say out of memory) must not lose the others
            traceback.print_exc()
            results.append({"config": config.name, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500]})
            log(f"[{config.name}] FAILED ({time.monotonic() - started:.0f} s since start): {results[-1]['error']}")
            continue
        log(
            f"[{config.name}] done: {results[-1]['tokens_per_s']:,.0f} tokens/s ({time.monotonic() - started:.0f} s since start)"
        )
    ran = [r for r in results if "error" not in r]
    for r in ran:
        r["lhs_rel_diff_vs_base"] = relative_difference(r["reference_lhs"], ran[0]["reference_lhs"])
    for r in ran:
        del r["reference_lhs"]
    report(results, log)
    if args.json:
        payload = {
            "format": JSON_FORMAT,
            "device": device_name,
            "gpus": gpus,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "preset": dataclasses.asdict(preset),
            "parameters": total,
            "expert_parameters": experts,
            "requests": len(requests),
            "results": results,
            "wall_s": time.monotonic() - started,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.json, json.dumps(payload, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
