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
import os
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from runtime.evaluate.decoder import Generation, plain_generate, speculative_generate
from runtime.evaluate.decodes import PLAIN_DECODER, generation_lines, outcome_lines
from runtime.evaluate.draft import DraftProposer, build_draft
from runtime.evaluate.eval_sets import Prompt, load_prompts
from runtime.evaluate.report import greedy_agreement, pass_figures, plain_figures
from runtime.evaluate.settings import EvalSettings, EvalSetup, TargetSettings
from runtime.evaluate.target import TargetDecoder, load_causal_lm
from runtime.evaluate.teacher_forced import teacher_forced_tau
from runtime.shared.checkpoint_folders import UNTRAINED, DraftSource
from runtime.shared.speedup_trust import LoadSamples, cores_given, group_ratios, speedup_trust
from runtime.trainer.frozen_vocab import load_frozen_vocab
from runtime.user_errors import UserError

log = logging.getLogger("dspark.evaluate")

RESULTS_FORMAT = "dspark-eval/1"
PROGRESS_INTERVAL_S = 10.0


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
        raise UserError(
            "eval.device is cuda, but this node has no CUDA GPU; fix: run on a GPU node or --set eval.device=cpu"
        )
    return setting


def load_tokenizer(target_path: Path) -> Any:
    """The target's tokenizer, or None when the folder has none (``input_ids`` rows need none)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target_path)
    except (OSError, ValueError) as exc:
        log.info("no tokenizer in %s (%s); only input_ids rows can be read", target_path, str(exc).splitlines()[0])
        return None


def target_vocab(target: TargetSettings, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's frozen embedding and lm_head, which every draft of the evaluation shares."""
    return load_frozen_vocab(
        target.path,
        embed_tensor_name=target.embed_tensor_name,
        lm_head_tensor_name=target.lm_head_tensor_name,
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        dtype=dtype,
        device=torch.device(device),
    )


def _prompts(setup: EvalSetup) -> dict[str, list[Prompt]]:
    """The chosen eval sets' prompts, by set name."""
    tokenizer = load_tokenizer(setup.target.path)
    return {s.name: load_prompts(s, tokenizer, setup.target.vocab_size) for s in setup.eval.sets}


def evaluate(setup: EvalSetup, source: DraftSource) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Evaluate the draft of ``source`` (on the embedded route); returns the results document and
    every decode's line (:mod:`runtime.evaluate.decodes`)."""
    started = time.monotonic()
    settings = setup.eval
    device = pick_device(settings.device)
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Decoding one sequence is a chain of small operations: more threads add synchronisation,
        # and on a shared machine they wait for each other's cores.
        torch.set_num_threads(1)
    dtype = getattr(torch, setup.target.compute_dtype)
    target_path = setup.target.path
    prompts = _prompts(setup)
    log.info("eval: loading the target from %s on %s (%s)", target_path, device, setup.target.compute_dtype)
    target = TargetDecoder(load_causal_lm(target_path, dtype, device), setup.target.aux_layer_ids)
    embed, lm_head = target_vocab(setup.target, dtype, device)
    sources = [source]
    if settings.compare_untrained and source.kind != UNTRAINED:
        sources.append(DraftSource(UNTRAINED, None, UNTRAINED, 0))
    drafts = {}
    for draft_source in sources:
        model = build_draft(draft_source, setup.draft, seed=settings.seed, device=device, dtype=dtype)
        model.attach_frozen_vocab(embed, lm_head)
        drafts[draft_source.label] = model
    stop_ids = settings.stop_ids
    _warm_up(target, drafts, next(iter(prompts.values()))[0], stop_ids)
    total_prompts = sum(len(p) for p in prompts.values())
    temperatures = list(settings.temperatures)
    in_parallel = _passes_in_parallel(device, temperatures)
    if in_parallel:
        log.info(
            "eval: the %d temperatures decode in %d processes at once (one core each)",
            len(temperatures),
            len(temperatures),
        )

    serial_progress = Progress(total_prompts * (1 + len(drafts)) * len(temperatures))

    def one_pass(temperature: float) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
        progress = Progress(total_prompts * (1 + len(drafts))) if in_parallel else serial_progress
        entry, lines, greedy = _temperature_pass(
            temperature, target, drafts, prompts, stop_ids, settings, progress, len(temperatures) if in_parallel else 1
        )
        teacher = {}
        if greedy:  # the teacher-forced tau runs on the target's greedy answers
            pairs = [
                (prompt.input_ids, generation.output_ids)
                for name, rows in prompts.items()
                for prompt, generation in zip(rows, greedy[name], strict=True)
            ]
            teacher = {
                label: teacher_forced_tau(target, model, pairs, setup.teacher_forcing)
                for label, model in drafts.items()
            }
        return entry, lines, teacher

    outcomes = _run_passes(one_pass, temperatures, in_parallel)
    passes = [entry for entry, _, _ in outcomes]
    decodes = [line for _, lines, _ in outcomes for line in lines]
    teacher = next((tau for _, _, tau in outcomes if tau), {})
    target.close()
    results = {
        "format": RESULTS_FORMAT,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "job_dir": str(setup.job_dir),
        "recipe_digest": setup.recipe_digest,
        "draft": {
            "label": source.label,
            "kind": source.kind,
            "path": None if source.path is None else str(source.path),
            "step": source.step,
        },
        "compared_with": [label for label in drafts if label != source.label],
        "device": device,
        "dtype": setup.target.compute_dtype,
        "block_size": drafts[source.label].cfg.block_size,
        "max_new_tokens": settings.max_new_tokens,
        "stop_token_ids": sorted(stop_ids),
        "sets": {name: len(rows) for name, rows in prompts.items()},
        "passes": passes,
        "teacher_forced": teacher,
        "seconds": round(time.monotonic() - started, 2),
    }
    return results, decodes


def _lines(
    temperature: float, decoder: str, prompts: dict[str, list[Prompt]], generated: dict[str, list[Generation]]
) -> list[dict[str, Any]]:
    """Every set's decode lines, in set order."""
    return [
        line
        for name, rows in prompts.items()
        for line in generation_lines(temperature, decoder, name, rows, generated[name])
    ]


def _temperature_pass(
    temperature: float,
    target: TargetDecoder,
    drafts: dict[str, Any],
    prompts: dict[str, list[Prompt]],
    stop_ids: Collection[int],
    settings: EvalSettings,
    progress: Progress,
    busy_processes: int = 1,
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, list[Generation]]]:
    """One temperature: every prompt with the target alone, then with each draft, one right after the
    other (interleaved, so the machine's load meets both sides of a speed-up alike). Returns the pass's
    entry of ``results.json``, its decode lines, and (at temperature 0) the target's greedy answers.
    Each decoder draws from its own generator, seeded per set, as if it decoded the set alone."""
    common = {"max_new_tokens": settings.max_new_tokens, "temperature": temperature, "stop_ids": stop_ids}
    decoders: dict[str, Callable[[Prompt, torch.Generator], Generation]] = {
        PLAIN_DECODER: lambda p, g: plain_generate(target, p.prompt_id, p.input_ids, generator=g, **common)
    }
    for label, model in drafts.items():
        proposer = DraftProposer(model)
        decoders[label] = lambda p, g, proposer=proposer: speculative_generate(
            target, proposer, p.prompt_id, p.input_ids, generator=g, **common
        )
    generated: dict[str, dict[str, list[Generation]]] = {decoder: {} for decoder in decoders}
    load = LoadSamples()
    for name, rows in prompts.items():
        generators = {decoder: torch.Generator().manual_seed(settings.seed) for decoder in decoders}
        for decoder in decoders:
            generated[decoder][name] = []
        for prompt in rows:
            for decoder, decode in decoders.items():
                generated[decoder][name].append(decode(prompt, generators[decoder]))
                load.sample()
                progress.step(f"T={temperature:g}, set {name}, {decoder}")
    plain = generated[PLAIN_DECODER]
    decodes = [line for decoder in decoders for line in _lines(temperature, decoder, prompts, generated[decoder])]
    entry: dict[str, Any] = {"temperature": temperature, "plain": _per_set(plain, plain_figures), "drafts": {}}
    cores = cores_given()
    for label, model in drafts.items():
        figures = _per_set(generated[label], lambda gens, m=model: pass_figures(gens, m.cfg.block_size))
        if temperature == 0.0:
            figures["greedy_agreement"] = greedy_agreement(
                [g for n in prompts for g in generated[label][n]], [g for n in prompts for g in plain[n]]
            )
        plain_rate = entry["plain"]["overall"]["tokens_per_s"]
        rate = figures["overall"]["tokens_per_s"]
        figures["speedup_vs_plain"] = round(rate / plain_rate, 4) if rate and plain_rate else None
        ratios = group_ratios([g for n in prompts for g in plain[n]], [g for n in prompts for g in generated[label][n]])
        figures.update(speedup_trust(ratios, load.median(), busy_processes, cores))
        entry["drafts"][label] = figures
    return entry, decodes, plain if temperature == 0.0 else {}


def _passes_in_parallel(device: str, temperatures: list[float]) -> bool:
    """Whether the temperature passes decode in processes of their own at once: on a CPU with a core
    for each (a decode is one thread; each pass times the target alone and the drafts in its own
    process, so its speed-up compares like with like), where ``fork`` shares the loaded models."""
    if device != "cpu" or len(temperatures) < 2 or not hasattr(os, "fork"):
        return False
    return cores_given() >= len(temperatures)


def _run_passes(one_pass: Callable[[float], Any], temperatures: list[float], in_parallel: bool) -> list[Any]:
    """``one_pass`` of every temperature, in order: here one after another, or the first here and each
    other in a forked child that sends its outcome back."""
    if not in_parallel:
        return [one_pass(t) for t in temperatures]
    import multiprocessing
    import traceback

    context = multiprocessing.get_context("fork")

    def child(temperature: float, sender: Any) -> None:
        try:
            sender.send(("ok", one_pass(temperature)))
        except BaseException:  # the parent names the failure
            sender.send(("failed", traceback.format_exc()))
        finally:
            sender.close()

    children = []
    for temperature in temperatures[1:]:
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=child, args=(temperature, sender), daemon=True)
        process.start()
        sender.close()
        children.append((temperature, process, receiver))
    outcomes = [one_pass(temperatures[0])]
    for temperature, process, receiver in children:
        try:
            status, payload = receiver.recv()
        except EOFError:
            status, payload = (
                "failed",
                f"the process of T={temperature:g} ended with code {process.join() or process.exitcode}",
            )
        process.join()
        if status != "ok":
            raise RuntimeError(f"the eval pass at T={temperature:g} failed:\n{payload}")
        outcomes.append(payload)
    return outcomes


WARM_UP_TOKENS = 8


def _warm_up(target: TargetDecoder, drafts: dict[str, Any], prompt: Prompt, stop_ids: Collection[int]) -> None:
    """One short untimed decode of each kind first: the first kernels of a process (CUDA context,
    cuBLAS plans, allocator growth) must not land in the measured tokens/s of whichever pass runs first."""
    generator = torch.Generator().manual_seed(0)
    plain_generate(target, "warm-up", prompt.input_ids, max_new_tokens=WARM_UP_TOKENS, temperature=0.0,
                   stop_ids=stop_ids, generator=generator)  # fmt: skip
    for model in drafts.values():
        for temperature in (0.0, 1.0):
            speculative_generate(target, DraftProposer(model), "warm-up", prompt.input_ids,
                                 max_new_tokens=WARM_UP_TOKENS, temperature=temperature, stop_ids=stop_ids,
                                 generator=generator)  # fmt: skip


def _per_set(by_set: dict[str, list[Generation]], figures: Any) -> dict[str, Any]:
    """Figures per eval set and over all of them."""
    out = {"sets": {name: figures(generations) for name, generations in by_set.items()}}
    out["overall"] = figures([g for generations in by_set.values() for g in generations])
    return out


def evaluate_with_sglang(
    setup: EvalSetup, source: DraftSource, work_dir: Path
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The SGLang route (see :mod:`runtime.evaluate.sglang_route`): export the draft if it is a
    checkpoint, serve the target with it, send every prompt at each temperature, read the figures;
    returns the results document and every decode's line."""
    from runtime.capture.engine_sglang import ServerProcess, SGLangEngine
    from runtime.evaluate.sglang_route import (
        EvalClient,
        SGLangRouteError,
        outcome_figures,
        refuse_off_accelerator,
        refuse_simulated_acceptance,
        serving_command,
        serving_environment,
    )
    from runtime.shared.draft_provenance import run_origin
    from runtime.trainer.export import export_draft

    started = time.monotonic()
    settings, server = setup.eval, setup.sglang
    sglang = server.sglang
    refuse_off_accelerator("cpu" if sglang.device == "cpu" or not torch.cuda.is_available() else "cuda")
    refuse_simulated_acceptance(sglang.server_env)
    if source.kind == UNTRAINED:
        raise SGLangRouteError(
            "the SGLang route serves an exported draft; --checkpoint untrained needs eval.route: embedded"
        )
    target_path = setup.target.path
    prompts = _prompts(setup)
    draft_path = source.path
    if source.kind == "checkpoint":
        model = build_draft(source, setup.draft, seed=settings.seed, device="cpu", dtype=torch.float32)
        draft_path = export_draft(
            model,
            work_dir / f"export-{source.label}",
            setup.draft,
            dtype=torch.bfloat16,
            is_main=True,
            origin=run_origin(setup.job_dir, setup.recipe_digest, source.step),  # served here, not evaluated as one
        )
    assert draft_path is not None
    block_size = setup.draft.draft.block_size
    engine = SGLangEngine(
        server,
        log_path=work_dir / "sglang_server.log",
        command=serving_command(
            sglang,
            draft_path,
            python=server.python or sys.executable,
            model_path=target_path,
            batch_size=settings.batch_size,
            block_size=block_size,
        ),
    )
    engine.env = serving_environment(engine.env, settings.sglang_verify_mode)
    stop_ids = sorted(settings.stop_ids)
    passes = []
    decodes: list[dict[str, Any]] = []
    try:
        engine.check_patch()
        engine.process = ServerProcess(engine.command, engine.env, engine.log_path)
        engine.process.start()
        engine.wait_until_healthy()
        client = EvalClient(engine.base_url, settings.request_timeout_s)
        for temperature in settings.temperatures:
            by_set, every, total_s = {}, [], 0.0
            for name, rows in prompts.items():
                outcomes, wall_s = client.generate_all(
                    rows,
                    batch_size=settings.batch_size,
                    temperature=temperature,
                    max_new_tokens=settings.max_new_tokens,
                    stop_ids=stop_ids,
                )
                by_set[name] = outcome_figures(outcomes, block_size, wall_s)
                decodes += outcome_lines(temperature, source.label, name, rows, outcomes)
                every += outcomes
                total_s += wall_s
                log.info("eval: SGLang, T=%g, set %s: %d prompts in %.0f s", temperature, name, len(rows), wall_s)
            figures: dict[str, Any] = {"sets": by_set, "overall": outcome_figures(every, block_size, total_s)}
            figures["server_avg_spec_accept_length"] = client.server_accept_length()
            figures["speedup_vs_plain"] = None
            passes.append({"temperature": temperature, "plain": None, "drafts": {source.label: figures}})
    finally:
        engine.close()
    results = {
        "format": RESULTS_FORMAT,
        "route": "sglang",
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "job_dir": str(setup.job_dir),
        "recipe_digest": setup.recipe_digest,
        "draft": {"label": source.label, "kind": source.kind, "path": str(draft_path), "step": source.step},
        "compared_with": [],
        "device": "cuda",
        "dtype": "bfloat16",
        "block_size": block_size,
        "max_new_tokens": settings.max_new_tokens,
        "stop_token_ids": stop_ids,
        "sglang_verify_mode": settings.sglang_verify_mode,
        "sets": {name: len(rows) for name, rows in prompts.items()},
        "passes": passes,
        "teacher_forced": {},
        "seconds": round(time.monotonic() - started, 2),
    }
    return results, decodes
