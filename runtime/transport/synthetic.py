"""A synthetic producer and trainer that exercise the real data plane without a model.

Samples are pure functions of g (seeded generator), so a reader can check every byte it got.
The fault tests run these as real processes and kill them; an operator can run them between the
two nodes of an allocation to check the data plane before loading a target:

    python3 -m runtime.transport.synthetic produce --recipe RESOLVED
    python3 -m runtime.transport.synthetic train --recipe RESOLVED --state-dir DIR --steps 10

Endpoints come from the launcher's environment contract (DSPARK_MOONCAKE_MASTER, ...). The
trainer runs one rank per process with ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``
(gloo) and keeps a small checkpoint (``checkpoint.json``: step, cursor, and every g consumed by a
committed step, in order), written atomically, from which a killed trainer resumes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.files import atomic_write_text
from runtime.recipe.loader import load_resolved
from runtime.transport.errors import TransportError
from runtime.transport.settings import TransportSettings

log = logging.getLogger("dspark.transport.synthetic")

CHECKPOINT_FILE = "checkpoint.json"


def synthetic_num_tokens(g: int, min_tokens: int, max_tokens: int) -> int:
    """T of synthetic sample g (varies with g so that sizes differ between samples)."""
    return min_tokens + (g * 7919) % (max_tokens - min_tokens + 1)


@dataclass(frozen=True)
class SampleShape:
    """The capture shapes a synthetic sample has (``capture.vocab_size``, ``hidden_size``, aux layers)."""

    vocab_size: int
    hidden_size: int
    num_aux_layers: int


def synthetic_sample(g: int, shape: SampleShape, min_tokens: int = 16, max_tokens: int = 64) -> dict[str, torch.Tensor]:
    """The four tensor fields of synthetic sample ``g`` (deterministic in g)."""
    tokens = synthetic_num_tokens(g, min_tokens, max_tokens)
    gen = torch.Generator().manual_seed(1_000_003 * g + 17)
    hidden = shape.hidden_size
    return {
        "ids": torch.randint(0, shape.vocab_size, (tokens,), generator=gen, dtype=torch.int64),
        "mask": (torch.rand(tokens, generator=gen) > 0.3).to(torch.uint8),
        "hs": torch.randn(tokens, shape.num_aux_layers * hidden, generator=gen).to(torch.bfloat16),
        "lhs": torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16),
    }


def run_producer(args: argparse.Namespace) -> int:
    """Capture synthetic samples forever (or until ``--max-g``), like the capture component would."""
    from runtime.transport.dataplane import open_producer

    resolved = load_resolved(args.recipe)
    recipe = resolved.recipe
    transport = TransportSettings.from_recipe(recipe)
    settings = transport.producer
    shape = SampleShape(recipe.capture.vocab_size, recipe.capture.hidden_size, recipe.num_aux_layers)
    with open_producer(transport, resolved.job_dir) as producer:
        print(f"producer ready pid {os.getpid()}", flush=True)
        while True:
            batch = producer.wait_next(max_count=args.batch)
            for g in batch:
                if args.max_g is not None and g >= args.max_g:
                    producer.release(g)
                    time.sleep(settings.poll_interval_s)
                    continue
                tensors = synthetic_sample(g, shape, args.min_tokens, args.max_tokens)
                time.sleep(args.capture_delay_s)  # stands in for the target's forward pass
                meta = {
                    "epoch": 0,
                    "row_id": f"synthetic-{g}",
                    "T": int(tensors["ids"].shape[0]),
                    "engine": "synthetic",
                }
                try:
                    producer.commit(g, tensors, meta)
                except TransportError as exc:
                    log.warning("commit of g=%d failed (%s); it will be captured again", g, exc)
                    time.sleep(settings.poll_interval_s)


def _load_checkpoint(state_dir: Path) -> dict[str, Any]:
    path = state_dir / CHECKPOINT_FILE
    if path.exists():
        return json.loads(path.read_text())
    return {"step": 0, "cursor": 0, "consumed": [], "restarts": 0}


def run_trainer(args: argparse.Namespace) -> int:
    """One synthetic trainer rank: fetch this rank's g of each step, check the bytes, commit."""
    import torch.distributed as dist

    from runtime.transport.dataplane import open_consumer

    resolved = load_resolved(args.recipe)
    recipe = resolved.recipe
    shape = SampleShape(recipe.capture.vocab_size, recipe.capture.hidden_size, recipe.num_aux_layers)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", timeout=dt.timedelta(seconds=args.collective_timeout_s))
    state_dir = Path(args.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    state = _load_checkpoint(state_dir)
    consumer = open_consumer(TransportSettings.from_recipe(recipe), rank, world)
    if rank == 0:
        consumer.publish_cursor(state["cursor"])
    print(f"rank {rank} ready at step {state['step']} cursor {state['cursor']}", flush=True)
    start = time.monotonic()
    for step in range(state["step"], args.steps):
        got: list[int] = []
        for g in consumer.samples_of_step(step):
            sample = consumer.fetch(g)
            expected = synthetic_sample(g, shape, args.min_tokens, args.max_tokens)
            for name, tensor in sample.tensors().items():
                if not torch.equal(tensor, expected[name]):
                    raise AssertionError(f"rank {rank}: sample g={g} field {name} differs from what was captured")
            got.append(int(sample.meta["g"]))
        time.sleep(args.step_delay_s)  # stands in for forward/backward/optimizer
        if world > 1:
            gathered: list[list[int]] = [[] for _ in range(world)]
            dist.all_gather_object(gathered, got)
        else:
            gathered = [got]
        state["consumed"].extend(sorted(g for part in gathered for g in part))
        state["step"] = step + 1
        state["cursor"] = (step + 1) * consumer.settings.global_batch_size
        if rank == 0 and (state["step"] % args.checkpoint_every == 0 or state["step"] == args.steps):
            atomic_write_text(state_dir / CHECKPOINT_FILE, json.dumps(state) + "\n")
        if world > 1:
            dist.barrier()
        consumer.commit_step(step)
        if rank == 0:
            elapsed = time.monotonic() - start
            print(f"step {step + 1}/{args.steps} committed, cursor {state['cursor']}, {elapsed:.1f} s", flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    consumer.close()
    print(f"rank {rank} finished", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface."""
    parser = argparse.ArgumentParser(prog="python3 -m runtime.transport.synthetic", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("produce", "train"):
        p = sub.add_parser(name)
        p.add_argument("--recipe", required=True, help="resolved recipe JSON (the launcher writes it)")
        p.add_argument("--min-tokens", type=int, default=16)
        p.add_argument("--max-tokens", type=int, default=64)
    produce = sub.choices["produce"]
    produce.add_argument("--batch", type=int, default=1, help="samples claimed at once")
    produce.add_argument("--capture-delay-s", type=float, default=0.0)
    produce.add_argument("--max-g", type=int, default=None, help="capture nothing at or beyond this g")
    train = sub.choices["train"]
    train.add_argument("--state-dir", required=True)
    train.add_argument("--steps", type=int, required=True)
    train.add_argument("--checkpoint-every", type=int, default=1)
    train.add_argument("--step-delay-s", type=float, default=0.0)
    train.add_argument("--collective-timeout-s", type=float, default=600.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    return run_producer(args) if args.command == "produce" else run_trainer(args)


if __name__ == "__main__":
    sys.exit(main())
