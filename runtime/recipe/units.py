"""Human-friendly byte sizes for recipes: ``"1TiB"``, ``"800GiB"``, ``"64MiB"`` or a plain integer."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
GB = _UNITS["gb"]
"""Bytes in a decimal gigabyte: the unit of the plan's weight and HBM figures."""
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: object) -> int:
    """Parse ``value`` (int or a string such as ``"800GiB"``) into a byte count.

    Raises ValueError with the accepted forms when the value cannot be read.
    """
    if isinstance(value, bool):
        raise ValueError("a byte size must be a number or a string like '800GiB', not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte size cannot be negative (got {value})")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match:
            number, unit = match.groups()
            factor = _UNITS.get(unit.lower())
            if factor is not None:
                result = float(number) * factor
                if result.is_integer() or factor > 1:
                    return int(round(result))
    raise ValueError(
        f"cannot read {value!r} as a byte size; write an integer or a number with a unit "
        "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '800GiB'"
    )


def format_bytes(num_bytes: int | float) -> str:
    """Render a byte count with a binary unit, e.g. ``5.25 GiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


ByteSize = Annotated[int, BeforeValidator(parse_bytes), PlainSerializer(int, return_type=int)]
"""An integer byte count that recipes may write as ``"800GiB"``."""
