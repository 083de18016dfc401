"""A backend's turnover (kv_aware.py): the new blocks the router sent it, decaying over the
window, over its pool size; Router.begin records them and Router.route snapshots them."""

from __future__ import annotations

import math

import pytest

from pagedkv.router.backend import Backend
from pagedkv.router.policies import RouteRequest, make_policy
from pagedkv.router.policies.kv_aware import KVAwareWeights
from pagedkv.router.router import Router

HASHES = tuple(bytes([i]) * 32 for i in range(10))


def test_written_blocks_decay_over_the_window():
    b = Backend("http://a.test", kv_info={"num_gpu_blocks": 100})
    b.record_written(40, now=10.0, window_s=30.0)
    assert b.turnover(10.0, 30.0) == pytest.approx(0.4)
    assert b.turnover(40.0, 30.0) == pytest.approx(0.4 * math.exp(-1))
    b.record_written(10, now=40.0, window_s=30.0)
    assert b.written_blocks == pytest.approx(40 * math.exp(-1) + 10)
    assert b.turnover(40.0, 30.0) == pytest.approx((40 * math.exp(-1) + 10) / 100)
    b.record_written(-5, now=40.0, window_s=30.0)  # never negative work
    assert b.written(40.0, 30.0) == pytest.approx(40 * math.exp(-1) + 10)


@pytest.mark.parametrize("info", [None, {}, {"num_gpu_blocks": 0}, {"num_gpu_blocks": "8"},
                                  {"num_gpu_blocks": True}])
def test_no_turnover_without_a_pool_size(info):
    b = Backend("http://a.test", kv_info=info)
    b.record_written(40, now=0.0, window_s=30.0)
    assert b.turnover(0.0, 30.0) == 0.0


def test_router_sends_a_new_prompt_where_the_cache_turns_over_least():
    backends = [Backend(f"http://b{i}.test", up=True, kv_info={"num_gpu_blocks": 100})
                for i in range(3)]
    router = Router(backends, make_policy("kv-aware"), hash_settings=(4, "sha256"),
                    weights=KVAwareWeights(turnover_window_s=1e6))  # no decay here
    for backend in backends:
        router.set_kv_info(backend, {"block_size": 4, "prefix_caching_hash_algo": "sha256",
                                     "num_gpu_blocks": 100})
    # Three cold 10-block prompts, each ended at once: they land on b0, b1, b2 in turn (the
    # tie-break rotation) and each backend wrote 10 blocks.
    for k in range(3):
        request = RouteRequest(prompt_tokens=40, block_hashes=tuple(
            bytes([k, i]) * 16 for i in range(10)))
        backend, candidate = router.route(request)
        router.begin(backend, request, candidate).end()
        assert backend is backends[k]
    # b1 takes 30 more new blocks; now a cold prompt avoids it, and the snapshot says why.
    big = RouteRequest(prompt_tokens=120, block_hashes=tuple(bytes([9, i]) * 16
                                                             for i in range(30)))
    router.begin(backends[1], big, backends[1].candidate(router.index.match(
        backends[1].name, big.block_hashes, None))).end()
    seen = []
    for k in range(3):
        request = RouteRequest(prompt_tokens=40, block_hashes=tuple(
            bytes([5 + k, i]) * 16 for i in range(10)))
        backend, candidate = router.route(request)
        seen.append(backends.index(backend))
        router.begin(backend, request, candidate).end()
    assert 1 not in seen[:2]
    turnovers = [c["turnover"] for c in router.decisions.records[3]["candidates"]]
    assert turnovers[1] == pytest.approx(0.4, rel=1e-3)
    assert turnovers[0] == pytest.approx(0.1, rel=1e-3)
