"""The KV store's tiers (host RAM, disk, Redis) in the simulator: capacities in blocks with LRU
eviction, hits per tier, and load times on the virtual clock. No payloads.

`SimStoreConnector` is the scheduler side of the connector seam with the real
`StoreConnectorScheduler`'s rules (pagedkv/store/connector.py) and the worker side folded in:

- `get_num_new_matched_tokens`: the leading prompt blocks after the device hit that some tier
  holds (the first miss stops; the last prompt token is always computed), looked up once per
  admission (cached on the request), as the real one;
- `update_state_after_alloc`: the load starts now. Its blocks are read tier by tier as
  `TieredKVStore.load` reads them (each block from the fastest tier holding it: hits and
  misses counted per tier, a hit refreshes the block, blocks found below the top tier are
  promoted into the faster ones) and it takes `load_seconds` (per tier: a fixed latency plus
  bytes over bandwidth, tiers read one after another);
- the engine's worker applies a finished load at the start of the first step after it ended,
  and the scheduler runs the request at the step after that: `build_connector_meta` (called at
  the end of `schedule()`, when the real worker starts) marks the loads done by now as applied,
  `take_finished_loads` (the next `schedule()`) hands them over. A step with nothing to run
  waits for the next load (at most `IDLE_WAIT_S`, as the worker does): `idle_wait`;
- every block that becomes full and computed in a step is written through to every tier (the
  saver thread's write-through), counted in the step's shape as `saved_blocks`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.store.lookup import store_matched_tokens
from pagedkv.store.timing import IDLE_WAIT_S

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from pagedkv.kv.manager import KVCacheManager
    from pagedkv.sched.output import SchedulerOutput
    from pagedkv.sched.request import Request


@dataclass(frozen=True)
class TierSpec:
    """One simulated tier: `capacity_blocks` (None: unbounded, as Redis is bounded outside
    pagedkv), its read speed (`latency` seconds per load plus bytes / `bandwidth`), and
    whether all instances share it (Redis) or each has its own (host RAM, local disk)."""

    name: str
    capacity_blocks: int | None
    bandwidth: float
    latency: float = 0.0
    shared: bool = False

    def __post_init__(self) -> None:
        if self.capacity_blocks is not None and self.capacity_blocks < 1:
            raise ValueError(f"tier {self.name!r} holds no block (capacity_blocks="
                             f"{self.capacity_blocks!r})")
        if not self.bandwidth > 0:
            raise ValueError(f"tier {self.name!r} bandwidth must be > 0, got {self.bandwidth!r}")
        if not self.latency >= 0:
            raise ValueError(f"tier {self.name!r} latency must be >= 0, got {self.latency!r}")


# Read speeds when none is given: host RAM (a memcpy), a local NVMe disk, Redis on a LAN.
DEFAULT_TIER_SPEEDS: dict[str, tuple[float, float]] = {  # name -> (bytes/s, latency s)
    "host": (10e9, 20e-6),
    "disk": (2e9, 200e-6),
    "redis": (1e9, 500e-6),
}


@dataclass
class SimTier:
    """A tier's blocks in LRU order (oldest first) and its counters."""

    spec: TierSpec
    blocks: OrderedDict = field(default_factory=OrderedDict)
    hits: int = 0
    misses: int = 0
    blocks_written: int = 0
    evicted: int = 0

    def put(self, block_hash: bytes) -> None:
        """Store a block (a block already held is only refreshed); evicts the LRU one when
        full."""
        blocks = self.blocks
        if block_hash in blocks:
            blocks.move_to_end(block_hash)
            return
        cap = self.spec.capacity_blocks
        if cap is not None and len(blocks) >= cap:
            blocks.popitem(last=False)
            self.evicted += 1
        blocks[block_hash] = None
        self.blocks_written += 1

    def to_dict(self) -> dict:
        return {"name": self.spec.name, "capacity_blocks": self.spec.capacity_blocks,
                "hits": self.hits, "misses": self.misses, "blocks_written": self.blocks_written,
                "evicted": self.evicted, "blocks": len(self.blocks)}


@dataclass
class _Load:
    request: Request
    num_blocks: int  # planned
    done_at: float


@dataclass
class SimStoreMeta:
    """What `StepShape.of` reads of a step's store work (the real metadata's `saves` count)."""

    num_saves: int


class SimStoreConnector:
    """See the module docstring. `clock()` is the instance's virtual time."""

    def __init__(self, tiers: Sequence[TierSpec], kv: KVCacheManager, block_bytes: int,
                 clock: Callable[[], float], shared: dict[str, SimTier] | None = None) -> None:
        """`shared`: the tiers of `shared` specs by name, one object for every instance
        (made here and added to it when missing)."""
        if not tiers:
            raise ValueError("a simulated KV store needs at least one tier")
        if not block_bytes > 0:
            raise ValueError(f"block_bytes must be > 0 (the load times), got {block_bytes!r}")
        shared = {} if shared is None else shared
        self.tiers = [shared.setdefault(spec.name, SimTier(spec)) if spec.shared
                      else SimTier(spec) for spec in tiers]
        self.kv = kv
        self.block_size = kv.block_size
        self.block_bytes = block_bytes
        self.clock = clock
        self._loads: dict[str, _Load] = {}  # request id -> load in flight
        self._applied: list[_Load] = []
        self.num_lookups = 0
        self.num_loaded_tokens = 0
        self.load_seconds = 0.0

    # ---- the scheduler's seam -----------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        tokens, looked_up = store_matched_tokens(request, num_computed_tokens, self.kv,
                                                 self._lookup)
        self.num_lookups += looked_up
        return tokens

    def update_state_after_alloc(self, request: Request, num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        """Read the blocks now (tier counters, promotions) and finish the load later."""
        request.kv_store_lookup = None
        start = num_computed_tokens // self.block_size
        end = start + num_external_tokens // self.block_size
        hashes = self.kv.get_block_hashes(request.request_id)[start:end]
        seconds, num_blocks = self._read(hashes)
        self.load_seconds += seconds
        self._loads[request.request_id] = _Load(request, num_blocks, self.clock() + seconds)

    def take_finished_loads(self) -> list[tuple[Request, int]]:
        applied, self._applied = self._applied, []
        out = []
        for load in applied:
            tokens = load.num_blocks * self.block_size
            self.num_loaded_tokens += tokens
            out.append((load.request, tokens))
        return out

    def request_finished(self, request: Request) -> None:
        self._loads.pop(request.request_id, None)
        self._applied = [ld for ld in self._applied if ld.request is not request]

    @property
    def num_pending_loads(self) -> int:
        return len(self._loads) + len(self._applied)

    def build_connector_meta(self, out: SchedulerOutput, requests: dict[str, Request]
                             ) -> SimStoreMeta | None:
        """Apply the loads done by now; write the step's newly full blocks to every tier."""
        if self._loads:
            self._apply_done(self.clock())
        saved = self._save(out, requests)
        return SimStoreMeta(saved) if saved else None

    # ---- time ---------------------------------------------------------------------------

    def idle_wait(self) -> float:
        """A step that runs nothing waits for the first load to end, at most IDLE_WAIT_S;
        the loads done by then are applied. 0 when no load is in flight."""
        if not self._loads:
            return 0.0
        now = self.clock()
        wait = min(IDLE_WAIT_S, max(0.0, min(ld.done_at for ld in self._loads.values()) - now))
        self._apply_done(now + wait)
        return wait

    def next_load_done(self) -> float | None:
        return min((ld.done_at for ld in self._loads.values()), default=None)

    def _apply_done(self, now: float) -> None:
        done = [rid for rid, ld in self._loads.items() if ld.done_at <= now]
        for rid in done:
            self._applied.append(self._loads.pop(rid))

    # ---- the tiers ----------------------------------------------------------------------

    def _lookup(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if not any(h in tier.blocks for tier in self.tiers):
                break
            n += 1
        return n

    def _read(self, hashes: Sequence[bytes]) -> tuple[float, int]:
        """`TieredKVStore.load`'s reads: tier by tier, the blocks still missing; the leading
        blocks found are promoted into the tiers above the one they came from. Returns the
        seconds the reads take and the leading blocks found (what the load delivers)."""
        found_in = [-1] * len(hashes)
        seconds = 0.0
        for level, tier in enumerate(self.tiers):
            missing = [i for i, lv in enumerate(found_in) if lv < 0]
            if not missing:
                break
            hits = 0
            for i in missing:
                if hashes[i] in tier.blocks:
                    tier.blocks.move_to_end(hashes[i])
                    found_in[i] = level
                    hits += 1
            tier.hits += hits
            tier.misses += len(missing) - hits
            seconds += tier.spec.latency + hits * self.block_bytes / tier.spec.bandwidth
        n = 0
        while n < len(hashes) and found_in[n] >= 0:
            n += 1
        for i in range(n):
            for upper in self.tiers[:found_in[i]]:
                upper.put(hashes[i])
        return seconds, n

    def _save(self, out: SchedulerOutput, requests: dict[str, Request]) -> int:
        """Write through the blocks that become full and computed in this step."""
        bs = self.block_size
        saved = 0
        for scheduled in out.scheduled:
            first = scheduled.start_pos // bs
            end = (scheduled.start_pos + len(scheduled.token_ids)) // bs
            request = requests.get(scheduled.request_id)
            if request is None or end <= first:
                continue
            hashes = self.kv.update_block_hashes(request)
            for h in hashes[first:min(end, len(hashes))]:
                self._put(h)
                saved += 1
        return saved

    def save_block(self, request: Request, index: int) -> None:
        """Write through block `index` of `request` (a quiet-stretch jump's decode block)."""
        self._put(self.kv.update_block_hashes(request)[index])

    def _put(self, block_hash: bytes) -> None:
        for tier in self.tiers:
            tier.put(block_hash)

    def to_dict(self) -> list[dict]:
        return [tier.to_dict() for tier in self.tiers]
