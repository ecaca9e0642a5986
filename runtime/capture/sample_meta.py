"""One captured sample as the producer commits it: contract tensors plus the capture's ``meta``.

The transport adds its own keys when it commits (format, g, dtype / shape / bytes / CRC-32 per
field, total bytes); this module supplies what only the capture knows. Nothing time-dependent goes
in here, so a re-capture of ``g`` writes the same capture metadata (idempotent upsert).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from runtime.capture.engine import CaptureRequest
from runtime.capture.hidden_states import SampleFeatures, to_contract_dtype

LAYER_ID_SEMANTICS = "layer id i = output of decoder layer i = HF hidden_states[i + 1]"
LHS_SEMANTICS = "last hidden state after the final norm (lm_head input)"


@dataclass(frozen=True)
class CaptureIdentity:
    """What every sample of one capture run shares."""

    engine: str
    target_revision: str | None
    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    compute_dtype: str


def sample_tensors(request: CaptureRequest, features: SampleFeatures) -> dict[str, torch.Tensor]:
    """The four contract fields of one sample, ``hs`` / ``lhs`` in bf16."""
    num_tokens = len(request.input_ids)
    if features.num_tokens != num_tokens:
        raise ValueError(
            f"sample g={request.g}: the engine returned {features.num_tokens} positions for {num_tokens} tokens"
        )
    stored = to_contract_dtype(features)
    return {
        # numpy's fromiter is ~4x faster than torch.tensor on a tuple of ints (the GPU waits for it).
        "ids": torch.from_numpy(np.fromiter(request.input_ids, dtype=np.int64, count=num_tokens)),
        "mask": torch.from_numpy(np.fromiter(request.loss_mask, dtype=np.uint8, count=num_tokens)),
        "hs": stored.hs,
        "lhs": stored.lhs,
    }


def sample_meta(request: CaptureRequest, identity: CaptureIdentity, device: str) -> dict[str, Any]:
    """The capture's part of ``meta``: where the sample comes from and how it was captured."""
    return {
        "g": request.g,
        "epoch": request.epoch,
        "row_index": request.row_index,
        "row_id": request.row_id,
        "num_tokens": len(request.input_ids),
        "num_loss_tokens": int(sum(request.loss_mask)),
        "hidden_size": identity.hidden_size,
        "aux_layer_ids": list(identity.aux_layer_ids),
        "layer_id_semantics": LAYER_ID_SEMANTICS,
        "lhs_semantics": LHS_SEMANTICS,
        "target_revision": identity.target_revision,
        "engine": identity.engine,
        "compute_dtype": identity.compute_dtype,
        "device": device,
    }
