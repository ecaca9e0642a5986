"""Check an evaluation's results from its own records, with nothing of the evaluation's decoder.

``python3 -m tools.replay_decodes RESULTS_FOLDER [--target DIR] [--limit N] [--device cpu]``

1. The figures: every acceptance length in ``results.json`` is recomputed from ``decodes.jsonl``, per
   temperature, draft and set: the pooled one (committed tokens summed over verify steps summed) and
   the mean over decodes of each decode's own (:mod:`runtime.shared.acceptance_length`).
2. The greedy outputs: every temperature-0 prompt is decoded again with plain transformers
   ``generate`` (greedy, its own KV cache, no draft) from the recorded ``prompt_ids``, and every
   decoder's recorded ``output_ids`` for that prompt (the target alone and each draft) is compared
   with it token for token. A decode the evaluation cut at the position limit is compared on the
   tokens it has.

The target is the job's ``capture.target_path`` unless ``--target`` names another folder. Prints one
line per difference and a verdict; exit 0 when everything agrees, 1 when something differs, 2 on bad
input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from runtime.shared.acceptance_length import (
    MEAN_OF_DECODES_KEY,
    acceptance_length_mean_of_decodes,
    acceptance_length_pooled,
    pooled_acceptance_length_of,
)
from runtime.user_errors import UserError, exit_without_package, file_kind_problem, run_command

COMMAND = "tools.replay_decodes"

DECODES_FILE = "decodes.jsonl"
RESULTS_FILE = "results.json"
DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes an evaluation records (``results.json``'s ``dtype``)."""
REWRITE_FIX = "fix: evaluate again to rewrite the results (python3 -m launcher eval JOB)"


class ReplayInputError(UserError):
    """A results folder this tool cannot read; the message names the file and the fix."""


def _read_folder(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    results_path, decodes_path = folder / RESULTS_FILE, folder / DECODES_FILE
    for path in (results_path, decodes_path):
        kind = file_kind_problem(path)
        if kind is not None:
            raise ReplayInputError(f"{path} is {kind}, not a regular file; {REWRITE_FIX}")
        if not path.is_file():
            raise ReplayInputError(
                f"{path} does not exist; fix: give the folder an evaluation wrote (runs/<job>/eval/<draft>), "
                f"evaluated again if it predates {DECODES_FILE}"
            )
    try:
        results = json.loads(results_path.read_text(encoding="utf-8"))
        lines = [json.loads(t) for t in decodes_path.read_text(encoding="utf-8").splitlines() if t.strip()]
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReplayInputError(f"{folder}: {exc}; {REWRITE_FIX}") from None
    _check_results(results, results_path)
    for number, line in enumerate(lines, 1):
        _check_line(line, f"{decodes_path}:{number}")
    return results, lines


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _check_results(results: Any, where: Path) -> None:
    """``results.json`` has the fields the replay reads, of the types an evaluation writes: a tampered or
    foreign file is named, never trusted (a dtype is looked up on torch, a length bounds a decode)."""
    if not isinstance(results, dict):
        raise ReplayInputError(f"{where} holds a {type(results).__name__}, not an evaluation's results; {REWRITE_FIX}")
    problems = []
    if not isinstance(results.get("passes"), list) or not all(isinstance(p, dict) for p in results["passes"]):
        problems.append("'passes' is not a list of passes")
    if results.get("dtype", "float32") not in DTYPES:
        problems.append(f"'dtype' is {results.get('dtype')!r}, not one of {', '.join(DTYPES)}")
    stop = results.get("stop_token_ids")
    if not _is_ids(stop) or not stop:
        problems.append(f"'stop_token_ids' is {stop!r}, not a non-empty list of token ids")
    if problems:
        raise ReplayInputError(f"{where}: {'; '.join(problems)}; {REWRITE_FIX}")


def _check_line(line: Any, where: str) -> None:
    """One decode line has what the replay reads: set, prompt and decoder names, a finite temperature,
    the prompt's and the output's token ids."""
    if not isinstance(line, dict):
        raise ReplayInputError(f"{where} is {line!r}, not a decode (a JSON object); {REWRITE_FIX}")
    problems = [
        f"'{name}' is not text" for name in ("set", "prompt_id", "decoder") if not isinstance(line.get(name), str)
    ]
    temperature = line.get("temperature")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 <= temperature < 1e6:
        problems.append(f"'temperature' is {temperature!r}, not a temperature")
    problems += [
        f"'{name}' is not a list of token ids" for name in ("prompt_ids", "output_ids") if not _is_ids(line.get(name))
    ]
    steps = line.get("verify_steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
        problems.append(f"'verify_steps' is {steps!r}, not a count")
    if problems:
        raise ReplayInputError(f"{where}: {'; '.join(problems)}; {REWRITE_FIX}")


def recomputed_figures(results: dict[str, Any], lines: list[dict[str, Any]]) -> list[str]:
    """Differences between ``results.json``'s acceptance lengths (pooled, and the mean of decodes where
    the file has it) and those computed from the decode lines."""
    decodes: dict[tuple[float, str, str], list[tuple[int, int]]] = defaultdict(list)
    for line in lines:
        if "verify_steps" not in line:
            continue
        tokens = line.get("completion_tokens", len(line["output_ids"]))
        for scope in (line["set"], "overall"):
            decodes[(float(line["temperature"]), line["decoder"], scope)].append((tokens, line["verify_steps"]))
    differences = []
    for entry in results["passes"]:
        for label, figures in entry["drafts"].items():
            scopes = {"overall": figures["overall"], **figures.get("sets", {})}
            for scope, numbers in scopes.items():
                pairs = decodes.get((float(entry["temperature"]), label, scope), [])
                where = f"T={entry['temperature']:g} {label} {scope}"
                pooled, theirs = acceptance_length_pooled(pairs), pooled_acceptance_length_of(numbers)
                if pooled != theirs:
                    tokens, steps = sum(t for t, _ in pairs), sum(s for _, s in pairs)
                    differences.append(
                        f"{where}: pooled acceptance length: results.json says {theirs}, the decodes give "
                        f"{tokens} tokens / {steps} verify steps = {pooled}"
                    )
                if MEAN_OF_DECODES_KEY not in numbers:
                    continue  # an older run's file: it recorded the pooled figure only
                mean, theirs = acceptance_length_mean_of_decodes(pairs), numbers[MEAN_OF_DECODES_KEY]
                if mean != theirs:
                    differences.append(
                        f"{where}: acceptance length mean of decodes: results.json says {theirs}, the "
                        f"{sum(1 for _, s in pairs if s)} decodes with a verify step give {mean}"
                    )
    return differences


def replay_greedy(
    results: dict[str, Any], lines: list[dict[str, Any]], target: Path, device: str, limit: int | None
) -> tuple[int, list[str]]:
    """Decode the temperature-0 prompts with transformers greedy ``generate`` and compare every recorded
    output of them; returns (outputs compared, differences)."""
    try:  # imported here (the figures check needs neither); a stock python3: one line, not a traceback
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.utils import logging as hf_logging
    except ModuleNotFoundError as missing:
        exit_without_package(missing, COMMAND)

    hf_logging.disable_progress_bar()

    greedy = [line for line in lines if float(line["temperature"]) == 0.0]
    by_prompt: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for line in greedy:
        by_prompt[(line["set"], line["prompt_id"])].append(line)
    keys = list(by_prompt)[:limit] if limit else list(by_prompt)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        results.get("dtype", "float32")
    ]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()
    stop_ids = [int(t) for t in results["stop_token_ids"]]
    compared, differences = 0, []
    for count, key in enumerate(keys, 1):
        prompt_ids = by_prompt[key][0]["prompt_ids"]
        # Each replay decodes no further than the longest output recorded for its prompt: the folder's own
        # max_new_tokens is not trusted to bound it (a tampered 100000 would decode for hours).
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max(1, max(len(line["output_ids"]) for line in by_prompt[key])),
            eos_token_id=stop_ids,
            pad_token_id=stop_ids[0],
        )
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids], device=device),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
                generation_config=config,
            )
        reference = out[0, len(prompt_ids) :].tolist()  # ends with the stop token, as a recorded output does
        for line in by_prompt[key]:
            compared += 1
            recorded = line["output_ids"]
            if line.get("stopped_by") == "position_limit":
                same = recorded == reference[: len(recorded)]
            else:  # a whole decode ends at a stop token: one cut short would otherwise match the capped replay
                same = recorded == reference and bool(recorded) and recorded[-1] in stop_ids
            if not same:
                at = next((i for i, (a, b) in enumerate(zip(recorded, reference, strict=False)) if a != b), None)
                where = f"first difference at output token {at}" if at is not None else "lengths differ"
                differences.append(
                    f"set {key[0]} prompt {key[1]}, {line['decoder']}: {len(recorded)} tokens recorded, transformers "
                    f"greedy gives {len(reference)}; {where}"
                )
        if count % 8 == 0 or count == len(keys):
            print(f"[replay] {count}/{len(keys)} prompts replayed", flush=True)
    return compared, differences


def _target_of(results: dict[str, Any]) -> Path:
    try:
        from runtime.recipe import RecipeError, load_resolved
        from runtime.recipe.loader import RESOLVED_FILENAME
    except ModuleNotFoundError as missing:
        exit_without_package(missing, COMMAND)

    if not isinstance(results.get("job_dir"), str):
        raise ReplayInputError(
            f"{RESULTS_FILE} names no job folder ('job_dir'); fix: name the target folder with --target"
        )
    resolved_path = Path(results["job_dir"]) / RESOLVED_FILENAME
    try:
        resolved = load_resolved(resolved_path)
    except (RecipeError, OSError) as exc:
        raise ReplayInputError(f"{resolved_path}: {exc}; fix: name the target folder with --target") from None
    return resolved.resolve_path(resolved.recipe.capture.target_path)


def main(argv: list[str] | None = None) -> int:
    """Check one results folder; returns the exit code (bad input: one ``error:`` line, exit 2)."""
    return run_command(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog=f"python3 -m {COMMAND}", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a results folder (results.json and decodes.jsonl)")
    parser.add_argument("--target", type=Path, help="the target's Hugging Face folder (default: the job's)")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N greedy prompts (N >= 1)")
    parser.add_argument("--device", default="cpu", help="torch device for the replay (default cpu)")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        raise ReplayInputError(
            f"--limit {args.limit}: replays at least one prompt; fix: give 1 or more, or leave it out"
        )
    results, lines = _read_folder(args.folder)
    target = args.target or _target_of(results)
    if not (target / "config.json").is_file():
        raise ReplayInputError(f"{target} has no config.json; fix: name the target folder with --target")
    try:
        differences = recomputed_figures(results, lines)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ReplayInputError(
            f"{args.folder / RESULTS_FILE}: a field the figures need is missing or of another type "
            f"({type(exc).__name__}: {exc}); {REWRITE_FIX}"
        ) from None
    print(f"[replay] figures: {len(differences)} of results.json's acceptance lengths differ from the decodes")
    compared, different = replay_greedy(results, lines, target, args.device, args.limit)
    differences += different
    for line in differences:
        print(f"[replay] DIFFERS: {line}")
    print(
        f"[replay] greedy: {compared - len(different)}/{compared} recorded outputs identical to transformers greedy "
        f"decoding of {target}"
    )
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
