"""A backend whose /kv_cache_info is partial or odd never keeps the router down (issue 43):
it is marked (no prefix credit, the reason in the fleet view) and requests still reach it and
the others."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pagedkv.router.backend import Backend
from pagedkv.router.policies import RouteRequest, make_policy
from pagedkv.router.router import Router
from tests.router.fake_backend import FakeBackend
from tests.router.test_faults import post_all, router_server

pytestmark = pytest.mark.timeout(60, method="thread")

GOOD = {"block_size": 4, "prefix_caching_hash_algo": "sha256", "num_gpu_blocks": 64,
        "enable_prefix_caching": True}
ODD = [
    ({k: v for k, v in GOOD.items() if k != "num_gpu_blocks"}, "lacks num_gpu_blocks"),
    ({**GOOD, "num_gpu_blocks": None}, "num_gpu_blocks=None"),
    ({**GOOD, "num_gpu_blocks": "64"}, "num_gpu_blocks='64'"),
    ({**GOOD, "num_gpu_blocks": True}, "num_gpu_blocks=True"),
    ({**GOOD, "block_size": 0}, "block_size=0"),
    ({**GOOD, "block_size": 4.5}, "block_size=4.5"),
    ({**GOOD, "prefix_caching_hash_algo": 7}, "prefix_caching_hash_algo=7"),
    ({**GOOD, "enable_prefix_caching": "yes"}, "enable_prefix_caching='yes'"),
    ([1, 2], "a list, not a JSON object"),
    ("sha256", "a str, not a JSON object"),
]
HASHES = tuple(bytes([i]) * 32 for i in range(3))


@pytest.mark.parametrize(("info", "problem"), ODD)
def test_an_odd_answer_gets_no_prefix_credit_and_says_why(info, problem):
    good, odd = Backend("http://good.test", up=True), Backend("http://odd.test", up=True)
    router = Router([good, odd], make_policy("kv-aware"))
    router.set_kv_info(good, GOOD)
    router.set_kv_info(odd, info)
    assert odd.kv_problem is not None and problem in odd.kv_problem
    assert not odd.hash_compatible and not odd.native_hashes
    assert good.kv_problem is None and good.hash_compatible
    # Its blocks would be a full hit, yet its match is empty: no prefix credit.
    router.index.store(odd.name, HASHES)
    _, candidate = router.route(RouteRequest(prompt_tokens=12, block_hashes=HASHES),
                                exclude=[good.name])
    assert candidate.match.device_blocks == 0
    # Fixed on the next round: the mark goes.
    router.set_kv_info(odd, GOOD)
    assert odd.kv_problem is None and odd.hash_compatible


@pytest.mark.parametrize("kv_info", [ODD[0][0], {"num_gpu_blocks": None}, ["odd"]])
def test_the_router_starts_and_routes_beside_a_backend_with_odd_kv_info(kv_info):
    with FakeBackend("ok", kv_info=kv_info) as odd, FakeBackend("ok", kv_info=GOOD) as good:
        router, server = router_server(odd, good)
        with server:  # the lifespan's first health round applies both answers
            answers = asyncio.run(post_all(server.url, [{"prompt": "x", "model": "tiny"}] * 4))
            fleet = httpx.get(server.url + "/dashboard/fleet", timeout=10).json()
        assert [resp.status_code for resp, _ in answers] == [200] * 4
        assert {resp.headers["x-pagedkv-backend"] for resp, _ in answers} == {odd.url, good.url}
        problems = {b["name"]: b["kv_problem"] for b in fleet["backends"]}
        assert problems[good.url] is None
        assert problems[odd.url].startswith("/kv_cache_info ")
        assert router.backend(odd.url).up and not router.backend(odd.url).hash_compatible
