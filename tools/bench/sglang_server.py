"""The real patched SGLang server on the CPU vs the embedded engine, same prompts, same run.

Starts a ``mooncake_master`` on loopback and the patched SGLang 0.5.23 server from the capture venv
(``tools/bootstrap_sglang``) exactly as the capture component does
(:func:`runtime.capture.sglang_cpu.serve_on_cpu`), then captures the same prompts with both engines,
interleaved prompt by prompt so a noisy neighbour slows both alike:

- ``server``: :meth:`SGLangEngine.capture`: HTTP request, the server's prefill, the capture sink's
  commit into Mooncake, the receipt;
- ``embedded`` (baseline): :meth:`EmbeddedEngine.capture` on the same weights in this process, into
  an in-memory sink (no store: the baseline is the forward itself).

Reports the server's start time (launch to healthy), tokens/s of each and server/embedded, and how
the captured ``hs``/``lhs`` agree (the fraction of bit-identical bf16 elements and the worst
difference in bf16 steps).

Examples::

    python3 -m tools.bench.sglang_server                   # tiny target (.cache/tiny/target), 16 prompts of 256 tokens
    python3 -m tools.bench.sglang_server --target DIR --prompts 4 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from runtime.capture.engine import CaptureRequest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Recorder:
    def __init__(self) -> None:
        self.samples: dict[int, dict[str, torch.Tensor]] = {}

    def commit(self, g: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> int:
        self.samples[g] = {name: t.detach().clone() for name, t in tensors.items()}
        return 0


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the report (``--json`` also writes it)."""
    parser = argparse.ArgumentParser(prog="python3 -m tools.bench.sglang_server", description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, default=REPO / ".cache" / "tiny" / "target")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from runtime.capture.engine_embedded import EmbeddedEngine
    from runtime.capture.setup import embedded_settings
    from runtime.capture.sglang_cpu import capture_venv_ready, serve_on_cpu
    from runtime.transport.dataplane import open_consumer
    from runtime.transport.loopback import transport_of

    if not capture_venv_ready(REPO):
        raise SystemExit("the capture venv is not built: run tools/bootstrap_sglang")
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        ports = (_free_port(), _free_port(), _free_port())
        overrides = [f"capture.target_path={args.target}", "transport.store_id=bench"]
        with serve_on_cpu(Path(tmp), ports, _free_port(), overrides) as server:
            recipe = server.resolved.recipe
            print(f"server healthy after {server.start_s:.1f} s", flush=True)
            gen = torch.Generator().manual_seed(0)
            requests = []
            for _ in range(args.prompts):
                g = server.producer.next_to_capture()
                ids = torch.randint(4, recipe.capture.vocab_size, (args.tokens,), generator=gen).tolist()
                requests.append(CaptureRequest(g, 0, g, f"bench-{g}", tuple(ids), (1,) * args.tokens))
            recorder = _Recorder()
            embedded = EmbeddedEngine(embedded_settings(server.resolved), recorder)
            embedded.start()
            server.engine.capture(requests[:1])  # first request warms both up (lazy init)
            embedded.capture(requests[:1])
            server_s = embedded_s = 0.0
            for request in requests[1:]:
                started = time.perf_counter()
                server.engine.capture([request])
                server_s += time.perf_counter() - started
                started = time.perf_counter()
                embedded.capture([request])
                embedded_s += time.perf_counter() - started
            tokens = args.tokens * (len(requests) - 1)
            identical = total = 0
            worst_steps = 0.0
            with open_consumer(
                transport_of(server.resolved), 0, recipe.trainer_world_size, endpoints=server.endpoints
            ) as consumer:
                for request in requests:
                    got = consumer.fetch(request.g)
                    for name in ("hs", "lhs"):
                        a, b = getattr(got, name).float(), recorder.samples[request.g][name].float()
                        step = 2.0**-8 * torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)
                        worst_steps = max(worst_steps, float(((a - b).abs() / step).max()))
                        identical += int((a == b).sum())
                        total += a.numel()
    report = {
        "server_start_s": round(server.start_s, 1),
        "prompts_timed": len(requests) - 1,
        "tokens_per_prompt": args.tokens,
        "server_tokens_per_s": round(tokens / server_s, 1),
        "embedded_tokens_per_s": round(tokens / embedded_s, 1),
        "server_over_embedded": round(embedded_s / server_s, 3),
        "bit_identical_fraction": round(identical / total, 5),
        "worst_difference_bf16_steps": round(worst_steps, 2),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
