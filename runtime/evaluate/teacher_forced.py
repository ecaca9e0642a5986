"""The trainer's own quality figure on the eval prompts: ``tau`` with teacher forcing.

Each sequence (prompt + the target's greedy answer) goes through the target once for its features;
every answer position is an anchor (as the trainer would draw them, all of them); the trainer's
objective computes ``tau`` (``1 + sum_k prod_{i<=k} accept_i`` with ``accept = 1 - L1/2``: the
expected acceptance length of speculative sampling at temperature 1 if every block started on the
true prefix) and the per-slot expected acceptance. It sits beside the measured acceptance length
so a user can see how far the training proxy is from decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from runtime.evaluate.settings import TeacherForcing
from runtime.evaluate.target import TargetDecoder
from runtime.trainer.layout import anchor_generator, build_layout
from runtime.trainer.model import DSparkDraft, SampleInputs
from runtime.trainer.objective import LossCoefficients


@torch.no_grad()
def teacher_forced_tau(
    target: TargetDecoder,
    model: DSparkDraft,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    forcing: TeacherForcing,
) -> dict[str, Any]:
    """``tau`` and per-slot expected acceptance over ``(prompt_ids, answer_ids)`` pairs."""
    block_size = model.cfg.block_size
    coefficients = LossCoefficients(ce=0.0, l1=0.0, confidence=0.0, chunk_rows=forcing.chunk_blocks)
    tau_sum = blocks = 0.0
    slot_accept = torch.zeros(block_size, dtype=torch.float64)
    slot_count = torch.zeros(block_size, dtype=torch.float64)
    for index, (prompt, answer) in enumerate(sequences):
        ids = [*prompt, *answer]
        if len(answer) < 2:
            continue  # no anchor: a position needs itself and the next token on the answer
        features = target.features(ids)
        loss_mask = torch.tensor([0] * len(prompt) + [1] * len(answer), dtype=torch.int64)
        layout = build_layout(
            torch.tensor(ids, dtype=torch.int64),
            loss_mask,
            num_anchors=len(answer),  # every eligible position (there are len(answer) - 1)
            block_size=block_size,
            mask_token_id=model.cfg.mask_token_id,
            loss_decay_gamma=forcing.loss_decay_gamma,
            generator=anchor_generator(forcing.anchor_seed, index),
        ).to(model.fc.weight.device)
        dtype = model.fc.weight.dtype
        terms = model(SampleInputs(hs=features.hs.to(dtype), lhs=features.lhs.to(dtype), layout=layout), coefficients)
        tau_sum += float(terms.sums["tau"])
        blocks += float(terms.sums["valid_blocks"])
        slot_accept += terms.sums["slot_accept"].cpu()
        slot_count += terms.sums["slot_count"].cpu()
    return {
        "tau": round(tau_sum / blocks, 6) if blocks else None,
        "blocks": int(blocks),
        "slot_expected_accept": [
            round(float(a / c), 6) if c else None for a, c in zip(slot_accept, slot_count, strict=True)
        ],
    }
