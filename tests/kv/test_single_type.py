"""The manager's per-attention-type block policies, chosen from the KV cache spec."""

from __future__ import annotations

from pagedkv.config import HFModelConfig
from pagedkv.kv.factory import make_kv_cache_manager
from pagedkv.kv.hf_spec import kv_cache_spec_from_hf_config
from pagedkv.kv.single_type import FullAttentionPolicy, SlidingWindowPolicy
from pagedkv.kv.spec import FullAttentionSpec, SlidingWindowSpec
from tests.kv.conftest import decode, make_request, prefill

SHAPE = dict(block_size=4, num_kv_heads=2, head_size=8, dtype="float32", num_layers=2)


def test_make_kv_cache_manager_picks_the_policy():
    full = make_kv_cache_manager(FullAttentionSpec(**SHAPE), num_blocks=16)
    sliding = make_kv_cache_manager(SlidingWindowSpec(**SHAPE, sliding_window=8),
                                    num_blocks=16)
    assert type(full.block_policy) is FullAttentionPolicy and full.sliding_window is None
    assert type(sliding.block_policy) is SlidingWindowPolicy and sliding.sliding_window == 8
    assert sliding.block_size == 4
    # Mixed layers (Qwen2 max_window_layers): one KV cache group per attention type, each
    # with its type's policy (group size 1 here: 1 full layer, 2 sliding ones).
    mixed = {"model_type": "qwen2", "num_hidden_layers": 3, "num_attention_heads": 2,
             "head_dim": 8, "sliding_window": 8, "use_sliding_window": True,
             "max_window_layers": 1}
    assert HFModelConfig.from_dict(mixed).layer_sliding_windows == (None, 8, 8)
    spec = kv_cache_spec_from_hf_config(mixed, block_size=4)
    groups = make_kv_cache_manager(spec, num_blocks=16).groups
    assert [type(g.block_policy) for g in groups] == [FullAttentionPolicy, SlidingWindowPolicy,
                                                      SlidingWindowPolicy]
    assert [g.sliding_window for g in groups] == [None, 8, 8]


def test_sliding_window_policy_nulls_and_frees_out_of_window_blocks():
    mgr = make_kv_cache_manager(SlidingWindowSpec(**SHAPE, sliding_window=8), num_blocks=16)
    req = make_request("a", range(1, 13))  # 12 tokens: 3 blocks
    prefill(mgr, req)
    for t in range(4):  # positions 12..15; computing position 15 needs 8..15 only
        decode(mgr, req, 100 + t)
    ids = mgr.get_block_ids("a")
    assert len(ids) == 4 and ids[:2] == [0, 0] and 0 not in ids[2:]  # positions 0..7 nulled
    assert mgr.num_free_blocks == 15 - 2
    mgr.check_invariants()
    assert list(mgr.block_policy.blocks_to_free(mgr.get_blocks("a"))) == \
        list(reversed(mgr.get_blocks("a")[2:]))
    mgr.free(req)
    assert mgr.num_free_blocks == 15
    mgr.check_invariants()


def test_full_attention_policy_keeps_every_block():
    mgr = make_kv_cache_manager(FullAttentionSpec(**SHAPE), num_blocks=16)
    req = make_request("a", range(1, 13))
    prefill(mgr, req)
    for t in range(8):
        decode(mgr, req, 100 + t)
    assert 0 not in mgr.get_block_ids("a") and len(mgr.get_block_ids("a")) == 5
    mgr.free(req)
    assert mgr.num_free_blocks == 15
    mgr.check_invariants()
