"""The tiered KV store inside the engine: same greedy tokens as transformers with every tier,
prefixes coming back from a tier after the device evicted them, across engines, processes and
restarts, and failures that cost hits, never requests."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.engine.conftest import hf_greedy
from tests.store.conftest import (
    PREFIX_LEN,
    make_prefixes,
    run_one,
    store_llm,
    two_rounds,
    with_suffix,
)

TIERS = ("host", "disk", "redis")


def _url(tier, request):
    return request.getfixturevalue("redis_server").url if tier == "redis" else None


@pytest.mark.parametrize("tier", TIERS)
def test_prefixes_come_back_from_the_tier(tiny_llama, tmp_path, tier, request):
    llm = store_llm(tiny_llama, tier, tmp_path, _url(tier, request))
    store = llm.llm_engine.kv_store
    # Round 1 computes each prefix; each request (13 blocks) evicts the previous one's blocks
    # from the 19-block device pool. Round 2 must get every prefix back from the tier.
    two_rounds(llm, tiny_llama, make_prefixes(seed=3, num=3))
    stats = store.snapshot_stats()[0]
    assert stats.hits == 3 * PREFIX_LEN // 4
    assert stats.bytes_read == stats.hits * store.block_bytes
    assert stats.blocks_written > 0 and stats.load_seconds.count > 0
    assert llm.llm_engine.scheduler.prefix_cache_hits == 0  # no device hit at all
    assert llm.llm_engine.scheduler.kv_connector.num_failed_load_tokens == 0


def test_all_tiers_together_batched(tiny_llama, tmp_path, redis_server):
    """Batched generation through host -> disk -> redis gives transformers' tokens."""
    from pagedkv import SamplingParams

    llm = store_llm(tiny_llama, "disk", tmp_path, kv_offloading_size=0.001,
                    kv_offloading_remote_url=redis_server.url)
    prefixes = make_prefixes(seed=4, num=4)
    prompts = [with_suffix(p, seed=i) for i in range(3) for p in prefixes]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(tiny_llama, prompt, 4)
    store = llm.llm_engine.kv_store
    store.flush()
    assert [t.name for t in store.tiers] == ["host", "disk", "redis"]
    assert sum(s.hits for s in store.snapshot_stats()) > 0
    llm.llm_engine.check_invariants()


def test_disk_tier_is_shared_with_a_later_engine(tiny_llama, tmp_path):
    prompt = with_suffix(make_prefixes(seed=5, num=1)[0], seed=1)
    first = store_llm(tiny_llama, "disk", tmp_path)
    assert run_one(first, prompt)[1] == 0
    del first
    second = store_llm(tiny_llama, "disk", tmp_path)  # a restart: a new engine, same directory
    tokens, cached = run_one(second, prompt)
    assert cached == (len(prompt) - 1) // 4 * 4  # every full prompt block from disk
    assert tokens == hf_greedy(tiny_llama, prompt, 4)


def test_disk_tier_adopts_blocks_another_live_engine_writes(tiny_llama, tmp_path):
    """Two engines live at once on one directory: each finds the blocks the other wrote after
    it had scanned the directory (not a restart)."""
    first = store_llm(tiny_llama, "disk", tmp_path)
    second = store_llm(tiny_llama, "disk", tmp_path)  # both scanned an empty directory
    prompts = [with_suffix(p, seed=1) for p in make_prefixes(seed=15, num=2)]
    full = (len(prompts[0]) - 1) // 4 * 4
    assert run_one(first, prompts[0])[1] == 0
    tokens, cached = run_one(second, prompts[0])  # written by `first`, which is still running
    assert cached == full and tokens == hf_greedy(tiny_llama, prompts[0], 4)
    assert run_one(second, prompts[1])[1] == 0
    tokens, cached = run_one(first, prompts[1])  # and the other way round
    assert cached == full and tokens == hf_greedy(tiny_llama, prompts[1], 4)
    for llm in (first, second):
        llm.llm_engine.check_invariants()
        assert llm.llm_engine.kv_store.snapshot_stats()[0].hits == full // 4


def test_corrupt_and_truncated_disk_files_cost_hits(tiny_llama, tmp_path):
    prompt = with_suffix(make_prefixes(seed=6, num=1)[0], seed=1)
    first = store_llm(tiny_llama, "disk", tmp_path)
    run_one(first, prompt)
    disk = first.llm_engine.kv_store.tiers[0]
    hashes = first.llm_engine.scheduler.kv_cache_manager.hasher
    del first
    from pagedkv.sched.request import Request
    from pagedkv.sched.sampling_params import SamplingParams

    block_hashes = hashes(Request("x", prompt, SamplingParams()), [])
    second = store_llm(tiny_llama, "disk", tmp_path)
    store = second.llm_engine.kv_store
    corrupt = disk.path(store.key(block_hashes[6]))
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0x40
    corrupt.write_bytes(bytes(data))
    truncated = disk.path(store.key(block_hashes[8]))
    truncated.write_bytes(truncated.read_bytes()[:50])
    tokens, cached = run_one(second, prompt)
    assert cached == 6 * 4  # the load stops at the corrupt block; the rest is recomputed
    assert tokens == hf_greedy(tiny_llama, prompt, 4)
    assert store.tiers[0].num_corrupt == 2  # both damaged files were dropped
    # The recomputed blocks were saved again: the files now hold good blocks.
    keys = [store.key(block_hashes[i]) for i in (6, 8)]
    assert all(p is not None for p in store.tiers[0].get_many(keys))
    assert second.llm_engine.scheduler.kv_connector.num_failed_load_tokens == (11 - 6) * 4


_SECOND_PROCESS = textwrap.dedent("""
    import json, sys
    from pagedkv import LLM
    from tests.store.conftest import run_one
    llm = LLM(model=sys.argv[1], seed=0, block_size=4, num_gpu_blocks_override=20,
              max_num_seqs=2, kv_offloading_remote_url=sys.argv[2])
    tokens, cached = run_one(llm, json.loads(sys.argv[3]))
    print(json.dumps({"tokens": tokens, "cached": cached}))
""")


def test_redis_tier_is_shared_with_another_process(tiny_llama, tmp_path, redis_server):
    prompt = with_suffix(make_prefixes(seed=7, num=1)[0], seed=1)
    first = store_llm(tiny_llama, "redis", tmp_path, redis_server.url)
    assert run_one(first, prompt)[1] == 0
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _SECOND_PROCESS, str(tiny_llama), redis_server.url,
         json.dumps(prompt)], capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cached"] == (len(prompt) - 1) // 4 * 4
    assert result["tokens"] == hf_greedy(tiny_llama, prompt, 4)


def test_redis_killed_mid_run_costs_hits_not_requests(tiny_llama, tmp_path, redis_server):
    llm = store_llm(tiny_llama, "redis", tmp_path, redis_server.url)
    prefixes = make_prefixes(seed=8, num=3)
    for i, prefix in enumerate(prefixes):
        run_one(llm, with_suffix(prefix, seed=i))
    redis_server.stop()
    for i, prefix in enumerate(prefixes):  # the device evicted them; Redis is gone
        prompt = with_suffix(prefix, seed=100 + i)
        tokens, cached = run_one(llm, prompt)
        assert tokens == hf_greedy(tiny_llama, prompt, 4)
        assert cached == 0
    tier = llm.llm_engine.kv_store.tiers[0]
    # The breaker opened (it may have half-opened again since: its cooldown is 5 s).
    assert tier.num_errors >= 3 and tier.breaker.num_opened >= 1


@pytest.mark.parametrize("tier", TIERS)
def test_cache_salt_isolation(tiny_llama, tmp_path, tier, request):
    llm = store_llm(tiny_llama, tier, tmp_path, _url(tier, request))
    prefix, filler = make_prefixes(seed=9, num=2)
    run_one(llm, with_suffix(prefix, seed=1), salt="tenant-a")
    run_one(llm, with_suffix(filler, seed=1))  # evicts tenant a's blocks from the device
    prompt = with_suffix(prefix, seed=2)
    tokens, cached = run_one(llm, prompt, salt="tenant-b")
    assert cached == 0  # same tokens, other tenant: nothing from the tier
    assert tokens == hf_greedy(tiny_llama, prompt, 4)
    run_one(llm, with_suffix(filler, seed=2))
    assert run_one(llm, prompt, salt="tenant-a")[1] == PREFIX_LEN
    assert run_one(llm, with_suffix(filler, seed=3), salt=None)[1] > 0


def test_models_never_share_blocks(tiny_llama, tiny_qwen2, tmp_path):
    prompt = with_suffix(make_prefixes(seed=11, num=1)[0], seed=1)
    run_one(store_llm(tiny_llama, "disk", tmp_path), prompt)
    tokens, cached = run_one(store_llm(tiny_qwen2, "disk", tmp_path), prompt)
    assert cached == 0
    assert tokens == hf_greedy(tiny_qwen2, prompt, 4)


def test_bad_store_arguments(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="kv_offloading_size"):
        store_llm(tiny_llama, "none", tmp_path, kv_offloading_size=-1)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        store_llm(tiny_llama, "host", tmp_path, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_remote_url"):
        store_llm(tiny_llama, "redis", tmp_path, "http://nope")


def test_sliding_window_models_are_refused(tiny_mistral, tmp_path):
    with pytest.raises(ValueError, match="sliding-window"):
        store_llm(tiny_mistral, "host", tmp_path)


@pytest.mark.parametrize("credentials", ["wrong", "missing"])
def test_a_wrong_redis_password_is_one_warning_and_a_down_tier(tiny_llama, tmp_path, caplog,
                                                                credentials):
    """A password-protected Redis and a URL with the wrong (or no) password: one clear warning
    at start, the tier is marked down, requests are served (computed, not loaded) without a
    warning per call."""
    import logging

    from pagedkv.store.redis_server import RedisServer

    with RedisServer(maxmemory="16mb", password="s3cret") as server:
        url = server.url.replace(":s3cret@", ":nope@" if credentials == "wrong" else "")
        with caplog.at_level(logging.WARNING, logger="pagedkv.store.redis_tier"):
            llm = store_llm(tiny_llama, "redis", tmp_path, url)
            tier = llm.llm_engine.kv_store.tiers[0]
            assert tier.is_down and "password" in tier.down_reason
            for i, prefix in enumerate(make_prefixes(seed=17, num=4)):
                prompt = with_suffix(prefix, seed=i)
                tokens, cached = run_one(llm, prompt)
                assert cached == 0 and tokens == hf_greedy(tiny_llama, prompt, 4)
        warnings = [r for r in caplog.records if r.name == "pagedkv.store.redis_tier"]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "password" in warnings[0].getMessage() and "s3cret" not in caplog.text
        assert "nope" not in caplog.text
        # The right password works against the same server.
        good = store_llm(tiny_llama, "redis", tmp_path / "good", server.url)
        assert not good.llm_engine.kv_store.tiers[0].is_down
        prompt = with_suffix(make_prefixes(seed=18, num=1)[0], seed=1)
        run_one(good, prompt)
        assert good.llm_engine.kv_store.snapshot_stats()[0].blocks_written > 0
