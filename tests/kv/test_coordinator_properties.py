"""Property test of the KV cache group coordinator (kv/coordinator.py) against a slow model.

As test_properties.py does for one manager: a fake device and host memory where each slot
stores the identity of the K/V written there, now per group (group index + the tokens up to
that position: each group holds different layers). Writes follow each group's table; copies
(copy-on-write, swap) are applied as the runner would. After every step: the shared pool's
invariants, every group's table reads back the request's own K/V at every position its
attention type still needs (all of them for a full group, the window's for a sliding group),
and a prefix hit hands every group blocks holding exactly the probe's K/V, also a sub-block
hit (`prefix_match_unit=1`), whose partial blocks every group gets a copy of.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.kv.coordinator import HybridKVCacheManager
from pagedkv.kv.hybrid_spec import hybrid_kv_cache_spec
from tests.kv.conftest import FakeRequest

BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], [1, 2, 3, 4, 7, 7, 7, 7], [5, 5, 5, 5, 5, 5]]


class GroupedKVMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([2, 4]), num_blocks=st.integers(10, 40),
                num_host=st.integers(0, 16), window=st.sampled_from([2, 3, 5, 8]),
                layers=st.sampled_from([(None, 3), (None, 3, 3), (3, None, 3, 3, 3, 3)]),
                unit=st.sampled_from([None, 1]))
    def setup(self, block_size, num_blocks, num_host, window, layers, unit):
        self.bs = block_size
        self.unit = unit
        windows = tuple(None if w is None else window for w in layers)
        spec = hybrid_kv_cache_spec(windows, block_size=block_size, num_kv_heads=1,
                                    head_size=4, dtype="float32")
        self.m = HybridKVCacheManager(spec, num_blocks=num_blocks, num_host_blocks=num_host,
                                      enable_kv_cache_events=True, prefix_match_unit=unit)
        self.windows = [g.sliding_window for g in spec.groups]
        self.dev: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.live: dict[str, FakeRequest] = {}
        self.counter = 0

    def _identity(self, g: int, req: FakeRequest, pos: int):
        return (g, tuple(req.all_token_ids[:pos + 1]))

    def _needed(self, g: int, req: FakeRequest, upto: int) -> range:
        """Positions group g must still hold for the next token after `upto` computed."""
        w = self.windows[g]
        return range(0 if w is None else max(0, upto - w + 1), upto)

    def _write(self, req: FakeRequest, start: int, end: int) -> None:
        for src, dst in self.m.take_block_copies():
            self.dev[dst] = list(self.dev[src])
        for g, table in enumerate(self.m.get_group_block_ids(req.request_id)):
            for pos in range(start, end):
                bid = table[pos // self.bs]
                assert bid != 0, f"group {g} writes position {pos} into the null block"
                self.dev.setdefault(bid, [None] * self.bs)[pos % self.bs] = \
                    self._identity(g, req, pos)

    def _step(self, req: FakeRequest, num_new: int, use_hits: bool) -> bool:
        hits, n = (self.m.get_computed_blocks(req) if use_hits and req.num_computed_tokens == 0
                   else (None, 0))
        assert n % (self.unit or self.bs) == 0 and (n == 0 or n <= req.num_tokens - 1)
        num_new = min(num_new, req.num_tokens - req.num_computed_tokens - n)
        if self.m.allocate_slots(req, num_new, hits, n) is None:
            return False
        start = req.num_computed_tokens + n
        self._write(req, start, start + num_new)
        req.num_computed_tokens = start + num_new
        return True

    def _pick(self, data, swapped: bool | None = False) -> FakeRequest:
        rids = sorted(r for r in self.live if swapped is None or self.m.is_swapped(r) == swapped)
        return self.live[data.draw(st.sampled_from(rids))]

    def _has(self, swapped: bool) -> bool:
        return hasattr(self, "m") and any(self.m.is_swapped(r) == swapped for r in self.live)

    @rule(base=st.sampled_from(BASES), cut=st.integers(1, 12),
          suffix=st.lists(st.integers(0, 3), max_size=6), chunk=st.integers(1, 20))
    def add_request(self, base, cut, suffix, chunk):
        self.counter += 1
        req = FakeRequest(f"r{self.counter}", base[:cut] + suffix or [0])
        if not self._step(req, chunk, True):
            self.m.free(req)
            return
        self.live[req.request_id] = req

    @precondition(lambda self: self._has(swapped=False))
    @rule(data=st.data(), token=st.integers(0, 3), chunk=st.integers(1, 20))
    def step(self, data, token, chunk):
        req = self._pick(data)
        if req.num_computed_tokens == req.num_tokens:
            req.append(token)
            if not self._step(req, 1, False):
                req.all_token_ids.pop()
        else:
            self._step(req, chunk, False)

    @precondition(lambda self: self._has(swapped=False))
    @rule(data=st.data())
    def fork(self, data):
        parent = self._pick(data)
        self.counter += 1
        child = FakeRequest(f"r{self.counter}", parent.all_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.m.fork(parent, child)
        assert self.m.get_group_block_ids(child.request_id) == \
            self.m.get_group_block_ids(parent.request_id)
        self.live[child.request_id] = child

    @precondition(lambda self: hasattr(self, "m") and self.live)
    @rule(data=st.data())
    def free(self, data):
        req = self._pick(data, swapped=None)
        self.m.free(req)
        del self.live[req.request_id]
        assert self.m.get_group_block_ids(req.request_id) == [[] for _ in self.windows]

    @precondition(lambda self: self._has(swapped=False) and self.m.host_pool is not None)
    @rule(data=st.data())
    def swap_out(self, data):
        req = self._pick(data)
        if not self.m.can_swap_out(req):
            return
        live = sorted(b for t in self.m.get_group_block_ids(req.request_id) for b in t if b)
        mapping = self.m.swap_out(req)
        assert sorted(d for d, _ in mapping) == live
        for d, h in mapping:
            self.host[h] = list(self.dev.get(d, [None] * self.bs))

    @precondition(lambda self: self._has(swapped=True))
    @rule(data=st.data())
    def swap_in(self, data):
        req = self._pick(data, swapped=True)
        if not self.m.can_swap_in(req):
            return
        for h, d in self.m.swap_in(req):
            self.dev[d] = list(self.host[h])

    @precondition(lambda self: hasattr(self, "m") and self.live)
    @rule(data=st.data())
    def lookup(self, data):
        """Every group's hit blocks hold the probe's K/V where that group still needs it."""
        req = self._pick(data, swapped=None)
        probe = FakeRequest("probe", req.all_token_ids)
        hits, n = self.m.get_computed_blocks(probe)
        for g in range(len(self.windows)):
            if n == 0:
                assert hits[g] == []
                continue
            assert len(hits[g]) == -(-n // self.bs)  # a sub-block hit's block last
            for pos in self._needed(g, probe, n):
                block = hits[g][pos // self.bs]
                assert not block.is_null
                assert self.dev[block.block_id][pos % self.bs] == self._identity(g, probe, pos)
        self.m.free(probe)

    @invariant()
    def pool_invariants(self):
        if hasattr(self, "m"):
            self.m.check_invariants()
            for ev in self.m.take_events():
                if hasattr(ev, "group_idx"):
                    assert ev.kv_cache_spec_kind == ("full_attention"
                                                     if self.windows[ev.group_idx] is None
                                                     else "sliding_window")

    @invariant()
    def every_group_reads_back_its_own_kv(self):
        if not hasattr(self, "m"):
            return
        for rid, req in self.live.items():
            swapped = self.m.is_swapped(rid)
            for g, group in enumerate(self.m.groups):
                ids = group.get_host_block_ids(rid) if swapped else group.get_block_ids(rid)
                mem = self.host if swapped else self.dev
                assert len(ids) * self.bs >= req.num_computed_tokens
                for pos in self._needed(g, req, req.num_computed_tokens):
                    bid = ids[pos // self.bs]
                    assert bid != 0, f"group {g} lost position {pos} of {rid}"
                    assert mem[bid][pos % self.bs] == self._identity(g, req, pos)


TestGroupedKV = GroupedKVMachine.TestCase
TestGroupedKV.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
