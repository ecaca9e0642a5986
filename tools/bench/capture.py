"""Capture benchmark: the embedded engine vs a plain transformers forward of the same batches.

Both sides run the same right-padded batches through the same weights; each repeat times all
batches of one side, then all of the other (the order alternates between repeats, so a noisy
neighbour slows both alike), and the report gives tokens/s of each and their ratio:

- ``forward``: a plain forward of the base decoder (``AutoModel``: layers + final norm, no lm_head),
  the least any capture must run;
- ``capture``: :meth:`EmbeddedEngine.capture` over the same batches, then :meth:`EmbeddedEngine.flush`
  (the last commits count): the same forward through the engine plus everything it adds (hooks,
  concatenating aux layers, bf16 contract tensors, meta) and a sink that does what the producer's
  commit does before the network. ``--sink host`` (default): the engine's commit pipeline (pinned
  staging slots filled on a side stream, ``sum16`` checksums on the GPU, commits on a worker thread
  while the next forward runs; the sink CRC-32s the small CPU fields as the producer does);
  ``--sink host-sync``: the old path, each sample copied to pageable host memory and CRC-32'd
  before the next forward; ``--sink null`` skips all of it; ``--sink store`` commits into a real
  mooncake_master on loopback through the pipeline.

It also reports the share of the capture's time spent outside the forward. Target: overhead <= 10%.

Modes::

    python3 -m tools.bench.capture                      # CPU: the tiny target (.cache/tiny/target) or,
                                                       # without it, a random model of the same shape
    python3 -m tools.bench.capture --preset h200        # GPU: a random ~0.5B-parameter Qwen3-MoE, bf16
    python3 -m tools.bench.capture --quick              # seconds: proves the tool runs
    python3 -m tools.bench.capture --preset h200 --trace out/   # GPU: also list where the GPU idles
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.capture.embedded_settings import EmbeddedSettings
from runtime.capture.engine import CaptureRequest
from runtime.capture.engine_embedded import EmbeddedEngine

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_TARGET = REPO_ROOT / ".cache/tiny/target"
TRACED_BATCHES = 4
"""Batches of each side profiled by ``--trace``."""


@dataclass(frozen=True)
class Preset:
    """Model shape and batches of one benchmark mode."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    experts: int
    top_k: int
    expert_width: int
    vocab: int
    aux: tuple[int, ...]
    batch_size: int
    min_len: int
    max_len: int
    batches: int
    dtype: str
    device: str


PRESETS: dict[str, Preset] = {
    # The tiny recipe's target shape (hidden 256, 8 layers, 8 experts top-2, vocab 2048), its data lengths.
    "cpu": Preset(256, 8, 4, 2, 8, 2, 256, 2048, (1, 3, 5), 4, 16, 256, 24, "float32", "cpu"),
    # 480M parameters (168M active per token): hidden 1024, 12 layers, 16 experts top-4, vocab 32000.
    "h200": Preset(1024, 12, 16, 4, 16, 4, 704, 32000, (1, 5, 9), 4, 1024, 4096, 24, "bfloat16", "cuda"),
    "quick": Preset(64, 4, 4, 2, 4, 2, 32, 300, (0, 2), 2, 8, 32, 4, "float32", "cpu"),
}


def random_decoder(preset: Preset, device: str) -> torch.nn.Module:
    """A randomly initialised Qwen3-MoE base decoder of the preset's shape (speed only)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeModel

    config = Qwen3MoeConfig(
        vocab_size=preset.vocab,
        hidden_size=preset.hidden,
        intermediate_size=2 * preset.hidden,
        moe_intermediate_size=preset.expert_width,
        num_hidden_layers=preset.layers,
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.kv_heads,
        head_dim=preset.hidden // preset.heads,
        num_experts=preset.experts,
        num_experts_per_tok=preset.top_k,
        norm_topk_prob=True,
        max_position_embeddings=max(preset.max_len, 512),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeModel(config)
    return model.to(dtype=getattr(torch, preset.dtype)).eval()


class HostSink:
    """What the producer does with a sample before the network: host copy + checksums.

    With ``accepts_checksums`` (the pipelined path) the fields arrive in pinned host memory with
    their ``sum16`` checksums computed on the GPU, and only the fields without one (``ids``,
    ``mask``) are CRC-32'd here, as :meth:`runtime.transport.producer.Producer.commit` does.
    Without it (``host-sync``), every field is copied to host and CRC-32'd on one core.
    """

    def __init__(self, pipelined: bool) -> None:
        self.accepts_checksums = pipelined
        self.samples = 0

    def commit(
        self,
        g: int,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any],
        checksums: Mapping[str, tuple[int, ...]] | None = None,
    ) -> int:
        """Copy every field to host memory and checksum what has no checksum yet; returns the bytes."""
        total = 0
        for name, tensor in tensors.items():
            host = tensor.to("cpu", non_blocking=False).contiguous()
            if not checksums or name not in checksums:
                zlib.crc32(memoryview(host.reshape(-1).view(torch.uint8).numpy()))
            total += host.numel() * host.element_size()
        self.samples += 1
        return total


class NullSink:
    """Accepts a sample and does nothing (the engine's own cost only)."""

    def commit(self, g: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> int:
        """Nothing."""
        return 0


def make_batches(preset: Preset, vocab: int, seed: int = 0) -> list[list[CaptureRequest]]:
    """Batches of requests with lengths spread over [min_len, max_len] (as real data is)."""
    gen = torch.Generator().manual_seed(seed)
    batches, g = [], 0
    for _ in range(preset.batches):
        batch = []
        for _ in range(preset.batch_size):
            length = int(torch.randint(preset.min_len, preset.max_len + 1, (1,), generator=gen))
            ids = tuple(torch.randint(4, vocab, (length,), generator=gen).tolist())
            batch.append(
                CaptureRequest(g=g, epoch=0, row_index=g, row_id=f"b{g}", input_ids=ids, loss_mask=(1,) * length)
            )
            g += 1
        batches.append(batch)
    return batches


def synchronize(device: str) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: str) -> float:
    """Wall seconds of ``fn`` including its device work."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def run(
    preset: Preset,
    target: Path | None,
    sink_name: str,
    repeats: int,
    log: Callable[[str], None] = print,
    slots: int | None = None,
    trace_dir: Path | None = None,
) -> dict[str, float]:
    """Time both sides over all batches ``repeats`` times (alternating which goes first); returns
    the summary numbers. ``slots``: the engine's commit staging slots (default: one batch; 0 for
    ``host-sync`` and ``null``). ``trace_dir`` (GPU): profile one more pass of each side afterwards
    and write their GPU idle gaps there (:mod:`tools.bench.gpu_gaps`)."""
    device = "cuda:0" if preset.device == "cuda" else "cpu"
    if target is not None:
        from transformers import AutoModel

        baseline_model = AutoModel.from_pretrained(target, dtype=getattr(torch, preset.dtype)).to(device).eval()
        hidden = int(baseline_model.config.hidden_size)
        vocab = int(baseline_model.config.vocab_size)
        source = f"target {target.name}"
    else:
        baseline_model = random_decoder(preset, device)
        hidden, vocab = preset.hidden, preset.vocab
        source = "random weights"
    # Each side gets its own private copy of the weights (a checkpoint loads memory-mapped; a copy
    # does not), so neither starts with an advantage, and the engine's hooks stay off the baseline.
    loaded, baseline_model = baseline_model, copy.deepcopy(baseline_model)
    engine_model = copy.deepcopy(loaded)
    del loaded
    params = sum(p.numel() for p in baseline_model.parameters())
    if slots is None:
        slots = 0 if sink_name in ("host-sync", "null") else preset.batch_size
    settings = EmbeddedSettings(
        target_path=target or Path("random"),
        aux_layer_ids=preset.aux,
        hidden_size=hidden,
        pad_id=0,
        compute_dtype=preset.dtype,
        devices=(device,),
        batch_size=preset.batch_size,
        commit_staging_slots=slots,
        staging_slot_bytes=preset.max_len * (len(preset.aux) + 1) * hidden * 2 + 128,
    )
    sink = {"host": HostSink(pipelined=True), "host-sync": HostSink(pipelined=False), "null": NullSink()}.get(sink_name)
    store_context = None
    if sink_name == "store":
        sink, store_context = _store_sink(hidden, len(preset.aux), preset)
    engine = EmbeddedEngine(settings, sink, model_loader=lambda s, d: engine_model)
    engine.start()
    batches = make_batches(preset, vocab)
    replica = engine.replicas[0]
    tokens = sum(len(r.input_ids) for batch in batches for r in batch)
    log(
        f"capture bench: {source}, {params / 1e6:.1f}M parameters, {preset.dtype} on {device}, {len(batches)} batches "
        f"x {preset.batch_size} samples ({tokens} tokens, lengths {preset.min_len}..{preset.max_len}), aux {preset.aux}, "
        f"sink {sink_name}, {slots} commit staging slots, {repeats} repeats"
    )

    def forward(batch: list[CaptureRequest]) -> None:
        ids, mask = replica.pad([r.input_ids for r in batch])  # the engine's padding, mask only when padded
        with torch.no_grad():
            baseline_model(input_ids=ids, attention_mask=mask, use_cache=False)

    def forward_pass(some: list[list[CaptureRequest]]) -> None:
        for batch in some:
            forward(batch)

    def capture_pass(some: list[list[CaptureRequest]]) -> None:
        for batch in some:
            engine.capture(batch)
        engine.flush()  # the last batch's commits belong to this side's time

    def forward_all() -> None:
        forward_pass(batches)

    def capture_all() -> None:
        capture_pass(batches)

    try:
        # Warm-up, one whole pass of each side: every batch length is a new shape (kernel choice,
        # allocator growth), and the staging slots are pinned on first use.
        forward_all()
        capture_all()
        forward_s: list[float] = []
        capture_s: list[float] = []
        inside_s: list[float] = []
        started = time.monotonic()
        for repeat in range(repeats):
            f_total = c_total = inside = 0.0
            # Alternate which side goes first: the second finds warmer caches.
            for side in ("forward", "capture") if repeat % 2 == 0 else ("capture", "forward"):
                if side == "forward":
                    f_total += timed(forward_all, device)
                else:
                    before = engine.forward_seconds
                    c_total += timed(capture_all, device)
                    inside += engine.forward_seconds - before
            forward_s.append(f_total)
            capture_s.append(c_total)
            inside_s.append(inside)
            log(
                f"  repeat {repeat + 1}/{repeats}: forward {tokens / f_total:,.0f} tok/s, capture {tokens / c_total:,.0f} tok/s "
                f"({time.monotonic() - started:.0f} s)"
            )
        if trace_dir is not None and device.startswith("cuda"):
            from tools.bench.gpu_gaps import trace_gpu_gaps

            # A few batches: the profiler's post-processing of a whole pass (the MoE forward's many
            # small ops) takes minutes.
            traced = batches[:TRACED_BATCHES]
            trace_gpu_gaps(lambda: forward_pass(traced), device, trace_dir, "capture_bench_forward")
            trace_gpu_gaps(lambda: capture_pass(traced), device, trace_dir, f"capture_bench_capture_{sink_name}")
    finally:
        engine.close()
        if store_context is not None:
            store_context()
    f_med, c_med, in_med = statistics.median(forward_s), statistics.median(capture_s), statistics.median(inside_s)
    result = {
        "forward_tokens_per_s": tokens / f_med,
        "capture_tokens_per_s": tokens / c_med,
        # The ratio of each repeat (both sides timed side by side), then the median: robust to drift.
        "capture_over_forward": statistics.median(c / f for c, f in zip(capture_s, forward_s, strict=True)),
        "outside_forward_share": max(c_med - in_med, 0.0) / c_med,
    }
    overhead = (result["capture_over_forward"] - 1) * 100
    log(f"forward  (baseline, plain transformers): {result['forward_tokens_per_s']:,.0f} tokens/s")
    log(f"capture  (embedded engine, sink {sink_name}): {result['capture_tokens_per_s']:,.0f} tokens/s")
    log(
        f"ratio capture time / forward time: {result['capture_over_forward']:.3f} (overhead {overhead:+.1f}%, target <= +10%: "
        f"{'met' if overhead <= 10 else 'NOT met'})"
    )
    log(f"share of capture time outside the forward: {result['outside_forward_share'] * 100:.1f}%")
    return result


def _store_sink(hidden: int, n_aux: int, preset: Preset) -> tuple[Any, Callable[[], None]]:
    """A producer committing into a real mooncake_master on 127.0.0.1 (window large enough for the run)."""
    import tempfile

    from runtime.transport.dataplane import open_producer
    from runtime.transport.loopback import free_port, loopback_endpoints, loopback_master, loopback_recipe, transport_of

    total = preset.batches * preset.batch_size * 64
    job = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    resolved = loopback_recipe(
        job,
        (free_port(), free_port(), free_port()),
        [
            f"capture.hidden_size={hidden}",
            f"trainer.draft.hidden_size={hidden}",
            f"capture.aux_layer_ids={list(preset.aux)}",
            f"capture.num_target_layers={preset.layers}",
            f"data.max_length={preset.max_len}",
            "trainer.draft.max_position_embeddings=65536",
            "transport.global_segment_bytes=8GiB",
            "transport.store_cap_bytes=7GiB",
            "transport.high_watermark_bytes=6GiB",
            "transport.low_watermark_bytes=5GiB",
            f"transport.high_watermark_samples={total}",
            f"transport.low_watermark_samples={total}",
        ],
    )
    context = loopback_master(resolved)
    context.__enter__()
    producer = open_producer(transport_of(resolved), resolved.job_dir, endpoints=loopback_endpoints(resolved))
    producer.next_batch(total)  # claim every g the run will write

    def close() -> None:
        producer.close()
        context.__exit__(None, None, None)

    return producer, close


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog="python3 -m tools.bench.capture", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--quick", action="store_true", help="same as --preset quick --repeats 1")
    parser.add_argument("--target", type=Path, help="HF checkpoint to benchmark (cpu preset default: the tiny target)")
    parser.add_argument(
        "--random", action="store_true", help="random weights of the preset's shape, even if a target exists"
    )
    parser.add_argument("--sink", choices=("host", "host-sync", "null", "store"), default="host")
    parser.add_argument("--slots", type=int, help="commit staging slots (default: one batch; 0 for host-sync/null)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, help="override the preset's batch count")
    parser.add_argument("--batch-size", type=int, help="override the preset's samples per batch")
    parser.add_argument(
        "--trace", type=Path, metavar="DIR", help="GPU only: profile one more pass of each side; idle gaps go to DIR"
    )
    args = parser.parse_args(argv)
    preset_name = "quick" if args.quick else args.preset
    preset = PRESETS[preset_name]
    if args.batches or args.batch_size:
        import dataclasses

        preset = dataclasses.replace(
            preset, batches=args.batches or preset.batches, batch_size=args.batch_size or preset.batch_size
        )
    if preset.device == "cuda" and not torch.cuda.is_available():
        print(f"capture bench: preset {preset_name} needs a CUDA GPU; none is visible here (skipped)")
        return 0
    target = args.target
    if target is None and preset_name == "cpu" and not args.random and (TINY_TARGET / "config.json").is_file():
        target = TINY_TARGET
    torch.set_grad_enabled(False)
    run(preset, target, args.sink, 1 if args.quick else args.repeats, slots=args.slots, trace_dir=args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
