"""KVCacheManagerAPI (kv/interface.py): both managers satisfy it, member by member, with the
protocol's parameter names, and the factory builds the one a spec calls for."""

from __future__ import annotations

import inspect

import pytest

from pagedkv.kv.coordinator import HybridKVCacheManager
from pagedkv.kv.factory import make_kv_cache_manager
from pagedkv.kv.hybrid_spec import hybrid_kv_cache_spec
from pagedkv.kv.interface import KVCacheManagerAPI
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.spec import FullAttentionSpec
from tests.kv.conftest import make_request, prefill

SHAPE = dict(block_size=4, num_kv_heads=1, head_size=4, dtype="float32")


def _managers() -> list:
    hybrid = hybrid_kv_cache_spec((None, 8), **SHAPE)
    return [make_kv_cache_manager(FullAttentionSpec(**SHAPE, num_layers=2), num_blocks=16),
            make_kv_cache_manager(hybrid, num_blocks=16, max_num_batched_tokens=8)]


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member)
            for name, member in vars(KVCacheManagerAPI).items()
            if callable(member) and not name.startswith("_")}


def test_factory_builds_the_manager_the_spec_calls_for():
    single, hybrid = _managers()
    assert type(single) is KVCacheManager and type(hybrid) is HybridKVCacheManager
    assert hybrid.max_num_batched_tokens == 8


@pytest.mark.parametrize("index", [0, 1], ids=["single", "hybrid"])
def test_both_managers_satisfy_the_protocol(index: int):
    mgr = _managers()[index]
    assert isinstance(mgr, KVCacheManagerAPI)
    methods = _protocol_methods()
    assert len(methods) >= 25
    for name, sig in methods.items():
        impl = inspect.signature(getattr(type(mgr), name))
        assert list(impl.parameters) == list(sig.parameters), name
    for name in ("num_free_blocks", "usage", "num_pinned_blocks"):
        assert isinstance(getattr(type(mgr), name), property), name
    req = make_request("a", range(1, 10))
    assert prefill(mgr, req)[0] is not None
    assert mgr.get_block_ids("a") and mgr.num_free_blocks < mgr.num_usable_blocks
    mgr.free(req)
    mgr.check_invariants()
