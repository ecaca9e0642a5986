"""What the SGLang capture engine and the patched server say to each other (torch-free).

A capture is one ``POST /generate`` with the sample's token ids, ``max_new_tokens: 0`` (prefill
only: SGLang's prefill-only path samples nothing), ``return_hidden_states: true`` (so the logits
processor keeps every token's aux and post-norm hidden states), a fresh ``cache_salt`` (so no prefix
of an earlier sample is reused: every token's hidden states must be computed) and the
``dspark_capture`` field the patch adds, which carries a :class:`CaptureTicket`. The server's sink
answers in ``meta_info["dspark_capture"]`` with a :class:`CaptureReceipt`.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TICKET_FORMAT = "dspark-capture-ticket/1"
"""Version of the ``dspark_capture`` request payload; the sink refuses any other."""
RESPONSE_META_KEY = "dspark_capture"
"""Key of the capture receipt in the response's ``meta_info`` (the patch's DSPARK_CAPTURE_META_KEY)."""
RECEIPT_STATUSES = ("committed", "queued", "below_cursor", "discarded", "skipped", "error")
"""committed: in the store; queued: staged, committed by the sink's pipeline while the server runs
its next prefill (the window sees it when its meta lands); below_cursor: the trainer moved past g,
nothing written; discarded:
checked but not stored (``--dspark-capture-sink discard``); skipped: a rank that does not commit;
error: see ``error``."""


class WireError(ValueError):
    """A ticket or a receipt that does not follow this module's format (message names the field)."""


@dataclass(frozen=True)
class CaptureTicket:
    """Which sample a prefill captures, and what the sink must check before it commits it."""

    g: int
    epoch: int
    row_index: int
    row_id: str
    loss_mask: str
    """One character per token, ``'0'`` or ``'1'`` (compact in JSON: 64 KB for a 64K sample)."""
    store_id: str
    aux_layer_ids: tuple[int, ...]
    hidden_size: int

    @property
    def num_tokens(self) -> int:
        """T: tokens of the sample (the loss mask has one entry per token)."""
        return len(self.loss_mask)

    def to_payload(self) -> dict[str, Any]:
        """The JSON object sent as ``dspark_capture``."""
        return {
            "format": TICKET_FORMAT,
            "g": self.g,
            "epoch": self.epoch,
            "row_index": self.row_index,
            "row_id": self.row_id,
            "loss_mask": self.loss_mask,
            "store_id": self.store_id,
            "aux_layer_ids": list(self.aux_layer_ids),
            "hidden_size": self.hidden_size,
        }

    @classmethod
    def from_payload(cls, payload: Any) -> CaptureTicket:
        """Parse and check a ``dspark_capture`` payload; raises WireError naming the field."""
        if not isinstance(payload, Mapping):
            raise WireError(f"dspark_capture must be a JSON object, got {type(payload).__name__}")
        if payload.get("format") != TICKET_FORMAT:
            raise WireError(
                f"dspark_capture.format is {payload.get('format')!r}, expected {TICKET_FORMAT!r}: the capture "
                "engine and the server's runtime/capture code come from different versions of the repository"
            )
        ints = {}
        for name in ("g", "epoch", "row_index", "hidden_size"):
            value = payload.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise WireError(f"dspark_capture.{name} must be a non-negative integer, got {value!r}")
            ints[name] = value
        mask = payload.get("loss_mask")
        if not isinstance(mask, str) or not mask or mask.strip("01"):
            raise WireError("dspark_capture.loss_mask must be a non-empty string of '0' and '1', one per token")
        layers = payload.get("aux_layer_ids")
        if (
            not isinstance(layers, list)
            or not layers
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
        ):
            raise WireError(f"dspark_capture.aux_layer_ids must be a non-empty list of layer ids, got {layers!r}")
        for name in ("row_id", "store_id"):
            if not isinstance(payload.get(name), str) or not payload[name]:
                raise WireError(f"dspark_capture.{name} must be a non-empty string")
        return cls(
            g=ints["g"],
            epoch=ints["epoch"],
            row_index=ints["row_index"],
            row_id=payload["row_id"],
            loss_mask=mask,
            store_id=payload["store_id"],
            aux_layer_ids=tuple(layers),
            hidden_size=ints["hidden_size"],
        )


def encode_loss_mask(mask: Sequence[int]) -> str:
    """``[0, 1, 1]`` -> ``'011'``; anything but 0/1 is an error."""
    text = "".join("1" if v == 1 else "0" if v == 0 else "?" for v in mask)
    if "?" in text:
        bad = next(v for v in mask if v not in (0, 1))
        raise WireError(f"loss_mask values must be 0 or 1, found {bad!r}")
    return text


def generate_body(ticket: CaptureTicket, input_ids: Sequence[int], cache_salt: str | None = None) -> dict[str, Any]:
    """The ``POST /generate`` body that captures one sample."""
    if len(input_ids) != ticket.num_tokens:
        raise WireError(
            f"sample g={ticket.g}: {len(input_ids)} token ids but a loss mask of {ticket.num_tokens}; "
            "the data row is inconsistent (tools/verify_data finds such rows)"
        )
    return {
        "input_ids": list(input_ids),
        "sampling_params": {"max_new_tokens": 0},
        "return_hidden_states": True,
        "stream": False,
        # A fresh namespace per request: a prefix-cache hit would leave those tokens without
        # hidden states (the sink refuses such a prefill anyway).
        "cache_salt": cache_salt or f"dspark-{ticket.g}-{uuid.uuid4().hex}",
        "rid": f"dspark-capture-{ticket.g}-{uuid.uuid4().hex[:8]}",
        "dspark_capture": ticket.to_payload(),
    }


@dataclass(frozen=True)
class CaptureReceipt:
    """What the server's sink reports for one capture."""

    status: str
    g: int | None
    num_tokens: int = 0
    bytes_written: int = 0
    keys: tuple[str, ...] = ()
    fields: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per tensor field: ``dtype``, ``shape``, ``bytes``."""
    error: str = ""
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_response(cls, body: Any) -> CaptureReceipt:
        """The receipt inside a ``/generate`` response body; WireError when it is absent or malformed."""
        if isinstance(body, list):
            if len(body) != 1:
                raise WireError(f"expected one response object, got a list of {len(body)}")
            body = body[0]
        meta_info = body.get("meta_info") if isinstance(body, Mapping) else None
        if not isinstance(meta_info, Mapping):
            raise WireError("the response has no meta_info object: is this a /generate response?")
        receipts = meta_info.get(RESPONSE_META_KEY)
        if receipts is None:
            finish = meta_info.get("finish_reason")
            raise WireError(
                f"the response's meta_info has no {RESPONSE_META_KEY!r} (finish_reason {finish!r}): the server is "
                "not running the dspark-capture patch, or the request was aborted before its prefill"
            )
        raw = receipts[-1] if isinstance(receipts, list) and receipts else receipts
        if not isinstance(raw, Mapping) or raw.get("status") not in RECEIPT_STATUSES:
            raise WireError(f"malformed capture receipt: {str(raw)[:300]}")
        return cls(
            status=raw["status"],
            g=raw.get("g"),
            num_tokens=int(raw.get("num_tokens", 0)),
            bytes_written=int(raw.get("bytes_written", 0)),
            keys=tuple(raw.get("keys", ())),
            fields=dict(raw.get("fields", {})),
            error=str(raw.get("error", "")),
            raw=dict(raw),
        )
