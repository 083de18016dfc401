"""The per-type prefix-hit rule of KV cache groups (vLLM's hybrid KV cache manager).

A prefix of `n` blocks is servable when every group can supply what the tokens after it read:
a full-attention group needs all `n` blocks; a sliding-window group only the
`cdiv(window - 1, block_size)` blocks before the hit point (earlier ones fall out of every later
token's window and stand as the null block). The hit is the longest prefix every group serves.

One function for every place that asks: the device prefix cache (coordinator.py: blocks held
from 0), the KV store's lookup (blocks after a device hit of `start` blocks, held by a tier) and
the outcome of a store load (the blocks that arrived intact).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.utils import cdiv

# present(group index, block index): whether that group's block is available.
Present = Callable[[int, int], bool]


def window_blocks(sliding_window: int | None, block_size: int) -> int | None:
    """Blocks before the hit point a group must hold: None (all of them) for full attention."""
    return None if sliding_window is None else cdiv(sliding_window - 1, block_size)


def longest_servable_prefix(start: int, end: int, needed: Sequence[int | None],
                            present: Present) -> int:
    """The most blocks `n` in [start, end] every group serves, the groups already holding what
    they need of blocks [0, start). `needed[g]`: `window_blocks` of group g. Pure."""
    n = end
    while True:  # a fixed point: lowering n for one group can break another's window
        m = n
        for g, need in enumerate(needed):
            m = _group_serves(g, need, start, m, present)
        if m == n:
            return n
        n = m


def _group_serves(g: int, need: int | None, start: int, end: int, present: Present) -> int:
    """The most blocks (start..end) group g serves, by its type's rule."""
    if need is None:  # full attention: every block
        n = start
        while n < end and present(g, n):
            n += 1
        return n
    if need == 0:
        return end
    run = 0
    for n in range(end, start, -1):  # scan back from the longest candidate
        if not present(g, n - 1):
            run = 0
            continue
        run += 1
        if run >= need:
            return n - 1 + run  # blocks [n - 1, n - 1 + run) are held
    return start + run  # a run from `start`, shorter than the window: the rest is held already
