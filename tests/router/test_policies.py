"""Routing policies as pure functions: exact picks for given snapshots, no network."""

from __future__ import annotations

import pytest

from pagedkv.router.policies import Candidate, RouteRequest, make_policy
from pagedkv.router.policies.kv_aware import KVAwarePolicy, KVAwareWeights, cost, overloaded
from pagedkv.router.prefix_index import PrefixMatch

HASHES = tuple(bytes([i]) * 32 for i in range(10))  # a 10-block prompt


def cands(*specs: dict) -> list[Candidate]:
    return [Candidate(name=f"b{i}", **spec) for i, spec in enumerate(specs)]


def test_cost_formula_term_by_term():
    w = KVAwareWeights(prefill_weight=2.0, tier_weight=0.25, load_weight=3.0,
                       request_weight=5.0, usage_weight=7.0, eviction_weight=11.0)
    req = RouteRequest(prompt_tokens=45, block_hashes=HASHES)
    c = Candidate(name="b", in_flight=1, queued_blocks=4.0, running=2, waiting=1, kv_usage=0.5,
                  match=PrefixMatch(device_blocks=6, tier_blocks=4), turnover=0.25)
    # new blocks = 10 - 6 - 0.25 * 4 = 3; requests = max(1, 2 + 1) = 3
    assert cost(req, c, w) == pytest.approx(
        2.0 * 3 + 11.0 * 0.25 * 3 + 3.0 * 4.0 + 5.0 * 3 + 7.0 * 0.5)


def test_a_cold_prompt_goes_where_the_cache_turns_over_least():
    policy = KVAwarePolicy()
    req = RouteRequest(prompt_tokens=40, block_hashes=HASHES)
    # No backend holds it, loads are even: the one whose cache is rewritten the slowest wins,
    # every time (rotation alone would spread it over all three).
    c = cands({"turnover": 0.9}, {"turnover": 0.2}, {"turnover": 0.6})
    assert [policy.choose(req, c) for _ in range(4)] == [1] * 4
    # ... and the term is in blocks: 10 * (1 + 0.9) = 19 loses to 10 * (1 + 0.2) + 2 * 2 = 16
    # (two requests on b1), not to 16 + 4 queued blocks = 20.
    c = cands({"turnover": 0.9}, {"turnover": 0.2, "in_flight": 2})
    assert policy.choose(req, c) == 1
    c = cands({"turnover": 0.9}, {"turnover": 0.2, "in_flight": 2, "queued_blocks": 4.0})
    assert policy.choose(req, c) == 0


def test_a_warm_prompt_keeps_its_backend_however_busy_its_cache():
    policy = KVAwarePolicy()
    req = RouteRequest(prompt_tokens=40, block_hashes=HASHES)
    # b0 holds 9 of 10 blocks but rewrites its cache fast: 1 * (1 + 2) = 3 beats a cold 10.
    c = cands({"turnover": 2.0, "match": PrefixMatch(9)}, {})
    assert policy.choose(req, c) == 0
    # Without the term (eviction_weight 0) turnover changes nothing.
    flat = KVAwarePolicy(KVAwareWeights(eviction_weight=0.0))
    c = cands({"turnover": 0.9}, {"turnover": 0.2}, {"turnover": 0.6})
    assert sorted(flat.choose(req, c) for _ in range(3)) == [0, 1, 2]


def test_kv_aware_prefers_the_prefix_holder_when_load_is_even():
    policy = KVAwarePolicy()
    req = RouteRequest(prompt_tokens=40, block_hashes=HASHES)
    c = cands({}, {"match": PrefixMatch(device_blocks=8)}, {"match": PrefixMatch(3)})
    assert [policy.choose(req, c) for _ in range(5)] == [1] * 5


def test_kv_aware_trades_hit_against_queued_work():
    policy = KVAwarePolicy()
    req = RouteRequest(prompt_tokens=40, block_hashes=HASHES)
    # b1 holds 8 blocks (saves 8) but has 12 blocks of prefill queued and one request:
    # cost b0 = 10, b1 = 2 + 12 + 2 = 16.
    c = cands({}, {"match": PrefixMatch(8), "queued_blocks": 12.0, "in_flight": 1})
    assert policy.choose(req, c) == 0
    # With 5 queued blocks it pays off: b1 = 2 + 5 + 2 = 9 < 10.
    c = cands({}, {"match": PrefixMatch(8), "queued_blocks": 5.0, "in_flight": 1})
    assert policy.choose(req, c) == 1


def test_tier_hit_counts_less_than_a_device_hit():
    policy = KVAwarePolicy(KVAwareWeights(tier_weight=0.5))
    req = RouteRequest(prompt_tokens=40, block_hashes=HASHES)
    c = cands({"match": PrefixMatch(0, 8)}, {"match": PrefixMatch(6, 0)}, {})
    assert policy.choose(req, c) == 1  # 10 - 6 = 4 beats 10 - 0.5 * 8 = 6
    c = cands({"match": PrefixMatch(0, 8)}, {"match": PrefixMatch(3, 0)}, {})
    assert policy.choose(req, c) == 0  # 6 beats 7 and 10


def test_imbalance_guard_stops_a_hot_prefix_piling_up():
    w = KVAwareWeights(imbalance_factor=1.5, imbalance_slack=2)
    policy = KVAwarePolicy(w)
    req = RouteRequest(prompt_tokens=40, block_hashes=HASHES)
    hot = {"match": PrefixMatch(10), "in_flight": 3}
    # 3 requests > 1.5 * mean (1) and 3 more than the least loaded: excluded.
    assert overloaded(cands(hot, {}, {}), w) == [True, False, False]
    assert policy.choose(req, cands(hot, {}, {})) in (1, 2)
    # 2 in flight is within the slack: the holder still wins on cost.
    warm = {"match": PrefixMatch(10), "in_flight": 2}
    assert overloaded(cands(warm, {}, {}), w) == [False, False, False]
    assert policy.choose(req, cands(warm, {}, {})) == 0
    # Everyone equally busy: nobody is excluded.
    assert overloaded(cands({"in_flight": 5}, {"in_flight": 5}), w) == [False, False]


def test_scraped_load_counts_when_larger_than_the_routers():
    c = Candidate(name="b", in_flight=1, running=4, waiting=3)
    assert c.requests == 7
    assert Candidate(name="b", in_flight=5, running=1).requests == 5


def test_ties_rotate_and_prefer_fewer_requests():
    policy = KVAwarePolicy()
    req = RouteRequest()  # no hashes: all costs equal but load
    assert [policy.choose(req, cands({}, {}, {})) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    least = make_policy("least-load")
    assert least.choose(req, cands({"in_flight": 2}, {"running": 1}, {"in_flight": 1})) == 1


def test_round_robin_cycles():
    policy = make_policy("round-robin")
    assert [policy.choose(RouteRequest(), cands({}, {}, {})) for _ in range(4)] == [0, 1, 2, 0]


def test_session_is_sticky_and_moves_only_the_lost_backends_sessions():
    policy = make_policy("session")
    three = cands({}, {}, {})
    sessions = [f"user-{i}" for i in range(30)]
    picks = {s: three[policy.choose(RouteRequest(session=s), three)].name for s in sessions}
    again = {s: three[policy.choose(RouteRequest(session=s), three)].name for s in sessions}
    assert picks == again
    assert len(set(picks.values())) == 3
    two = [three[0], three[2]]  # b1 went down
    moved = {s: two[policy.choose(RouteRequest(session=s), two)].name for s in sessions}
    assert all(moved[s] == picks[s] for s in sessions if picks[s] != "b1")


def test_bad_weights_and_names_are_value_errors():
    with pytest.raises(ValueError, match="prefill_weight"):
        KVAwareWeights(prefill_weight=-1)
    with pytest.raises(ValueError, match="tier_weight"):
        KVAwareWeights(tier_weight=1.5)
    with pytest.raises(ValueError, match="imbalance_factor"):
        KVAwareWeights(imbalance_factor=0.5)
    with pytest.raises(ValueError, match="turnover_window_s"):
        KVAwareWeights(turnover_window_s=0)
    with pytest.raises(ValueError, match="eviction_weight"):
        KVAwareWeights(eviction_weight=float("nan"))
    with pytest.raises(ValueError, match="'nope'"):
        make_policy("nope")
