"""Store test helpers: a real Redis server per test, and engine runs one request at a time."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.store.redis_server import RedisServer
from pagedkv.store.tier import KVTier

BLOCK_SIZE = 4
PREFIX_LEN = 40  # 10 blocks
NUM_DEVICE_BLOCKS = 20  # 19 usable: one request of 49 tokens (13 blocks) evicts the others


@pytest.fixture
def redis_server():
    """A real redis-server on a free loopback port, killed after the test."""
    with RedisServer(maxmemory="64mb") as server:
        yield server


def make_prefixes(seed: int, num: int, length: int = PREFIX_LEN) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 200) for _ in range(length)] for _ in range(num)]


def with_suffix(prefix: list[int], seed: int, length: int = 5) -> list[int]:
    rng = random.Random(seed)
    return prefix + [rng.randrange(4, 200) for _ in range(length)]


def run_one(llm: LLM, prompt: list[int], salt: str | None = None,
            max_tokens: int = 4) -> tuple[list[int], int]:
    """Greedy tokens and num_cached_tokens of one request run alone; waits for its saves."""
    engine = llm.llm_engine
    rid = f"r{engine.prompt_tokens_total}-{len(prompt)}"
    engine.add_request(rid, {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=max_tokens, temperature=0.0), cache_salt=salt)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    engine.check_invariants()
    if engine.kv_store is not None:
        engine.kv_store.flush()
    return list(final.outputs[0].token_ids), final.num_cached_tokens


def two_rounds(llm: LLM, model_dir, prefixes: list[list[int]]) -> None:
    """Each prefix with a fresh suffix, one request at a time, twice: round 1 computes it,
    round 2 gets it back from the tier (`num_cached_tokens == PREFIX_LEN`); greedy tokens equal
    transformers' every time."""
    from tests.engine.conftest import hf_greedy

    for round_ in (1, 2):
        for i, prefix in enumerate(prefixes):
            prompt = with_suffix(prefix, seed=10 * round_ + i)
            tokens, cached = run_one(llm, prompt)
            assert tokens == hf_greedy(model_dir, prompt, 4)
            assert cached == (0 if round_ == 1 else PREFIX_LEN)


def store_llm(model_dir, tier: str, tmp_path, redis_url: str | None = None, **kwargs) -> LLM:
    """An engine with a tiny device pool and the one tier named `tier`."""
    tiers = {
        "none": {},
        "host": {"kv_offloading_size": 0.01},
        "disk": {"kv_offloading_disk_path": str(tmp_path / "kv"), "kv_offloading_disk_size": 0.01},
        "redis": {"kv_offloading_remote_url": redis_url},
    }[tier]
    kwargs.setdefault("num_gpu_blocks_override", NUM_DEVICE_BLOCKS)
    return LLM(model=str(model_dir), seed=0, block_size=BLOCK_SIZE, max_num_seqs=2, **tiers,
               **kwargs)


class SlowTier(KVTier):
    """A real tier behind latency: `lookup_delay_s` per lookup call, `load_delay_s` per read
    (a slow network or disk), and an optional `before_load()` run at the start of each read
    (to damage the store between the lookup and the load). Counts its calls."""

    def __init__(self, inner: KVTier, *, lookup_delay_s: float = 0.0, load_delay_s: float = 0.0,
                 before_load: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.name, self.medium = inner.name, inner.medium
        self.lookup_delay_s, self.load_delay_s = lookup_delay_s, load_delay_s
        self.before_load = before_load
        self.num_lookups = 0
        self.num_loads = 0  # reads started
        self.num_loads_done = 0  # reads returned

    def contains_many(self, keys):
        self.num_lookups += 1
        time.sleep(self.lookup_delay_s)
        return self.inner.contains_many(keys)

    def get_many(self, keys):
        self.num_loads += 1
        if self.before_load is not None:
            self.before_load()
        time.sleep(self.load_delay_s)
        try:
            return self.inner.get_many(keys)
        finally:
            self.num_loads_done += 1

    def put_many(self, items):
        return self.inner.put_many(items)

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    def take_removed(self) -> list[bytes]:
        return self.inner.take_removed()

    def close(self) -> None:
        self.inner.close()


def slow_down(llm: LLM, **kwargs) -> SlowTier:
    """Put the engine's first tier behind a SlowTier (see there for `kwargs`)."""
    store = llm.llm_engine.kv_store
    store.tiers[0] = SlowTier(store.tiers[0], **kwargs)
    return store.tiers[0]
