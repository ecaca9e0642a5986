"""The SGLang route: the target served by SGLang 0.5.23 with the exported draft under
``--speculative-algorithm DSPARK``, the eval prompts sent to it, and the acceptance figures read
from its answers. This is how a K3-sized target is judged (the embedded decoder needs the target
on one device).

- Serving command: the capture server's shape (``capture.sglang``: model, TP, memory, backends,
  offload) plus ``--speculative-algorithm DSPARK --speculative-draft-model-path EXPORT
  --speculative-dspark-block-size S``; ``--max-running-requests`` is ``eval.batch_size``.
- Environment: ``SGLANG_RAGGED_VERIFY_MODE`` is ``eval.sglang_verify_mode`` (``cap-accept`` by
  default: the mode whose verify lengths come from the draft's confidence head, so the head is loaded
  and used; ``static`` verifies every block whole and ignores it). ``SGLANG_SIMULATE_ACC_LEN`` is
  removed: it makes SGLang fake its acceptance.
- Per request (``/generate`` with ``input_ids``), SGLang's ``meta_info`` carries
  ``completion_tokens``, ``spec_verify_ct`` (verify steps), ``spec_accept_length`` (completion
  tokens per verify step) and ``spec_correct_drafts_histogram`` (verify steps by drafted tokens
  accepted), from which the per-slot rates follow; ``/server_info`` carries the server's running
  ``avg_spec_accept_length``.
- SGLang 0.5.23 serves DSpark only on CUDA, NPU or XPU: on a CPU node this route refuses with
  SGLang's own reason before anything starts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.capture.engine_sglang import SERVER_MODULE, _find_key, http_request, serving_arguments
from runtime.evaluate.eval_sets import Prompt
from runtime.recipe.schema import SGLangSettings
from runtime.shared.acceptance_length import acceptance_lengths

VERIFY_MODE_VARIABLE = "SGLANG_RAGGED_VERIFY_MODE"
SIMULATED_ACCEPTANCE_VARIABLE = "SGLANG_SIMULATE_ACC_LEN"
DEVICE_REFUSAL = "DSpark speculative decoding only supports CUDA, NPU or XPU device."
"""SGLang 0.5.23's own words when DSpark serving is asked for elsewhere (its speculative arguments hook)."""


class SGLangRouteError(RuntimeError):
    """The SGLang route cannot run; the message says why and what to do."""


def refuse_off_accelerator(device: str) -> None:
    """Stop before launching anything where SGLang would refuse DSpark serving."""
    if not device.startswith(("cuda", "npu", "xpu")):
        raise SGLangRouteError(
            f"eval on the SGLang route needs a GPU: SGLang 0.5.23 serves DSpark drafts only there (its reason: "
            f"{DEVICE_REFUSAL!r}), and this node's device is {device}. Fix: run the eval on a capture-class GPU "
            "node (python3 -m launcher eval JOB submits it there), or set eval.route: embedded for a target "
            "that fits one device"
        )


def serving_command(
    sglang: SGLangSettings, draft_path: Path, *, python: str, model_path: Path, batch_size: int, block_size: int
) -> list[str]:
    """``python -m sglang.launch_server`` serving the target at ``model_path`` (the capture server's
    shape, ``capture.sglang``) with the draft at ``draft_path``."""
    args = serving_arguments(sglang, model_path=model_path)
    args[args.index("--max-running-requests") + 1] = str(batch_size)
    args += [
        "--speculative-algorithm", "DSPARK",
        "--speculative-draft-model-path", str(draft_path),
        "--speculative-dspark-block-size", str(block_size),
    ]  # fmt: skip
    return [python, "-m", SERVER_MODULE, *args, *sglang.extra_args]


def serving_environment(env: Mapping[str, str], verify_mode: str) -> dict[str, str]:
    """``env`` with the verify mode set and simulated acceptance removed."""
    out = {k: v for k, v in env.items() if k != SIMULATED_ACCEPTANCE_VARIABLE}
    out[VERIFY_MODE_VARIABLE] = verify_mode
    return out


def refuse_simulated_acceptance(server_env: Mapping[str, str]) -> None:
    """A recipe that asks SGLang to fake acceptance cannot be evaluated."""
    if SIMULATED_ACCEPTANCE_VARIABLE in server_env:
        raise SGLangRouteError(
            f"capture.sglang.server_env sets {SIMULATED_ACCEPTANCE_VARIABLE}, which makes SGLang report a simulated "
            "acceptance length instead of the draft's; fix: remove it from the recipe"
        )


@dataclass(frozen=True)
class RequestOutcome:
    """What SGLang reported for one prompt."""

    prompt_id: str
    output_ids: list[int]
    completion_tokens: int
    verify_steps: int
    accepted_histogram: list[int]
    """Verify steps by drafted tokens accepted (index 0: none accepted); empty when not reported."""
    seconds: float


class EvalClient:
    """Sends eval prompts to a DSpark-serving SGLang and reads its acceptance figures."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def generate(
        self, prompt: Prompt, *, temperature: float, max_new_tokens: int, stop_ids: Sequence[int]
    ) -> RequestOutcome:
        """One prompt through ``/generate``."""
        payload = {
            "input_ids": prompt.input_ids,
            "sampling_params": {
                "temperature": temperature,
                "max_new_tokens": max_new_tokens,
                "stop_token_ids": list(stop_ids),
            },
        }
        started = time.perf_counter()
        _, body = http_request(f"{self.base_url}/generate", payload=payload, timeout_s=self.timeout_s)
        answer = json.loads(body)
        meta = answer.get("meta_info", {})
        if "spec_verify_ct" not in meta:
            raise SGLangRouteError(
                f"prompt {prompt.prompt_id}: the server's answer has no spec_verify_ct in meta_info: it is not "
                "serving with --speculative-algorithm DSPARK (another server on this port?)"
            )
        return RequestOutcome(
            prompt_id=prompt.prompt_id,
            output_ids=list(answer.get("output_ids", [])),
            completion_tokens=int(meta["completion_tokens"]),
            verify_steps=int(meta["spec_verify_ct"]),
            accepted_histogram=[int(n) for n in meta.get("spec_correct_drafts_histogram") or []],
            seconds=time.perf_counter() - started,
        )

    def generate_all(
        self,
        prompts: Sequence[Prompt],
        *,
        batch_size: int,
        temperature: float,
        max_new_tokens: int,
        stop_ids: Sequence[int],
    ) -> tuple[list[RequestOutcome], float]:
        """Every prompt, ``batch_size`` in flight; returns the outcomes (prompt order) and wall seconds."""
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=batch_size) as pool:
            outcomes = list(
                pool.map(
                    lambda p: self.generate(
                        p, temperature=temperature, max_new_tokens=max_new_tokens, stop_ids=stop_ids
                    ),
                    prompts,
                )
            )
        return outcomes, time.perf_counter() - started

    def server_accept_length(self) -> float | None:
        """The server's running ``avg_spec_accept_length`` from ``/server_info`` (None if absent)."""
        _, body = http_request(f"{self.base_url}/server_info", timeout_s=self.timeout_s)
        value = _find_key(json.loads(body), "avg_spec_accept_length")
        return None if value is None else float(value)


def outcome_figures(outcomes: Sequence[RequestOutcome], block_size: int, wall_s: float) -> dict[str, Any]:
    """The figures of :func:`runtime.evaluate.report.pass_figures` from SGLang's counts: acceptance
    length is completion tokens per verify step (SGLang's own ``spec_accept_length``), pooled and
    per-decode mean (:mod:`runtime.shared.acceptance_length`); per-slot rates
    come from the accepted-drafts histograms (None when the server reports none)."""
    steps = sum(o.verify_steps for o in outcomes)
    tokens = sum(o.completion_tokens for o in outcomes)
    histogram = [0] * (block_size + 1)
    for outcome in outcomes:
        for accepted, count in enumerate(outcome.accepted_histogram[: block_size + 1]):
            histogram[accepted] += count
    counted = sum(histogram)
    slots = []
    for k in range(block_size):
        reached = sum(histogram[k:])
        accepted = sum(histogram[k + 1 :])
        slots.append(
            {
                "slot": k + 1,
                "reached": reached if counted else None,
                "accept_rate": round(accepted / reached, 6) if counted and reached else None,
                "cumulative_rate": round(accepted / counted, 6) if counted else None,
                "mean_confidence": None,
            }
        )
    return {
        "prompts": len(outcomes),
        "generated_tokens": tokens,
        "verify_steps": steps,
        **acceptance_lengths((o.completion_tokens, o.verify_steps) for o in outcomes),
        "slots": slots,
        "seconds": round(wall_s, 4),
        "tokens_per_s": round(tokens / wall_s, 6) if wall_s > 0 else None,
        "stopped_by": {},
    }
