"""Memory sizes: parse "80GiB", "4GB", "512MiB", "1.5G" or plain byte counts; format bytes.

Units (case-insensitive, optional space between number and unit):

- binary: KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40; the single letters K, M, G, T
  mean the same binary units (as in `free -g` or `docker --memory 80g`);
- decimal: KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12 (as disk vendors and SI count);
- B or no unit: bytes.

So "80GiB" == "80G" == 85_899_345_920 bytes, while "80GB" == 80_000_000_000 bytes.
"""

from __future__ import annotations

import math
import re

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")

GiB = 2**30


def parse_size(value: str | int, *, name: str = "size") -> int:
    """Return `value` as a whole number of bytes (fractions round down).

    Accepts a non-negative int or a string like "80GiB", "4 GB", "512MiB", "1.5G", "1024".
    Raises ValueError naming `name` and the bad value otherwise.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size like '80GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must not be negative, got {value!r}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a size like '80GiB', got {value!r}")
    match = _SIZE_RE.match(value)
    if match is None:
        raise ValueError(f"{name} must be a size like '80GiB', '4GB' or '1024', got {value!r}")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(
            f"{name} has an unknown unit {unit!r} in {value!r} "
            "(use B, KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, GB or TB)"
        )
    if "." in number:
        return math.floor(float(number) * factor)
    return int(number) * factor


def format_size(num_bytes: int | float) -> str:
    """Format a byte count with a binary unit: 512 -> '512 B', 2097152 -> '2.00 MiB'."""
    sign = "-" if num_bytes < 0 else ""
    size = abs(num_bytes)
    if size < 1024:
        return f"{sign}{int(size)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            return f"{sign}{size:.2f} {unit}"
    raise AssertionError("unreachable")
