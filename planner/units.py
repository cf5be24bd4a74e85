"""Byte sizes: parse ``"80GiB"`` / ``"141GB"`` / ``1024`` and print them back."""

from __future__ import annotations

import math
import re
from types import MappingProxyType

_UNITS = MappingProxyType({
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
})
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int | float) -> int:
    """Return ``value`` in bytes.  Accepts ints and strings like ``"80GiB"``, ``"141 GB"``, ``"512MiB"``.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary units (KiB, MiB, GiB, TiB) powers of 1024.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size such as 80GiB, got {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"a byte size must be a finite number >= 0, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a byte size such as 80GiB or an integer, got {value!r}")
    match = _PATTERN.match(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read {value!r} as a byte size: write a number with an optional unit "
            f"(B, kB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '80GiB' or '141GB'"
        )
    size = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(size):
        raise ValueError(f"cannot read {value!r} as a byte size: the number is too large")
    return int(size)


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
