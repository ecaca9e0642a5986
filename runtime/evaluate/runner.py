"""One evaluation: a draft (and the untrained floor) decoded speculatively against the target on
the recipe's eval sets, at each temperature, beside plain target decoding; ``results.json``.

Order of work, for the measured speeds to compare like with like: per temperature, the target
alone decodes every prompt (the baseline, and at temperature 0 the reference that the speculative
outputs must equal), then each draft does. The teacher-forced ``tau`` runs on the target's greedy
answers.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.evaluate.decoder import Generation, plain_generate, speculative_generate
from runtime.evaluate.draft import UNTRAINED, DraftProposer, DraftSource, build_draft
from runtime.evaluate.eval_sets import Prompt, load_prompts
from runtime.evaluate.report import greedy_agreement, pass_figures, plain_figures
from runtime.evaluate.target import TargetDecoder, load_causal_lm
from runtime.evaluate.teacher_forced import teacher_forced_tau
from runtime.recipe import ResolvedRecipe
from runtime.recipe.schema import EvalSection
from runtime.trainer.frozen_vocab import load_frozen_vocab

log = logging.getLogger("dspark.evaluate")

RESULTS_FORMAT = "dspark-eval/1"
PROGRESS_INTERVAL_S = 10.0


@dataclass
class EvalInputs:
    """What one evaluation reads."""

    resolved: ResolvedRecipe
    eval: EvalSection
    source: DraftSource
    set_names: list[str] | None = None
    """Only these eval sets (None: all of the recipe's)."""


class Progress:
    """A line every :data:`PROGRESS_INTERVAL_S` seconds: prompts done, rate, ETA, what runs."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.started = time.monotonic()
        self.last = self.started

    def step(self, what: str) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last < PROGRESS_INTERVAL_S and self.done < self.total:
            return
        self.last = now
        rate = self.done / max(now - self.started, 1e-9)
        eta = (self.total - self.done) / rate if rate else 0.0
        log.info("eval: %d/%d decodes (%.2f/s), ETA %.0f s; %s", self.done, self.total, rate, eta, what)


def pick_device(setting: str) -> str:
    """``auto`` is the first GPU when there is one."""
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("eval.device is cuda, but this node has no CUDA GPU; fix: run on a GPU node or set cpu")
    return setting


def _load_tokenizer(target_path: Path) -> Any:
    """The target's tokenizer, or None when the folder has none (``input_ids`` rows need none)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target_path)
    except (OSError, ValueError) as exc:
        log.info("no tokenizer in %s (%s); only input_ids rows can be read", target_path, str(exc).splitlines()[0])
        return None


def evaluate(inputs: EvalInputs) -> dict[str, Any]:
    """Run the evaluation; returns the results document."""
    started = time.monotonic()
    recipe = inputs.resolved.recipe
    settings = inputs.eval
    device = pick_device(settings.device)
    dtype = getattr(torch, recipe.capture.compute_dtype)
    target_path = inputs.resolved.resolve_path(recipe.capture.target_path)
    sets = [(i, s) for i, s in enumerate(settings.sets) if inputs.set_names is None or s.name in inputs.set_names]
    tokenizer = _load_tokenizer(target_path)
    prompts = {
        s.name: load_prompts(s, i, inputs.resolved.resolve_path, tokenizer, recipe.capture.vocab_size) for i, s in sets
    }
    log.info("eval: loading the target from %s on %s (%s)", target_path, device, recipe.capture.compute_dtype)
    target = TargetDecoder(load_causal_lm(target_path, dtype, device), recipe.capture.aux_layer_ids)
    embed, lm_head = load_frozen_vocab(
        target_path,
        embed_tensor_name=recipe.trainer.embed_tensor_name,
        lm_head_tensor_name=recipe.trainer.lm_head_tensor_name,
        vocab_size=recipe.capture.vocab_size,
        hidden_size=recipe.capture.hidden_size,
        dtype=dtype,
        device=torch.device(device),
    )
    sources = [inputs.source]
    if settings.compare_untrained and inputs.source.kind != UNTRAINED:
        sources.append(DraftSource(UNTRAINED, None, UNTRAINED, 0))
    drafts = {}
    for source in sources:
        model = build_draft(source, recipe, seed=settings.seed, device=device, dtype=dtype)
        model.attach_frozen_vocab(embed, lm_head)
        drafts[source.label] = model
    stop_ids = {recipe.capture.special_tokens.eos_id, *settings.stop_token_ids}
    total_prompts = sum(len(p) for p in prompts.values())
    progress = Progress(total_prompts * len(settings.temperatures) * (1 + len(drafts)))
    passes = []
    greedy_answers: dict[str, list[Generation]] = {}
    for temperature in settings.temperatures:
        plain: dict[str, list[Generation]] = {}
        for name, rows in prompts.items():
            generator = torch.Generator().manual_seed(settings.seed)
            plain[name] = []
            for prompt in rows:
                plain[name].append(
                    plain_generate(
                        target,
                        prompt.prompt_id,
                        prompt.input_ids,
                        max_new_tokens=settings.max_new_tokens,
                        temperature=temperature,
                        stop_ids=stop_ids,
                        generator=generator,
                    )
                )
                progress.step(f"target alone, T={temperature:g}, set {name}")
        if temperature == 0.0:
            greedy_answers = plain
        entry: dict[str, Any] = {"temperature": temperature, "plain": _per_set(plain, plain_figures), "drafts": {}}
        for label, model in drafts.items():
            proposer = DraftProposer(model)
            generated: dict[str, list[Generation]] = {}
            for name, rows in prompts.items():
                generator = torch.Generator().manual_seed(settings.seed)
                generated[name] = [
                    _speculative(target, proposer, prompt, settings, temperature, stop_ids, generator, progress, label)
                    for prompt in rows
                ]
            figures = _per_set(generated, lambda gens, m=model: pass_figures(gens, m.cfg.block_size))
            if temperature == 0.0:
                figures["greedy_agreement"] = greedy_agreement(
                    [g for n in prompts for g in generated[n]], [g for n in prompts for g in plain[n]]
                )
            plain_rate = entry["plain"]["overall"]["tokens_per_s"]
            rate = figures["overall"]["tokens_per_s"]
            figures["speedup_vs_plain"] = round(rate / plain_rate, 4) if rate and plain_rate else None
            entry["drafts"][label] = figures
        passes.append(entry)
    teacher = {}
    if greedy_answers:
        pairs = [
            (prompt.input_ids, generation.output_ids)
            for name, rows in prompts.items()
            for prompt, generation in zip(rows, greedy_answers[name], strict=True)
        ]
        for label, model in drafts.items():
            teacher[label] = teacher_forced_tau(target, model, pairs, recipe)
    target.close()
    source = inputs.source
    return {
        "format": RESULTS_FORMAT,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "job_dir": str(inputs.resolved.job_dir),
        "recipe_digest": inputs.resolved.digest,
        "draft": {
            "label": source.label,
            "kind": source.kind,
            "path": None if source.path is None else str(source.path),
            "step": source.step,
        },
        "compared_with": [label for label in drafts if label != source.label],
        "device": device,
        "dtype": recipe.capture.compute_dtype,
        "block_size": drafts[source.label].cfg.block_size,
        "max_new_tokens": settings.max_new_tokens,
        "stop_token_ids": sorted(stop_ids),
        "sets": {name: len(rows) for name, rows in prompts.items()},
        "passes": passes,
        "teacher_forced": teacher,
        "seconds": round(time.monotonic() - started, 2),
    }


def _speculative(
    target: TargetDecoder,
    proposer: DraftProposer,
    prompt: Prompt,
    settings: EvalSection,
    temperature: float,
    stop_ids: set[int],
    generator: torch.Generator,
    progress: Progress,
    label: str,
) -> Generation:
    generation = speculative_generate(
        target,
        proposer,
        prompt.prompt_id,
        prompt.input_ids,
        max_new_tokens=settings.max_new_tokens,
        temperature=temperature,
        stop_ids=stop_ids,
        generator=generator,
    )
    progress.step(f"draft {label}, T={temperature:g}")
    return generation


def _per_set(by_set: dict[str, list[Generation]], figures: Any) -> dict[str, Any]:
    """Figures per eval set and over all of them."""
    out = {"sets": {name: figures(generations) for name, generations in by_set.items()}}
    out["overall"] = figures([g for generations in by_set.values() for g in generations])
    return out
