"""Byte sizes as operators write them (`4GiB`, `1.5 TiB`, `500MB`) and as tables show them (`4 GiB`).

Parsing is exact (fractions, not floats): a size that is not a whole number of bytes is refused rather
than silently rounded, so a quota or an instance is never a few bytes off what was typed.
"""

from __future__ import annotations

import re
from fractions import Fraction

UNITS: dict[str, int] = {
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_HINT = "expected a number and a unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. 4GiB"


def parse_size(text: str) -> int:
    """Bytes in `text`: a bare integer is bytes; units are case-insensitive; raise ValueError otherwise."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"invalid size {text!r}: {_HINT}")
    number, unit = m.groups()
    scale = UNITS.get(unit.lower() or "b")
    if scale is None:
        raise ValueError(f"invalid size {text!r}: unknown unit {unit!r}; {_HINT}")
    value = Fraction(number) * scale
    if value.denominator != 1:
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    return int(value)


def format_size(n: int) -> str:
    """`n` bytes in the largest binary unit it reaches: `4 GiB`, `1.5 GiB`, `512 B`."""
    value = Fraction(n)
    unit = 0
    while abs(value) >= 1024 and unit < len(_BINARY) - 1:
        value /= 1024
        unit += 1
    shown = str(int(value)) if value.denominator == 1 else f"{float(value):.1f}"
    return f"{shown} {_BINARY[unit]}"
