"""`explain_prompt`: where a prompt's KV is, block by block, and why a block missed (issue 23)."""

from __future__ import annotations

import json

from pagedkv.kv.explain import explain_prompt
from pagedkv.kv.manager import KVCacheManager
from tests.kv.conftest import make_request, prefill

BS = 4


def _manager(num_blocks: int = 16) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=BS, watermark=0.0)


def _run(kv: KVCacheManager, rid: str, prompt: list[int], salt: str | None = None) -> None:
    req = make_request(rid, prompt, cache_salt=salt)
    new, _ = prefill(kv, req)
    assert new is not None
    kv.free(req)


def test_never_computed_and_the_partial_block():
    kv = _manager()
    answer = explain_prompt(kv, list(range(10)))
    assert [b["reason"] for b in answer["blocks"]] == ["never_computed"] * 2
    assert [b["where"] for b in answer["blocks"]] == ["nowhere"] * 2
    assert answer["partial_block"]["tokens"] == [8, 10]
    assert answer["num_device_hit_tokens"] == 0
    kv.check_invariants()


def test_hits_and_the_always_recomputed_last_token():
    kv = _manager()
    prompt = list(range(12))
    _run(kv, "a", prompt)
    answer = explain_prompt(kv, prompt)
    assert [b["reason"] for b in answer["blocks"]] == ["hit", "hit", "last_token_recomputed"]
    assert all(b["where"] == "device" for b in answer["blocks"])
    assert answer["num_device_hit_tokens"] == 8 and answer["partial_block"] is None
    # Exactly what the scheduler's own prefix lookup finds.
    _, hit_tokens = kv.get_computed_blocks(make_request("probe", prompt))
    assert hit_tokens == answer["num_device_hit_tokens"]
    kv.check_invariants()


def test_evicted_names_the_policy_and_the_request_that_needed_the_room():
    kv = _manager(num_blocks=9)  # 8 usable blocks
    victim = list(range(16))  # 4 blocks, cached and free after the run
    _run(kv, "victim", victim)
    big = make_request("big", list(range(100, 132)))  # 8 blocks: evicts every cached one
    assert prefill(kv, big)[0] is not None
    answer = explain_prompt(kv, victim + [999])
    for block in answer["blocks"]:
        assert block["reason"] == "evicted" and block["where"] == "nowhere"
        assert block["policy"] == "lru" and block["evicted_for_request"] == "big"
        assert block["evicted_seconds_ago"] >= 0
    kv.free(big)
    kv.check_invariants()


def test_another_salts_history_is_never_shown():
    kv = _manager()
    _run(kv, "salted", list(range(12)), salt="tenant-a")
    for salt in ("tenant-b", None):  # another tenant, or an unsalted caller, guesses a's prompt
        answer = explain_prompt(kv, list(range(12)) + [50], cache_salt=salt)
        assert [b["reason"] for b in answer["blocks"]] == ["never_computed"] * 3
        assert "salted" not in json.dumps(answer) and answer["recent_prompts"] == 0
    kv.check_invariants()


def test_different_tokens_is_told_by_whole_blocks_only():
    kv = _manager()
    _run(kv, "salted", list(range(12)), salt="tenant-a")
    answers = []
    for position in (8, 9, 11):  # how far the guess matches inside block 2 must not show
        prompt = list(range(12))
        prompt[position] = 77
        answer = explain_prompt(kv, prompt + [50], cache_salt="tenant-a", now=0.0)
        assert [b["reason"] for b in answer["blocks"]] == ["hit", "hit", "different_tokens"]
        assert answer["blocks"][2]["nearest_request"] == "salted"
        answers.append({k: v for k, v in answer.items() if k != "blocks"}
                       | {"blocks": [{k: v for k, v in b.items() if k != "hash"}
                                     for b in answer["blocks"]]})
    assert answers[0] == answers[1] == answers[2]
    # A recent prompt that ends inside the block compared says nothing about that block.
    _run(kv, "short", list(range(100, 110)), salt="tenant-c")
    answer = explain_prompt(kv, list(range(100, 108)) + [5, 6, 7, 8, 9], cache_salt="tenant-c")
    assert [b["reason"] for b in answer["blocks"]] == ["hit", "hit", "never_computed"]
    kv.check_invariants()


def test_evicted_hides_the_request_of_another_salt():
    kv = _manager(num_blocks=9)
    victim = list(range(16))
    _run(kv, "victim", victim, salt="tenant-a")
    big = make_request("big-of-b", list(range(100, 132)), cache_salt="tenant-b")
    assert prefill(kv, big)[0] is not None
    answer = explain_prompt(kv, victim + [999], cache_salt="tenant-a")
    assert [b["reason"] for b in answer["blocks"]] == ["evicted"] * 4
    assert all(b["evicted_for_request"] is None for b in answer["blocks"])
    assert "big-of-b" not in json.dumps(answer)
    kv.free(big)
    kv.check_invariants()


def test_a_cached_block_after_a_missing_one_is_unreachable():
    kv = _manager()
    prompt = list(range(12))
    _run(kv, "a", prompt)
    block0 = kv.pool.get_cached_block(kv.hasher(make_request("h", prompt), [])[0])
    kv.pool.touch([block0])
    kv.pool._evict(block0)  # block 0's hash dropped (as an eviction does), blocks 1-2 stay
    kv.pool.free_blocks([block0])
    answer = explain_prompt(kv, prompt + [1])
    assert [b["reason"] for b in answer["blocks"]] == ["evicted", "unreachable", "unreachable"]
    assert [b["where"] for b in answer["blocks"]] == ["nowhere", "device", "device"]
    assert answer["num_device_hit_tokens"] == 0
    kv.check_invariants()
