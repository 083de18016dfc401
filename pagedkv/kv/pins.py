"""Pinned prefixes: cached prompt prefixes whose device blocks are never evicted while pinned.

A pin holds one reference on each of its blocks, exactly as a request's block table does, so a
pinned block is never in the eviction policy's free set: no policy can evict it, and the pool's
invariants need no new rule (the pins are passed to `check_invariants` as extra block tables).

A prompt (token ids plus `cache_salt`) is hashed exactly like a request's (the manager's
`RequestBlockHasher`: full blocks only, the salt in the first block). `pin` takes the leading
run of those blocks that is in the device prefix cache NOW; it computes nothing (the engine
runs the prompt first when it must, see `LLMEngine.pin_prefix`). A prompt is identified by the
hash of its last full block: pinning the same prompt again replaces its pin (e.g. with a longer
cached run), `unpin` releases it (blocks freed tail first, and evictable again).

At most `max_blocks` distinct blocks may be pinned (a block shared by two pins counts once);
a pin that would exceed it raises ValueError naming `max_pinned_fraction` and changes nothing.

With KV cache groups (`window_blocks`: one entry per group, hit_rule.py) a pin takes the longest
cached prefix every group serves and holds, per group, what a hit there needs: every block of
a full-attention group, the window's last blocks of a sliding one (its earlier blocks are never
read again by a request continuing the prefix).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.hashing import BlockHash, RequestBlockHasher, group_key_suffix
from pagedkv.kv.hit_rule import longest_servable_prefix


def check_max_pinned_fraction(value: object) -> float:
    """`value` when it is a number in [0, 1) (the share of usable blocks pins may hold);
    ValueError naming max_pinned_fraction otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"max_pinned_fraction must be in [0, 1), got {value!r}")
    return float(value)


def max_pinned_blocks(max_pinned_fraction: float, num_usable_blocks: int) -> int:
    """How many distinct blocks pins may hold in a pool of `num_usable_blocks`."""
    return int(check_max_pinned_fraction(max_pinned_fraction) * num_usable_blocks)


class NotPinnedError(ValueError):
    """`unpin` of a prompt that has no pin (the server answers 404)."""


@dataclass(frozen=True)
class PinInfo:
    """What a pin or unpin did. `pin_id` is the hex hash of the prompt's last full block."""

    pin_id: str
    num_blocks: int  # blocks this pin holds (0 after an unpin; with KV cache groups, all's)
    num_tokens: int  # the prefix it serves (one group: num_blocks * block_size)
    num_prompt_blocks: int  # full blocks in the prompt (num_blocks < this: the rest is not cached)
    total_pinned_blocks: int  # distinct blocks pinned by every pin, after this call

    def to_dict(self) -> dict:
        return {"pin_id": self.pin_id, "num_blocks": self.num_blocks,
                "num_tokens": self.num_tokens, "num_prompt_blocks": self.num_prompt_blocks,
                "total_pinned_blocks": self.total_pinned_blocks}


@dataclass
class _Prompt:
    """What the hasher reads from a request."""

    all_token_ids: list[int]
    cache_salt: str | None
    lora_name: str | None = None


class PrefixPins:
    """The pins of one device pool. Mutates the pool's ref counts (and so its free set)."""

    def __init__(self, pool: BlockPool, hasher: RequestBlockHasher, max_blocks: int,
                 window_blocks: Sequence[int | None] | None = None) -> None:
        """`window_blocks`: KV cache groups' (module docstring); None for one group."""
        self.pool = pool
        self.hasher = hasher
        self.max_blocks = max_blocks
        self.window_blocks = None if window_blocks is None else list(window_blocks)
        self._pins: dict[BlockHash, list[KVCacheBlock]] = {}
        self._refs: dict[int, int] = {}  # block_id -> how many pins hold it
        self._num_tokens: dict[BlockHash, int] = {}  # pin -> the prefix tokens it serves

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by pins."""
        return len(self._refs)

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    def is_pinned(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._refs

    def pinned_blocks(self) -> set[KVCacheBlock]:
        blocks = self.pool.blocks
        return {blocks[i] for i in self._refs}

    def tables(self) -> list[list[KVCacheBlock]]:
        """Each pin's blocks (extra block tables for the pool's invariant check)."""
        return list(self._pins.values())

    def _hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        hashes = self.hasher(_Prompt(list(token_ids), cache_salt), [])
        if not hashes:
            raise ValueError(f"a prompt of {len(token_ids)} tokens has no full block of "
                             f"{self.hasher.block_size} tokens to pin")
        return hashes

    def _cached_run(self, hashes: list[BlockHash]) -> tuple[list[KVCacheBlock], int]:
        """The blocks a pin of the leading cached run of `hashes` holds, and the run's length
        in blocks (with KV cache groups: every group's blocks for the longest prefix all of
        them serve)."""
        get = self.pool.get_cached_block
        if self.window_blocks is not None:
            return self._grouped_run(hashes)
        blocks: list[KVCacheBlock] = []
        for block_hash in hashes:
            block = get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks)

    def _grouped_run(self, hashes: list[BlockHash]) -> tuple[list[KVCacheBlock], int]:
        get = self.pool.get_cached_block
        suffixes = [group_key_suffix(g) for g in range(len(self.window_blocks))]
        n = longest_servable_prefix(0, len(hashes), self.window_blocks,
                                    lambda g, i: get(hashes[i] + suffixes[g]) is not None)
        blocks = [get(hashes[i] + suffixes[g])
                  for g, need in enumerate(self.window_blocks)
                  for i in range(0 if need is None else max(n - need, 0), n)]
        return blocks, n

    def is_cached(self, token_ids: Sequence[int], cache_salt: str | None = None) -> bool:
        """Whether every full block of the prompt is in the prefix cache now (a pin would
        take them all). ValueError for a prompt without a full block."""
        hashes = self._hashes(token_ids, cache_salt)
        return self._cached_run(hashes)[1] == len(hashes)

    def pin(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PinInfo:
        """Pin the leading cached run of the prompt's full blocks (replacing this prompt's
        earlier pin). Raises ValueError for a prompt without a full block or past the bound."""
        hashes = self._hashes(token_ids, cache_salt)
        blocks, num_run = self._cached_run(hashes)
        key = hashes[-1]
        old = self._pins.get(key, [])
        released = {b.block_id for b in old if self._refs[b.block_id] == 1}
        after = (set(self._refs) - released) | {b.block_id for b in blocks}
        if len(after) > self.max_blocks:
            raise ValueError(
                f"pinning {len(blocks)} blocks would pin {len(after)} blocks in all, more than "
                f"max_pinned_fraction allows ({self.max_blocks} of {self.pool.num_usable_blocks})")
        self.pool.touch(blocks)
        for block in blocks:
            self._refs[block.block_id] = self._refs.get(block.block_id, 0) + 1
        self._pins[key] = blocks
        if old:
            self._release(old)
        if not blocks:
            del self._pins[key]
        self._observe(blocks)
        if blocks:
            self._num_tokens[key] = num_run * self.hasher.block_size
        else:
            self._num_tokens.pop(key, None)
        return self._info(key, blocks, len(hashes))

    def unpin(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PinInfo:
        """Release the prompt's pin (its blocks are freed tail first: cached and evictable
        again). Raises NotPinnedError when the prompt is not pinned."""
        hashes = self._hashes(token_ids, cache_salt)
        blocks = self._pins.pop(hashes[-1], None)
        if blocks is None:
            raise NotPinnedError("this prompt (with this cache_salt) is not pinned")
        self._release(blocks)
        self._num_tokens.pop(hashes[-1], None)
        return self._info(hashes[-1], [], len(hashes))

    def _release(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            left = self._refs[block.block_id] - 1
            if left:
                self._refs[block.block_id] = left
            else:
                del self._refs[block.block_id]
        self.pool.free_blocks(reversed(blocks))
        self._observe(blocks)

    def _observe(self, blocks: list[KVCacheBlock]) -> None:
        """Tell the pool's observer (if any) the pin counts of `blocks` now."""
        observer = self.pool.observer
        if observer is not None and blocks:
            ids = [b.block_id for b in blocks]
            observer.on_pins(ids, [self._refs.get(i, 0) for i in ids])

    def pin_counts(self) -> dict[int, int]:
        """{block_id: how many pins hold it} (a copy)."""
        return dict(self._refs)

    def _info(self, key: BlockHash, blocks: list[KVCacheBlock], num_prompt_blocks: int) -> PinInfo:
        return PinInfo(pin_id=key.hex(), num_blocks=len(blocks),
                       num_tokens=self._num_tokens.get(key, 0) if blocks else 0,
                       num_prompt_blocks=num_prompt_blocks,
                       total_pinned_blocks=self.num_pinned_blocks)

    def check_invariants(self, fail: Callable[[str], None]) -> None:
        """Each pinned block is cached and in use, and `_refs` counts the pins holding it."""
        counts: dict[int, int] = {}
        for blocks in self._pins.values():
            for block in blocks:
                counts[block.block_id] = counts.get(block.block_id, 0) + 1
                if block.block_hash is None or block.ref_cnt < 1:
                    fail(f"pinned block {block.block_id} is not cached and held: {block!r}")
        if counts != self._refs:
            fail(f"pin reference counts {self._refs} != the pins' blocks {counts}")
        if len(counts) > self.max_blocks:
            fail(f"{len(counts)} blocks pinned, more than the bound {self.max_blocks}")
