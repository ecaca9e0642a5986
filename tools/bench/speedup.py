"""Speculative decoding against the target alone: acceptance, tokens/s of each and their ratio.

Two forms:

- ``--job JOB``: a trained run's draft (its newest checkpoint, or ``--checkpoint``) against its target on
  the run's held-out eval prompts, with the evaluation's own decoders (the KV-cached target, the block
  proposer). For each temperature every prompt is decoded by the target alone and with the draft,
  alternately (plain, speculative, plain, ...), so the two rates share the machine's state; greedy
  outputs must be identical. It prints the acceptance length, both tokens/s and the speed-up, and the
  untrained draft's figures beside them (the floor).
- ``--synthetic``: the cost side on an accelerator. A randomly initialised Qwen3-MoE target of the
  given size (large enough that a GPU is not launch-bound) and a draft of the recipe's shape: the time
  of one plain decode step, of one verify forward over ``block + 1`` tokens and of one block proposal,
  timed in the same run. Random weights accept nothing, so it prints the speed-up this cost structure
  gives at a range of acceptance lengths, and the acceptance length where it breaks even.

Examples::

    python3 -m tools.bench.speedup --job latest                       # the tiny run, CPU
    python3 -m tools.bench.speedup --synthetic --device cuda          # on a GPU
    python3 -m tools.bench.speedup --synthetic --quick                 # tiny shapes on the CPU: proves it runs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.shared.acceptance_length import POOLED_KEY, acceptance_lengths
from runtime.user_errors import exit_without_package, run_command

try:  # a stock python3 instead of the venv's: one line, not a traceback
    import torch
except ModuleNotFoundError as _missing:
    exit_without_package(_missing, "tools.bench.speedup")

REPO_ROOT = Path(__file__).resolve().parents[2]


def _decoders(job_dir: Path, checkpoint: str, device: str) -> tuple[Any, dict[str, Any], list[Any], set[int], Any]:
    """The job's target decoder, its drafts (the chosen checkpoint and the untrained floor), the first
    eval set's prompts, the stop ids and the eval settings."""
    from runtime.evaluate.draft import build_draft
    from runtime.evaluate.eval_sets import load_prompts
    from runtime.evaluate.runner import load_tokenizer, target_vocab
    from runtime.evaluate.setup import eval_setup
    from runtime.evaluate.target import TargetDecoder, load_causal_lm
    from runtime.recipe import load_resolved
    from runtime.shared.checkpoint_folders import UNTRAINED, DraftSource, resolve_draft_source

    resolved = load_resolved(job_dir / "recipe.resolved.json")
    if resolved.recipe.eval is None:
        raise SystemExit(f"error: {resolved.path} has no eval: section; the benchmark decodes its eval prompts")
    setup = eval_setup(resolved, resolved.recipe.eval)
    dtype = getattr(torch, setup.target.compute_dtype)
    target = TargetDecoder(load_causal_lm(setup.target.path, dtype, device), setup.target.aux_layer_ids)
    embed, lm_head = target_vocab(setup.target, dtype, device)
    drafts = {}
    for source in (
        resolve_draft_source(checkpoint, setup.checkpoint_dir),
        DraftSource(UNTRAINED, None, UNTRAINED, 0),
    ):
        model = build_draft(source, setup.draft, seed=setup.eval.seed, device=device, dtype=dtype)
        model.attach_frozen_vocab(embed, lm_head)
        drafts[source.label] = model
    prompts = load_prompts(setup.eval.sets[0], load_tokenizer(setup.target.path), setup.target.vocab_size)
    return target, drafts, prompts, set(setup.eval.stop_ids), setup.eval


def bench_job(
    job_dir: Path, checkpoint: str, device: str, temperatures: list[float], max_prompts: int | None
) -> dict[str, Any]:
    """Acceptance and tokens/s of each draft against the target alone, interleaved per prompt."""
    from runtime.evaluate.decoder import plain_generate, speculative_generate
    from runtime.evaluate.draft import DraftProposer

    if device == "cpu":
        torch.set_num_threads(1)  # one sequence: a chain of small operations (what the evaluation does)
    target, drafts, prompts, stop_ids, settings = _decoders(job_dir, checkpoint, device)
    prompts = prompts[:max_prompts] if max_prompts else prompts
    out: dict[str, Any] = {"job": str(job_dir), "device": device, "prompts": len(prompts), "passes": []}
    for temperature in temperatures:
        common = {"max_new_tokens": settings.max_new_tokens, "temperature": temperature, "stop_ids": stop_ids}
        row: dict[str, Any] = {"temperature": temperature, "drafts": {}}
        for label, model in drafts.items():
            proposer = DraftProposer(model)
            plain_s = spec_s = 0.0
            plain_tokens = spec_tokens = 0
            decodes: list[tuple[int, int]] = []  # (committed tokens, verify steps) of each speculative decode
            same = 0
            for index, prompt in enumerate(prompts):
                seed = settings.seed + index
                plain = plain_generate(
                    target, prompt.prompt_id, prompt.input_ids, generator=torch.Generator().manual_seed(seed), **common
                )
                spec = speculative_generate(
                    target,
                    proposer,
                    prompt.prompt_id,
                    prompt.input_ids,
                    generator=torch.Generator().manual_seed(seed),
                    **common,
                )
                plain_s += plain.seconds
                spec_s += spec.seconds
                plain_tokens += len(plain.output_ids)
                spec_tokens += len(spec.output_ids)
                decodes.append((len(spec.output_ids), len(spec.steps)))
                same += plain.output_ids == spec.output_ids
            row["drafts"][label] = {
                **acceptance_lengths(decodes),
                "tokens_per_s": spec_tokens / spec_s,
                "plain_tokens_per_s": plain_tokens / plain_s,
                "speedup": (spec_tokens / spec_s) / (plain_tokens / plain_s),
                "identical_outputs": same if temperature == 0 else None,
            }
        out["passes"].append(row)
    return out


def _timed_together(fns: dict[str, Callable[[], Any]], device: str, repeats: int) -> dict[str, float]:
    """Median seconds of each function, timed in turns (one of each per round, so that the machine's
    drift and any late warm-up land on all of them alike), after five warm-up rounds."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_index in range(5 + repeats):
        for name, fn in fns.items():
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            if round_index >= 5:
                times[name].append(time.perf_counter() - started)
    return {name: sorted(values)[len(values) // 2] for name, values in times.items()}


def bench_synthetic(device: str, quick: bool, repeats: int) -> dict[str, Any]:
    """Costs of a plain decode step, a verify forward and a block proposal on a random target."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from runtime.evaluate.draft import DraftProposer
    from runtime.evaluate.target import TargetDecoder
    from runtime.recipe import load_recipe
    from runtime.trainer.model import DSparkDraft

    recipe = load_recipe(REPO_ROOT / "recipes" / "tiny.yaml").recipe
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if quick:
        hidden, layers, experts, moe, heads, vocab, context = 256, 4, 8, 64, 4, 2048, 64
    else:  # about 4 B parameters (0.6 B active): a GPU is busy with its matmuls, not waiting on launches
        hidden, layers, experts, moe, heads, vocab, context = 2048, 24, 64, 768, 16, 32768, 1024
    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=moe,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        head_dim=hidden // heads, num_experts=experts, num_experts_per_tok=8 if not quick else 2,
        decoder_sparse_step=1, max_position_embeddings=context + 256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a few billion weights take minutes on a CPU
        model = Qwen3MoeForCausalLM._from_config(config, dtype=dtype).eval()
    aux = [1, layers // 2, layers - 2]
    target = TargetDecoder(model, aux)
    cfg = recipe.trainer.draft.model_copy(
        update={"hidden_size": hidden, "num_attention_heads": heads, "head_dim": hidden // heads,
                "num_key_value_heads": max(1, heads // 4), "intermediate_size": 4 * hidden,
                "max_position_embeddings": context + 256}
    )  # fmt: skip
    draft = DSparkDraft(
        cfg, vocab_size=vocab, num_aux_layers=len(aux), attention_backend="sdpa", max_length=context + 256
    )
    draft = draft.to(device=device, dtype=dtype).eval()
    draft.attach_frozen_vocab(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    block = cfg.block_size
    prompt = torch.randint(10, vocab, (context,)).tolist()
    first = target.start(prompt)
    length = target.length
    proposer = DraftProposer(draft)
    proposer.reset(first.aux)
    generator = torch.Generator().manual_seed(0)

    def plain_step() -> None:
        target.extend([5])
        target.rollback(length)

    def verify_step() -> None:
        target.extend([5] * (block + 1))
        target.rollback(length)

    with torch.no_grad():
        timed = _timed_together(
            {"plain": plain_step, "verify": verify_step, "propose": lambda: proposer.propose(5, 0.0, generator)},
            device,
            repeats,
        )
    plain_s, verify_s, propose_s = timed["plain"], timed["verify"], timed["propose"]
    per_step = verify_s + propose_s
    acceptance = [1.5, 2.0, 3.0, 4.0, 5.0, 6.0]
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "target": {
            "hidden": hidden,
            "layers": layers,
            "experts": experts,
            "vocab": vocab,
            "context": context,
            "parameters": sum(p.numel() for p in model.parameters()),
        },  # fmt: skip
        "block_size": block,
        "plain_step_ms": plain_s * 1e3,
        "verify_forward_ms": verify_s * 1e3,
        "propose_ms": propose_s * 1e3,
        "break_even_acceptance": per_step / plain_s,
        "speedup_at": {str(a): a * plain_s / per_step for a in acceptance},
    }


def main(argv: list[str] | None = None) -> int:
    """Command line entry point (bad input: one ``error:`` line, exit 2)."""
    return run_command(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tools.bench.speedup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", help="a trained job: its folder, id or 'latest' (runs/)")
    parser.add_argument("--checkpoint", default="latest", help="the draft to time (latest, step_N)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--synthetic", action="store_true", help="time the cost side on a random target")
    parser.add_argument("--quick", action="store_true", help="with --synthetic: tiny shapes (proves it runs)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.synthetic == bool(args.job):
        parser.error("give --job JOB or --synthetic")
    if args.max_prompts is not None and args.max_prompts < 1:
        parser.error(f"--max-prompts {args.max_prompts}: times at least one prompt; give 1 or more, or leave it out")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more")
    if args.synthetic:
        result = bench_synthetic(args.device, args.quick, args.repeats)
        print(f"{result['device']}: target {result['target']}, block {result['block_size']}")
        print(
            f"plain decode step {result['plain_step_ms']:.2f} ms, verify forward ({result['block_size'] + 1} tokens) "
            f"{result['verify_forward_ms']:.2f} ms, block proposal {result['propose_ms']:.2f} ms"
        )
        print(f"break-even acceptance length {result['break_even_acceptance']:.2f}; speed-up at acceptance length:")
        print("  " + "  ".join(f"{a}: {s:.2f}x" for a, s in result["speedup_at"].items()))
    else:
        from launcher.jobs import find_record

        job_dir = Path(find_record(args.job, REPO_ROOT / "runs").job_dir)
        result = bench_job(job_dir, args.checkpoint, args.device, args.temperatures, args.max_prompts)
        print(f"{result['job']}: {result['prompts']} prompts, {result['device']}, plain and speculative alternating")
        print(f"{'draft':<16} {'T':>4} {'accept len':>10} {'tok/s':>8} {'plain tok/s':>11} {'speed-up':>8} identical")
        for row in result["passes"]:
            for label, f in row["drafts"].items():
                same = "-" if f["identical_outputs"] is None else f"{f['identical_outputs']}/{result['prompts']}"
                pooled = f[POOLED_KEY]
                accept = "-" if pooled is None else f"{pooled:.3f}"
                print(
                    f"{label:<16} {row['temperature']:>4g} {accept:>10} {f['tokens_per_s']:>8.1f} "
                    f"{f['plain_tokens_per_s']:>11.1f} {f['speedup']:>7.2f}x {same}"
                )
        print("accept len: tokens per verify step pooled over all decodes (SGLang's spec_accept_length)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
