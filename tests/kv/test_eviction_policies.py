"""Eviction policies (LRU, LFU, ARC) against slow, obviously correct reference models.

A state machine drives a real `BlockPool` with each policy through random requests over a few
shared prompts (prefix hits, allocation with eviction, caching, forks, tail-first frees, prefix
cache resets) and mirrors every call on a reference model of the policy's order (plain lists,
sorted on every pop). After every step: the pool's invariants hold (with the live tables), the
free set equals the model's, and every `pop` returned exactly the blocks the model chose. At
every eviction it also checks tail first: a block is never evicted while a block that chains
from it (its successor in some prompt) is still free and cached.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.engine.args import EngineArgs
from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.eviction import EVICTION_POLICIES, ARCEvictionPolicy, make_eviction_policy
from pagedkv.kv.eviction.lfu import MAX_COUNT
from pagedkv.kv.hashing import RequestBlockHasher
from pagedkv.kv.manager import KVCacheManager
from tests.kv.conftest import FakeRequest, prefill

# ---------------------------------------------------------------------- reference models


class RefLRU:
    """Free block ids, next to reuse first; unhashed ones go to the front."""

    def __init__(self, ids: list[int]) -> None:
        self.order = list(ids)

    def add(self, blocks) -> None:
        for b in blocks:
            if b.block_hash is None:
                self.order.insert(0, b.block_id)
            else:
                self.order.append(b.block_id)

    def remove(self, blocks) -> None:
        for b in blocks:
            self.order.remove(b.block_id)

    def access(self, blocks) -> None:
        pass

    def pop(self, n: int, by_id) -> list[int]:
        out, self.order = self.order[:n], self.order[n:]
        return out

    def free_ids(self) -> set[int]:
        return set(self.order)


class RefLFU:
    """Each free block's sort key is (0 if unhashed else its count, freeing sequence)."""

    def __init__(self, ids: list[int]) -> None:
        self.count = dict.fromkeys(ids, 0)
        self.key: dict[int, tuple[int, int]] = {}
        self.seq = 0
        self.unhashed_ids = list(ids)
        for i in ids:
            self.seq += 1
            self.key[i] = (0, self.seq)

    def add(self, blocks) -> None:
        for b in blocks:
            self.seq += 1
            self.key[b.block_id] = (0 if b.block_hash is None
                                    else max(1, self.count[b.block_id]), self.seq)

    def remove(self, blocks) -> None:
        for b in blocks:
            del self.key[b.block_id]

    def access(self, blocks) -> None:
        ceiling = MAX_COUNT
        for b in blocks:
            self.count[b.block_id] = ceiling = min(self.count[b.block_id] + 1, ceiling)

    def pop(self, n: int, by_id) -> list[int]:
        out = sorted(self.key, key=self.key.__getitem__)[:n]
        for i in out:
            del self.key[i]
            self.count[i] = 1
        return out

    def free_ids(self) -> set[int]:
        return set(self.key)


class RefARC:
    """ARC over the free set, written out with lists (see pagedkv/kv/eviction/arc.py)."""

    def __init__(self, ids: list[int]) -> None:
        self.cap = len(ids)
        self.p = 0.0
        self.lists: dict[str, list[int]] = {"U": list(ids), "T1": [], "T2": []}
        self.b1: list[bytes] = []
        self.b2: list[bytes] = []
        self.twice: set[int] = set()
        self.freed_at: dict[int, int] = {}
        self.clock = len(ids)

    def add(self, blocks) -> None:
        dest = ["U"] * len(blocks)
        head_t2 = True
        for i in reversed(range(len(blocks))):
            b = blocks[i]
            if b.block_hash is None:
                continue
            if b.block_hash in self.b1:
                self.b1.remove(b.block_hash)
                self.p = min(self.p + max(1.0, len(self.b2) / (len(self.b1) + 1)), self.cap)
                wants = True
            elif b.block_hash in self.b2:
                self.b2.remove(b.block_hash)
                self.p = max(self.p - max(1.0, len(self.b1) / (len(self.b2) + 1)), 0.0)
                wants = True
            else:
                wants = b.block_id in self.twice
            head_t2 = wants and head_t2
            dest[i] = "T2" if head_t2 else "T1"
        for b, d in zip(blocks, dest, strict=True):
            self.clock += 1
            self.freed_at[b.block_id] = self.clock
            self.lists[d].append(b.block_id)

    def remove(self, blocks) -> None:
        for b in blocks:
            for lst in self.lists.values():
                if b.block_id in lst:
                    lst.remove(b.block_id)

    def access(self, blocks) -> None:
        self.twice.update(b.block_id for b in blocks)

    def pop(self, n: int, by_id) -> list[int]:
        out = []
        while len(out) < n:
            t1, t2 = self.lists["T1"], self.lists["T2"]
            if self.lists["U"]:
                out.append(self.lists["U"].pop(0))
                continue
            if t1 and (not t2 or len(t1) > self.p
                       or self.freed_at[t1[0]] < self.freed_at[t2[0]]):
                victim, ghosts = t1.pop(0), self.b1
            else:
                victim, ghosts = t2.pop(0), self.b2
            block_hash = by_id[victim].block_hash
            if block_hash is not None:
                ghosts.append(block_hash)
                if len(ghosts) > self.cap:
                    ghosts.pop(0)
            out.append(victim)
        self.twice.difference_update(out)
        return out

    def free_ids(self) -> set[int]:
        return {i for lst in self.lists.values() for i in lst}


REFERENCES = {"lru": RefLRU, "lfu": RefLFU, "arc": RefARC}

# ---------------------------------------------------------------------- the state machine

BASES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [7, 7, 7, 7, 7, 7], [5, 6, 5, 6]]


class PolicyMachine(RuleBasedStateMachine):
    """Random pool operations mirrored on the reference model of `policy`."""

    policy = "lru"

    @initialize(num_blocks=st.integers(4, 16), block_size=st.sampled_from([1, 2]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, True, eviction_policy=self.policy)
        self.ref = REFERENCES[self.policy](list(range(1, num_blocks)))
        self.hasher = RequestBlockHasher("sha256", block_size)
        self.by_id = {b.block_id: b for b in self.pool.blocks}
        self.parent: dict[bytes, bytes] = {}  # chained hash -> its parent's hash
        self.tables: dict[int, list] = {}
        self.counter = 0

    def _ready(self) -> bool:
        return hasattr(self, "pool")

    # ------------------------------------------------------------------ rules
    @precondition(_ready)
    @rule(base=st.sampled_from(BASES), cut=st.integers(1, 8), suffix=st.lists(
        st.integers(0, 2), max_size=4), salt=st.sampled_from([None, "s"]))
    def new_request(self, base, cut, suffix, salt) -> None:
        req = FakeRequest("r", base[:cut] + suffix, cache_salt=salt)
        hashes = self.hasher(req, [])
        for i in range(1, len(hashes)):
            self.parent[hashes[i]] = hashes[i - 1]
        hits = []
        for h in hashes:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        num_new = -(-req.num_tokens // self.hasher.block_size) - len(hits)
        free_after_hits = self.pool.get_num_free_blocks() - sum(b.ref_cnt == 0 for b in hits)
        if num_new > free_after_hits:
            return
        self.ref.remove([b for b in hits if b.ref_cnt == 0])
        self.pool.touch(hits)
        self.ref.access(hits)
        new = self._pop_with_hashes(num_new)
        table = hits + new
        self.pool.cache_full_blocks(table, hashes, len(hits), len(hashes),
                                    self.hasher.block_size)
        self.counter += 1
        self.tables[self.counter] = table

    def _pop_with_hashes(self, n: int) -> list:
        expected = self.ref.pop(n, self.by_id)
        free_before = self.pool.eviction.free_blocks()
        free_cached = {b.block_hash for b in free_before if b.block_hash is not None}
        popped_hashes = [self.by_id[i].block_hash for i in expected]
        blocks = self.pool.get_new_blocks(n)
        assert [b.block_id for b in blocks] == expected
        evicted: set[bytes] = set()
        for block_hash in popped_hashes:  # in eviction order
            if block_hash is None:
                continue
            for child, parent in self.parent.items():
                assert not (parent == block_hash and child in free_cached
                            and child not in evicted), \
                    f"prefix {block_hash.hex()[:8]} evicted before its successor {child.hex()[:8]}"
            evicted.add(block_hash)
        return blocks

    @precondition(lambda self: self._ready() and self.tables)
    @rule(data=st.data())
    def free_request(self, data) -> None:
        key = data.draw(st.sampled_from(sorted(self.tables)))
        table = self.tables.pop(key)
        freed = [b for b in reversed(table) if b.ref_cnt == 1]
        self.pool.free_blocks(reversed(table))
        self.ref.add(freed)

    @precondition(lambda self: self._ready() and self.tables)
    @rule(data=st.data())
    def fork(self, data) -> None:
        key = data.draw(st.sampled_from(sorted(self.tables)))
        table = list(self.tables[key])
        self.pool.touch(table)
        self.ref.access(table)
        self.counter += 1
        self.tables[self.counter] = table

    @precondition(lambda self: self._ready() and not self.tables)
    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.pool.reset_prefix_cache()

    # ------------------------------------------------------------------ checks
    @invariant()
    def pool_matches_model(self) -> None:
        if not self._ready():
            return
        self.pool.check_invariants(list(self.tables.values()))
        free = {b.block_id for b in self.pool.eviction.free_blocks()}
        assert free == self.ref.free_ids()
        if self.policy == "lfu":  # its free_blocks() is the exact eviction order
            assert [b.block_id for b in self.pool.eviction.free_blocks()] == \
                sorted(self.ref.key, key=self.ref.key.__getitem__)


class LRUMachine(PolicyMachine):
    policy = "lru"


class LFUMachine(PolicyMachine):
    policy = "lfu"


class ARCMachine(PolicyMachine):
    policy = "arc"


_SETTINGS = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestLRUAgainstModel = LRUMachine.TestCase
TestLRUAgainstModel.settings = _SETTINGS
TestLFUAgainstModel = LFUMachine.TestCase
TestLFUAgainstModel.settings = _SETTINGS
TestARCAgainstModel = ARCMachine.TestCase
TestARCAgainstModel.settings = _SETTINGS


# ---------------------------------------------------------------------- named behaviour


def test_registry_and_bad_names():
    assert sorted(EVICTION_POLICIES) == ["arc", "lfu", "lru"]
    pool = BlockPool(5, True, eviction_policy="arc")
    assert isinstance(pool.eviction, ARCEvictionPolicy)
    with pytest.raises(ValueError, match="eviction_policy.*'mru'"):
        BlockPool(5, True, eviction_policy="mru")
    with pytest.raises(ValueError, match="eviction_policy.*'LRU'"):
        make_eviction_policy("LRU", [])
    with pytest.raises(ValueError, match="eviction_policy.*'fifo'"):
        EngineArgs(model="x", eviction_policy="fifo")
    with pytest.raises(ValueError, match="eviction_policy"):
        KVCacheManager(num_blocks=8, block_size=2, eviction_policy="")


def _hot_then_scan(policy: str) -> tuple[int, int]:
    """A hot prompt used 3 times, then one-off prompts filling the cache twice over, then the
    hot prompt again: returns (its hit tokens, the pool's free blocks at the end)."""
    m = KVCacheManager(num_blocks=9, block_size=2, eviction_policy=policy)
    hot = [9, 9, 9, 9, 9, 9, 1]  # 3 full blocks + 1 token
    for i in range(3):
        req = FakeRequest(f"hot{i}", hot)
        prefill(m, req)
        m.free(req)
        m.check_invariants()
    for i in range(8):  # 8 one-off prompts of 2 full blocks each: 2x the 8-block pool
        req = FakeRequest(f"scan{i}", [100 + i, i, 200 + i, i, 7])
        prefill(m, req)
        m.free(req)
        m.check_invariants()
    _, hit = prefill(m, FakeRequest("hot-again", hot))
    m.check_invariants()
    return hit, m.num_free_blocks


@pytest.mark.parametrize(("policy", "expected_hit"), [("lru", 0), ("lfu", 6), ("arc", 6)])
def test_scan_resistance(policy, expected_hit):
    """LRU loses a hot prefix to a scan; LFU and ARC keep it (its blocks were used 3 times)."""
    hit, _ = _hot_then_scan(policy)
    assert hit == expected_hit


@pytest.mark.parametrize(("policy", "arc_p"), [("lru", 0), ("lfu", 0), ("arc", 0), ("arc", 11)])
def test_request_tail_evicted_first(policy, arc_p):
    """A request that hit a shared prefix and computed its own tail: once everything is free,
    evictions take its tail blocks before the prefix, last block first. Under ARC the prefix
    is in T2 and the tail in T1, whether p protects T2 (0) or not (11: recency mode)."""
    m = KVCacheManager(num_blocks=12, block_size=2, eviction_policy=policy)
    if policy == "arc":
        m.pool.eviction.p = float(arc_p)
    shared = [1, 2, 3, 4]  # 2 blocks
    first = FakeRequest("a", shared + [5, 6, 7, 8, 0])
    prefill(m, first)
    second = FakeRequest("b", shared + [9, 9, 8, 8, 0])  # hits the 2 shared blocks
    _, hit = prefill(m, second)
    assert hit == 4
    prefix = m.get_blocks("b")[:2]
    tail = m.get_blocks("b")[2:4]
    m.free(first)
    m.free(second)
    m.check_invariants()
    order = []
    while m.pool.cached_block_hash_to_block:
        block = m.pool.get_new_blocks(1)[0]
        order.append(block)
    position = {b.block_id: i for i, b in enumerate(order)}
    assert position[tail[1].block_id] < position[tail[0].block_id] < \
        position[prefix[1].block_id] < position[prefix[0].block_id]


def test_lfu_counts_never_exceed_their_prefix():
    """A block whose prefix block was recomputed (count back to 1) is clamped on the next hit."""
    m = KVCacheManager(num_blocks=6, block_size=2, eviction_policy="lfu")
    lfu = m.pool.eviction
    req = FakeRequest("a", [1, 2, 3, 4, 0])
    prefill(m, req)
    first, second = m.get_blocks("a")[:2]
    for i in range(3):  # three more hits
        r = FakeRequest(f"h{i}", [1, 2, 3, 4, 0])
        prefill(m, r)
        m.free(r)
    assert (lfu.counts[first.block_id], lfu.counts[second.block_id]) == (4, 4)
    lfu.counts[first.block_id] = 1  # as if the first block had been recomputed
    r = FakeRequest("h", [1, 2, 3, 4, 0])
    prefill(m, r)
    assert (lfu.counts[first.block_id], lfu.counts[second.block_id]) == (2, 2)
    m.free(r)
    m.free(req)
    m.check_invariants()


def test_arc_ghost_hits_adapt_p():
    """Recomputing blocks ARC evicted from T1 grows p (they join T2); recomputing blocks it
    evicted from T2 shrinks p."""
    m = KVCacheManager(num_blocks=5, block_size=1, eviction_policy="arc")
    arc = m.pool.eviction

    def run(rid, prompt):
        req = FakeRequest(rid, prompt)
        prefill(m, req)
        m.free(req)
        m.check_invariants()

    run("once", [1, 2])  # 2 cached blocks, used once: T1
    assert (arc.t1_size, arc.t2_size, arc.p) == (2, 0, 0)
    run("fill", [5, 6, 7, 8])  # needs all 4 blocks: the T1 pair goes to ghost list B1
    assert len(arc.ghosts[2]) == 2 and not arc.ghosts[3]
    run("again", [1, 2])  # recomputed and freed: two ghost hits in B1
    assert arc.p == 2 and arc.t2_size == 2
    run("fill2", [8, 8, 8, 8])  # evicts the rest of T1, then T2: ghosts in B2
    assert len(arc.ghosts[3]) == 2
    run("back", [1, 2])  # two ghost hits in B2
    assert arc.p == 0 and arc.t2_size == 2


def test_arc_scan_resistance_fixed_case():
    """A working set hit once more (so: used twice) survives a one-off scan twice the size of
    the cache, step by step: the scan's blocks enter T1 and leave it for ghost list B1, the
    working set stays whole in T2, p stays 0; LRU loses the working set to the same scan. A
    second pass of the scan (recomputing blocks ARC evicted from T1: recency pays) grows p."""
    def run(m, rid, prompt, keep=None):
        req = FakeRequest(rid, prompt)
        _, hit = prefill(m, req)
        if keep is not None:
            keep.extend(m.get_blocks(rid)[:3])
        m.free(req)
        m.check_invariants()
        return hit

    hot = [9, 8, 7, 6, 5, 4, 0]  # 3 full blocks of 2 tokens, + 1 token
    scans = [[100 + i, i, 200 + i, i, 0] for i in range(10)]  # 2 full blocks each: 20 > 10
    lru = KVCacheManager(num_blocks=11, block_size=2, eviction_policy="lru")
    m = KVCacheManager(num_blocks=11, block_size=2, eviction_policy="arc")
    arc = m.pool.eviction
    hot_blocks: list = []
    for manager in (lru, m):
        assert run(manager, "hot", hot) == 0
        assert run(manager, "hot-hit", hot, hot_blocks if manager is m else None) == 6
    assert (arc.t1_size, arc.t2_size, arc.p) == (0, 3, 0.0)
    for i, prompt in enumerate(scans):
        for manager in (lru, m):
            assert run(manager, f"scan{i}", prompt) == 0
        assert arc.t2_size == 3 and arc.p == 0.0 and not arc.ghosts[3]  # T2 untouched
        assert all(m.pool.get_cached_block(b.block_hash) is b for b in hot_blocks)
        assert arc.t1_size == min(2 * (i + 1), 7 - 1)  # 7 blocks left, 1 for the partial
    # Every evicted scan block went to B1 (14 of them; B1 keeps the newest 10).
    assert len(arc.ghosts[2]) == 10 and not arc.ghosts[3]
    assert run(lru, "hot-again", hot) == 0
    assert run(m, "hot-again", hot) == 6
    # A scan prompt again: both its blocks are in B1 (evicted from T1 too soon), so p grows
    # and the recomputed blocks join T2.
    assert run(m, "rescan6", scans[6]) == 0
    assert arc.p >= 2 and arc.t2_size == 5


def test_arc_scan_resistance_once_recency_has_paid():
    """p > 0 (recomputing blocks evicted from T1 grew it to 2) and T2 holds only those 2 blocks:
    ARC still evicts T1 while T1 holds more than p blocks, so a following one-off scan twice the
    cache's size leaves the twice-used blocks cached."""
    m = KVCacheManager(num_blocks=11, block_size=2, eviction_policy="arc")
    arc = m.pool.eviction

    def run(rid, prompt):
        req = FakeRequest(rid, prompt)
        _, hit = prefill(m, req)
        m.free(req)
        m.check_invariants()
        return hit

    warm = [1, 2, 3, 4, 0]  # 2 full blocks
    run("warm", warm)
    for i in range(5):  # evicts warm's blocks from T1 into B1
        run(f"fill{i}", [50 + i, i, 60 + i, i, 0])
    assert m.get_computed_blocks(FakeRequest("probe", warm))[1] == 0
    assert run("warm-again", warm) == 0  # recomputed: two ghost hits in B1
    assert arc.p == 2.0 and arc.t2_size == 2
    for i in range(10):  # a scan of 20 blocks through a 10-block cache
        assert run(f"scan{i}", [100 + i, i, 200 + i, i, 0]) == 0
        assert arc.t2_size == 2 and arc.p == 2.0
    assert run("warm-hit", warm) == 4
