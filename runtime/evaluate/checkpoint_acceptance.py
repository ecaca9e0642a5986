"""The greedy acceptance length of every checkpoint of a run while it trains (``eval.checkpoint_prompts``),
for the acceptance-over-steps plot; run by ``python3 -m runtime.evaluate.during_training``.

It loads the target and the first eval set once, on ``eval.device`` (a CPU decode of a target of
hundreds of millions of parameters falls behind a GPU trainer), decodes the untrained draft first (step 0, while
the trainer starts), then each complete checkpoint the trainer writes, and appends one line per
draft to ``<job>/eval/during_training.jsonl``. The trainer never waits for it: a checkpoint that
``keep_last`` removes before it is read is skipped with a line. SIGTERM (the run has ended) makes
it decode the checkpoints already written, then exit.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from typing import Any

import torch

from runtime.evaluate.decoder import speculative_generate
from runtime.evaluate.draft import DraftProposer, build_draft
from runtime.evaluate.eval_sets import load_prompts
from runtime.evaluate.report import pass_figures
from runtime.evaluate.runner import load_tokenizer, pick_device, target_vocab
from runtime.evaluate.settings import EvalSetup
from runtime.evaluate.target import TargetDecoder, load_causal_lm
from runtime.files import append_text
from runtime.shared.acceptance_length import MEAN_OF_DECODES_KEY, POOLED_KEY
from runtime.shared.checkpoint_folders import UNTRAINED, DraftSource, DraftSourceError, complete_checkpoints
from runtime.trainer.checkpoints import CheckpointError

log = logging.getLogger("dspark.evaluate.during_training")

RESULTS_FILE = "during_training.jsonl"
"""One JSON line per evaluated draft, in ``<job>/eval/``."""
POLL_S = 1.0


class RunEnded:
    """Set by SIGTERM: the run has ended; decode what is on disk, then exit."""

    requested = False

    @classmethod
    def install(cls) -> None:
        def handler(signum: int, frame: Any) -> None:
            cls.requested = True

        signal.signal(signal.SIGTERM, handler)


def checkpoint_acceptance(setup: EvalSetup, num_prompts: int) -> None:
    """Decode ``num_prompts`` prompts of the first eval set greedily with the untrained draft, then with
    each checkpoint as it appears, until SIGTERM; one line each in ``eval/during_training.jsonl``."""
    settings = setup.eval
    device = pick_device(settings.device)
    if device == "cpu":
        torch.set_num_threads(1)  # a low-priority process beside the trainer: one core
    dtype = getattr(torch, setup.target.compute_dtype)
    target_path = setup.target.path
    eval_set = settings.sets[0]
    prompts = load_prompts(eval_set, load_tokenizer(target_path), setup.target.vocab_size)
    prompts = prompts[:num_prompts]
    target = TargetDecoder(load_causal_lm(target_path, dtype, device), setup.target.aux_layer_ids)
    embed, lm_head = target_vocab(setup.target, dtype, device)
    stop_ids = settings.stop_ids
    out_path = setup.job_dir / "eval" / RESULTS_FILE
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done: set[str] = set()

    def decode(source: DraftSource) -> None:
        try:
            model = build_draft(source, setup.draft, seed=settings.seed, device=device, dtype=dtype)
        except (DraftSourceError, CheckpointError, OSError) as exc:
            # keep_last removed it while we read it, or it was still being replaced: not this run's fault.
            log.info("acceptance during training: %s skipped (%s)", source.label, str(exc).splitlines()[0])
            return
        model.attach_frozen_vocab(embed, lm_head)
        proposer = DraftProposer(model)
        generator = torch.Generator().manual_seed(settings.seed)
        generations = [
            speculative_generate(
                target,
                proposer,
                prompt.prompt_id,
                prompt.input_ids,
                max_new_tokens=settings.max_new_tokens,
                temperature=0.0,
                stop_ids=stop_ids,
                generator=generator,
            )
            for prompt in prompts
        ]
        figures = pass_figures(generations, model.cfg.block_size)
        record = {
            "draft": source.label,
            "step": source.step,
            "set": eval_set.name,
            "prompts": len(prompts),
            "temperature": 0.0,
            "verify_steps": figures["verify_steps"],
            POOLED_KEY: figures[POOLED_KEY],
            MEAN_OF_DECODES_KEY: figures[MEAN_OF_DECODES_KEY],
        }
        append_text(out_path, json.dumps(record, sort_keys=True) + "\n")
        log.info(
            "acceptance during training: %s: %.3f tokens per verify step pooled (%d steps, %d prompts, T=0)",
            source.label,
            figures[POOLED_KEY] or 0.0,
            figures["verify_steps"],
            len(prompts),
        )

    decode(DraftSource(UNTRAINED, None, UNTRAINED, 0))
    checkpoint_dir = setup.checkpoint_dir
    while True:
        stopping = RunEnded.requested  # read before the look: what is on disk now is decoded before exiting
        for path in complete_checkpoints(checkpoint_dir):
            if path.name not in done:
                done.add(path.name)
                decode(DraftSource("checkpoint", path, path.name, int(path.name.removeprefix("step_"))))
        if stopping:
            break
        time.sleep(POLL_S)
    target.close()
