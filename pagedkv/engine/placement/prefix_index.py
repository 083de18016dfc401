"""Which backend holds which KV block, learned from KV events or from the router's own record.

The index maps, per backend and per medium ("GPU" for the device pool, "CPU"/"DISK"/"REDIS" for
offload tiers, as in `pagedkv.events.wire`), chained block hashes to an expiry time. Entries from
KV events never expire (a `BlockRemoved` event removes them); entries the router records itself
when it sends a prompt somewhere expire after a TTL, since no event will say they were evicted.
Each backend's device entries are also capped at its pool size (when known), dropping the least
recently stored first: the record then mirrors the engine's LRU eviction.

Whatever a backend's events say, what the index keeps of it is bounded: at most
`max_medium_blocks` entries per medium (the device's pool-size cap too is at most that), the
least recently stored dropped first, and at most `max_media` media per backend and model (a
new medium past that drops the one stored to longest ago). A block dropped here is a prefix
the router no longer credits: a cost in routing quality, never in correctness.

Entries are keyed per model as well (`model`: the served model id, None when unknown): block
hashes carry no model identity, so a prompt hashed for one model must never match blocks another
model computed (on a shared tier, or on a backend serving several models).

Blocks in a *shared* medium (a Redis tier every backend can load from) are kept under
`SHARED`, so they count for every backend serving that model. A match is a pair: the leading blocks on the
backend's device, then the further leading blocks it could load from a tier (its own host or
disk tier, or a shared one). Hashes chain, so only a run from the first block counts, exactly as
the engine's longest-prefix lookup.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from pagedkv.events.wire import MEDIUM_DEVICE, MEDIUM_REDIS, ExternalBlockHash

SHARED = ""  # the pseudo-backend holding blocks of shared tiers
NEVER = math.inf
# About 130 bytes an entry beside its 32-byte hash: some 50 MiB per full medium.
DEFAULT_MAX_MEDIUM_BLOCKS = 1 << 18
DEFAULT_MAX_MEDIA = 6  # GPU, CPU, DISK, REDIS and room to spare


@dataclass(frozen=True)
class PrefixMatch:
    """The leading blocks of a prompt a backend holds on its device (`device_blocks`), then the
    blocks after those it can load from an offload tier (`tier_blocks`)."""

    device_blocks: int = 0
    tier_blocks: int = 0


class PrefixIndex:
    """Per (backend, model), per medium: block hash -> expiry (time.monotonic seconds, or NEVER).

    Not thread-safe: the router mutates it from its event loop only.
    """

    def __init__(self, *, shared_media: Collection[str] = (MEDIUM_REDIS,),
                 clock: Callable[[], float] = time.monotonic,
                 max_medium_blocks: int = DEFAULT_MAX_MEDIUM_BLOCKS,
                 max_media: int = DEFAULT_MAX_MEDIA) -> None:
        if max_medium_blocks < 1 or max_media < 1:
            raise ValueError(f"max_medium_blocks and max_media must be >= 1, got "
                             f"{max_medium_blocks!r} and {max_media!r}")
        self.shared_media = frozenset(shared_media)
        self.clock = clock
        self.max_medium_blocks = max_medium_blocks
        self.max_media = max_media
        # Media in the order they were last stored to (the first is the next one dropped).
        self._held: dict[tuple[str, str | None],
                         OrderedDict[str, OrderedDict[ExternalBlockHash, float]]] = {}
        self._capacity: dict[str, int] = {}

    # ---- updates ------------------------------------------------------------------------

    def set_capacity(self, backend: str, num_blocks: int | None) -> None:
        """Cap `backend`'s device entries at `num_blocks` (None: no cap)."""
        if num_blocks is None:
            self._capacity.pop(backend, None)
        else:
            self._capacity[backend] = max(int(num_blocks), 0)

    def store(self, backend: str, block_hashes: Iterable[ExternalBlockHash],
              medium: str | None = MEDIUM_DEVICE, ttl_s: float | None = None,
              model: str | None = None) -> None:
        """Record that `backend` holds `block_hashes` of `model` on `medium`; for `ttl_s`
        seconds, or until removed when `ttl_s` is None. A longer-lived entry is never shortened
        by a shorter one."""
        medium = medium or MEDIUM_DEVICE
        owner = SHARED if medium in self.shared_media else backend
        entries = self._medium(owner, model, medium)
        expiry = NEVER if ttl_s is None else self.clock() + ttl_s
        cap = self.max_medium_blocks
        if medium == MEDIUM_DEVICE:
            cap = min(cap, self._capacity.get(owner, cap))
        for block_hash in block_hashes:
            old = entries.pop(block_hash, 0.0)
            entries[block_hash] = max(old, expiry)
            if len(entries) > cap:
                entries.popitem(last=False)

    def _medium(self, owner: str, model: str | None,
                medium: str) -> OrderedDict[ExternalBlockHash, float]:
        """`owner`'s entries of `model` on `medium` (made when new, dropping the medium stored
        to longest ago past `max_media`), now the most recently stored medium."""
        media = self._held.setdefault((owner, model), OrderedDict())
        entries = media.get(medium)
        if entries is None:
            entries = media[medium] = OrderedDict()
            while len(media) > self.max_media:
                media.popitem(last=False)
        media.move_to_end(medium)
        return entries

    def remove(self, backend: str, block_hashes: Iterable[ExternalBlockHash],
               medium: str | None = MEDIUM_DEVICE, model: str | None = None) -> None:
        """Forget that `backend` (or the shared tier, for a shared medium) holds these blocks
        of `model`."""
        medium = medium or MEDIUM_DEVICE
        owner = SHARED if medium in self.shared_media else backend
        entries = self._held.get((owner, model), {}).get(medium)
        if entries is not None:
            for block_hash in block_hashes:
                entries.pop(block_hash, None)

    def clear(self, backend: str) -> None:
        """Forget everything `backend` holds, for every model (its own media; shared tiers
        stay)."""
        for key in [key for key in self._held if key[0] == backend]:
            del self._held[key]

    def prune(self) -> int:
        """Drop expired entries; returns how many."""
        now = self.clock()
        dropped = 0
        for media in self._held.values():
            for entries in media.values():
                dead = [h for h, expiry in entries.items() if expiry <= now]
                for block_hash in dead:
                    del entries[block_hash]
                dropped += len(dead)
        return dropped

    # ---- queries ------------------------------------------------------------------------

    def num_blocks(self, backend: str, medium: str = MEDIUM_DEVICE,
                   model: str | None = None) -> int:
        """Entries (expired ones not yet pruned included) `backend` has of `model` on `medium`."""
        return len(self._held.get((backend, model), {}).get(medium, ()))

    def match(self, backend: str, block_hashes: Sequence[ExternalBlockHash],
              model: str | None = None) -> PrefixMatch:
        """The leading run of `block_hashes` (of `model`) on `backend`'s device, then the run
        after it held by one of its tiers or a shared tier (entries of that model only)."""
        now = self.clock()
        media = self._held.get((backend, model), {})
        device = media.get(MEDIUM_DEVICE, {})
        tiers = [entries for medium, entries in media.items() if medium != MEDIUM_DEVICE]
        tiers += list(self._held.get((SHARED, model), {}).values())
        n = len(block_hashes)
        on_device = 0
        while on_device < n and device.get(block_hashes[on_device], 0.0) > now:
            on_device += 1
        in_tier = on_device
        while in_tier < n and any(t.get(block_hashes[in_tier], 0.0) > now for t in tiers):
            in_tier += 1
        return PrefixMatch(device_blocks=on_device, tier_blocks=in_tier - on_device)
