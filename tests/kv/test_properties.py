"""Property tests: random interleavings of KV-manager operations against a reference model.

The model tracks what the KV memory must hold: a fake device and host memory where each slot
stores the identity of the K/V written there (cache salt + every token up to that position, since
K/V depend on the whole prefix). Writes follow the block tables the manager hands out; the
(src, dst) copies for copy-on-write and swap are applied as a runner would. After every step:
the manager's invariants hold, each request's table matches the model's (ids, ref counts, free
counts), and every computed position of every request reads back its own K/V. A wrong prefix
hit, a missed copy or a block shared by mistake shows up as wrong memory contents.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.kv.eviction import EVICTION_POLICIES
from pagedkv.kv.manager import AllocStatus, KVCacheManager
from pagedkv.kv.pins import NotPinnedError
from tests.kv.conftest import FakeRequest

BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 7, 7, 7, 7], [5, 5, 5, 5, 5, 5]]


class KVMachine(RuleBasedStateMachine):
    sliding_window: int | None = None
    prefix_match_unit: int | None = None  # sub-block prefix hits (partial_hits.py)

    @initialize(block_size=st.sampled_from([2, 4]), num_blocks=st.integers(6, 24),
                num_host=st.integers(0, 10), watermark=st.sampled_from([0.0, 0.1]),
                algo=st.sampled_from(["sha256", "xxhash"]),
                policy=st.sampled_from(sorted(EVICTION_POLICIES)))
    def setup(self, block_size, num_blocks, num_host, watermark, algo, policy):
        self.bs = block_size
        self.m = KVCacheManager(num_blocks=num_blocks, block_size=block_size,
                                num_host_blocks=num_host, watermark=watermark, hash_algo=algo,
                                sliding_window=self.sliding_window,
                                enable_kv_cache_events=True, eviction_policy=policy,
                                max_pinned_fraction=0.5,
                                prefix_match_unit=self.prefix_match_unit)
        # pin_id -> (tokens, salt, blocks its pin holds); prompts with the same full blocks
        # share one pin (a later pin replaces the earlier one)
        self.pinned: dict[str, tuple] = {}
        self.dev: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.live: dict[str, FakeRequest] = {}
        self.counter = 0

    # ------------------------------------------------------------------ model helpers
    def _identity(self, req: FakeRequest, pos: int):
        return (req.cache_salt, tuple(req.all_token_ids[:pos + 1]))

    def _write(self, req: FakeRequest, start: int, end: int) -> None:
        for src, dst in self.m.take_block_copies():
            self.dev[dst] = list(self.dev[src])
        table = self.m.get_block_ids(req.request_id)
        for pos in range(start, end):
            bid = table[pos // self.bs]
            assert bid != 0, f"write into the null block at position {pos}"
            self.dev.setdefault(bid, [None] * self.bs)[pos % self.bs] = self._identity(req, pos)

    def _step(self, req: FakeRequest, num_new: int, use_hits: bool, delay: bool) -> bool:
        hits, n = (self.m.get_computed_blocks(req) if use_hits and req.num_computed_tokens == 0
                   else ([], 0))
        assert n % (self.prefix_match_unit or self.bs) == 0 and n <= req.num_tokens - 1 or n == 0
        num_new = min(num_new, req.num_tokens - req.num_computed_tokens - n)
        before = self.m.get_block_ids(req.request_id)
        new = self.m.allocate_slots(req, num_new, hits, n, delay_cache_blocks=delay)
        if new is None:
            after = self.m.get_block_ids(req.request_id)
            # Nothing changes, except that blocks wholly outside the sliding window of
            # position num_computed_tokens are freed first (any call would free them).
            skipped = 0 if self.sliding_window is None else \
                max(0, req.num_computed_tokens - self.sliding_window + 1) // self.bs
            assert after == [0 if i < skipped else b for i, b in enumerate(before)]
            return False
        start = req.num_computed_tokens + n
        self._write(req, start, start + num_new)
        req.num_computed_tokens = start + num_new
        if delay:
            self.m.cache_blocks(req, req.num_computed_tokens)
        return True

    def _pick(self, data, swapped: bool | None = False) -> FakeRequest:
        rids = sorted(rid for rid in self.live
                      if swapped is None or self.m.is_swapped(rid) == swapped)
        return self.live[data.draw(st.sampled_from(rids))]

    def _has(self, swapped: bool) -> bool:
        return hasattr(self, "m") and any(self.m.is_swapped(r) == swapped for r in self.live)

    # ------------------------------------------------------------------ rules
    @rule(base=st.sampled_from(BASES), cut=st.integers(1, 9),
          suffix=st.lists(st.integers(0, 3), max_size=6), salt=st.sampled_from([None, None, "s"]),
          chunk=st.integers(1, 20), delay=st.booleans())
    def add_request(self, base, cut, suffix, salt, chunk, delay):
        self.counter += 1
        req = FakeRequest(f"r{self.counter}", base[:cut] + suffix or [0], cache_salt=salt)
        status = self.m.can_allocate(req)
        if status is AllocStatus.NEVER:
            # (pinned blocks are out of reach: no prefix hits were passed to can_allocate)
            assert -(-req.num_tokens // self.bs) > (self.m.num_usable_blocks
                                                    - self.m.num_pinned_blocks
                                                    - self.m.watermark_blocks)
        if not self._step(req, chunk, True, delay):
            self.m.free(req)  # forget the hashes of a request that stays waiting
            return
        self.live[req.request_id] = req

    @precondition(lambda self: self._has(swapped=False))
    @rule(data=st.data(), token=st.integers(0, 3), chunk=st.integers(1, 20), delay=st.booleans())
    def step(self, data, token, chunk, delay):
        req = self._pick(data)
        if req.num_computed_tokens == req.num_tokens:  # decode: sample one token
            req.append(token)
            if not self._step(req, 1, False, delay):
                req.all_token_ids.pop()
        else:  # continue a chunked prefill
            self._step(req, chunk, False, delay)

    @precondition(lambda self: self._has(swapped=False))
    @rule(data=st.data())
    def fork(self, data):
        parent = self._pick(data)
        self.counter += 1
        child = FakeRequest(f"r{self.counter}", parent.all_token_ids,
                            cache_salt=parent.cache_salt)
        child.num_computed_tokens = parent.num_computed_tokens
        self.m.fork(parent, child)
        assert self.m.get_block_ids(child.request_id) == self.m.get_block_ids(parent.request_id)
        self.live[child.request_id] = child

    @precondition(lambda self: hasattr(self, "m") and self.live)
    @rule(data=st.data())
    def free(self, data):
        req = self._pick(data, swapped=None)
        self.m.free(req)
        del self.live[req.request_id]
        assert self.m.get_block_ids(req.request_id) == []
        assert not self.m.is_swapped(req.request_id)

    @precondition(lambda self: self._has(swapped=False) and self.m.host_pool is not None)
    @rule(data=st.data())
    def swap_out(self, data):
        req = self._pick(data)
        if not self.m.can_swap_out(req):
            return
        device_ids = self.m.get_block_ids(req.request_id)
        mapping = self.m.swap_out(req)
        assert [d for d, _ in mapping] == [b for b in device_ids if b != 0]
        assert [h for h in self.m.get_host_block_ids(req.request_id) if h != 0] == \
            [h for _, h in mapping]
        for d, h in mapping:
            self.host[h] = list(self.dev.get(d, [None] * self.bs))

    @precondition(lambda self: self._has(swapped=True))
    @rule(data=st.data())
    def swap_in(self, data):
        req = self._pick(data, swapped=True)
        if not self.m.can_swap_in(req):
            return
        hashes = list(self.m.get_block_hashes(req.request_id))
        for h, d in self.m.swap_in(req):
            self.dev[d] = list(self.host[h])
        assert self.m.get_block_hashes(req.request_id) == hashes

    @precondition(lambda self: hasattr(self, "m") and self.m.pool.cached_block_hash_to_block)
    @rule()
    def reset_prefix_cache(self):
        idle = self.m.num_free_blocks == self.m.num_usable_blocks - self.m.num_pinned_blocks
        assert self.m.reset_prefix_cache() is idle

    @precondition(lambda self: hasattr(self, "m") and self.live)
    @rule(data=st.data())
    def lookup(self, data):
        """A prefix hit must return blocks that hold exactly this prompt's K/V."""
        req = self._pick(data, swapped=None)
        probe = FakeRequest("probe", req.all_token_ids, cache_salt=req.cache_salt)
        hits, n = self.m.get_computed_blocks(probe)
        for pos in range(n):
            assert self.dev[hits[pos // self.bs].block_id][pos % self.bs] == \
                self._identity(probe, pos)
        self.m.free(probe)

    @precondition(lambda self: hasattr(self, "m") and self.live)
    @rule(data=st.data())
    def pin(self, data):
        """Pin a live request's computed prefix: only cached blocks, up to the bound."""
        req = self._pick(data, swapped=None)
        tokens = tuple(req.all_token_ids[:req.num_computed_tokens])
        if len(tokens) < self.bs:
            return
        before = self.m.num_pinned_blocks
        try:
            info = self.m.pin_prefix(tokens, req.cache_salt)
        except ValueError as exc:
            assert "max_pinned_fraction" in str(exc)
            assert self.m.num_pinned_blocks == before
            return
        assert info.num_prompt_blocks == len(tokens) // self.bs
        assert info.total_pinned_blocks == self.m.num_pinned_blocks <= self.m.pins.max_blocks
        if info.num_blocks:
            self.pinned[info.pin_id] = (tokens, req.cache_salt, info.num_blocks)
        else:
            self.pinned.pop(info.pin_id, None)

    @precondition(lambda self: hasattr(self, "m") and self.pinned)
    @rule(data=st.data())
    def unpin(self, data):
        tokens, salt, _ = self.pinned.pop(data.draw(st.sampled_from(sorted(self.pinned))))
        info = self.m.unpin_prefix(tokens, salt)
        assert info.num_blocks == 0
        try:
            self.m.unpin_prefix(tokens, salt)
        except NotPinnedError:
            pass
        else:
            raise AssertionError("a second unpin must fail")

    # ------------------------------------------------------------------ checks
    @invariant()
    def pinned_blocks_hold_their_prompts(self):
        """A pinned prefix is never evicted: its blocks still hold its K/V, under its hashes."""
        if not hasattr(self, "m"):
            return
        for tokens, salt, n in self.pinned.values():
            probe = FakeRequest("pin-probe", list(tokens) + [0], cache_salt=salt)
            hits, _ = self.m.get_computed_blocks(probe)
            assert len(hits) >= n
            for pos in range(n * self.bs):
                assert self.dev[hits[pos // self.bs].block_id][pos % self.bs] == \
                    self._identity(probe, pos)
            self.m.free(probe)

    @invariant()
    def manager_invariants(self):
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        self.m.take_events()

    @invariant()
    def tables_and_memory_match_model(self):
        if not hasattr(self, "m"):
            return
        counts: dict[int, int] = {}
        host_counts: dict[int, int] = {}
        window = self.sliding_window
        for rid, req in self.live.items():
            if self.m.is_swapped(rid):
                ids, mem = self.m.get_host_block_ids(rid), self.host
                for h in ids:
                    if h:
                        host_counts[h] = host_counts.get(h, 0) + 1
            else:
                ids, mem = self.m.get_block_ids(rid), self.dev
                for b in ids:
                    if b:
                        counts[b] = counts.get(b, 0) + 1
            assert len(ids) * self.bs >= req.num_computed_tokens
            for pos in range(req.num_computed_tokens):
                bid = ids[pos // self.bs]
                if bid == 0:
                    # Only blocks wholly outside the window may be null.
                    assert window is not None and (pos // self.bs + 1) * self.bs <= \
                        req.num_computed_tokens - window + 1
                    continue
                assert mem[bid][pos % self.bs] == self._identity(req, pos), (rid, pos)
        for table in [*self.m.pins.tables(), self.m.held_copy_sources()]:
            for b in table:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1
        pool = self.m.pool
        for b in pool.blocks[1:]:
            assert b.ref_cnt == counts.get(b.block_id, 0)
        assert self.m.num_free_blocks == self.m.num_usable_blocks - len(counts)
        if self.m.host_pool is not None:
            assert self.m.host_pool.get_num_free_blocks() == \
                self.m.host_pool.num_usable_blocks - len(host_counts)


class SlidingWindowKVMachine(KVMachine):
    sliding_window = 4


class SubBlockHitsKVMachine(KVMachine):
    prefix_match_unit = 1


SETTINGS = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestKVManagerStateful = KVMachine.TestCase
TestKVManagerStateful.settings = SETTINGS
TestSlidingWindowStateful = SlidingWindowKVMachine.TestCase
TestSlidingWindowStateful.settings = settings(max_examples=100, stateful_step_count=50,
                                              deadline=None)
TestSubBlockHitsStateful = SubBlockHitsKVMachine.TestCase
TestSubBlockHitsStateful.settings = settings(max_examples=100, stateful_step_count=50,
                                             deadline=None)
