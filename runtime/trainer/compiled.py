"""One compiled copy per process of the functions the trainer runs through ``torch.compile``."""

from __future__ import annotations

from typing import Any

import torch

_COMPILED: dict[str, Any] = {}


def compiled(fn: Any) -> Any:
    """``fn`` compiled once per process and shared by every caller. Modules are passed as
    arguments (``compiled(Layer.body)(layer, ...)``), so identical modules reuse one compiled graph
    (their guards are alike) and FSDP2's hooks stay outside it, on the modules' ``__call__``."""
    key = f"{fn.__module__}.{fn.__qualname__}"
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn)
    return _COMPILED[key]
