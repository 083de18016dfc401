"""Small helpers shared by every package (torch-free)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: the blocks `a` tokens fill at `b` tokens a block."""
    return -(-a // b)
