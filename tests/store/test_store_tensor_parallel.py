"""The KV store with tensor parallelism (CPU, gloo, 2 ranks): every rank saves and loads its own
KV heads under keys that name its rank, the scheduler (rank 0) decides every load once, and a
load applies the blocks every rank got. Tokens equal one process's and transformers'; hit
counts are exact per rank; an engine of another size, or another rank, never reads them."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from pagedkv.sched.request import Request
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.store.connector import (
    FinishedLoads,
    LoadJob,
    StoreConnectorMetadata,
    StoreConnectorWorker,
    agreed_outcomes,
)
from pagedkv.store.disk import SUFFIX
from pagedkv.store.host import HostTier
from pagedkv.store.tiered import TieredKVStore
from tests.engine.conftest import hf_greedy
from tests.store.conftest import BLOCK_SIZE, make_prefixes, run_one, store_llm, with_suffix

TP2 = dict(tensor_parallel_size=2, cpu_kernels="off")


def _run(llm, prompt: list[int]) -> tuple[list[int], int]:
    """run_one, then every rank's queued saves written (the next lookup sees them)."""
    out = run_one(llm, prompt)
    runner = llm.llm_engine.runner
    if hasattr(runner, "collective_rpc"):
        runner.collective_rpc("flush_kv_store")
    return out


def _rank_stats(llm) -> list[dict[str, dict]]:
    """Each rank's store tiers' counters, by tier name."""
    return [{t["name"]: t for t in tiers}
            for tiers in llm.llm_engine.runner.collective_rpc("kv_store_stats")]


def _full_tokens(prompt: list[int]) -> int:
    """Prompt tokens in full blocks a tier can provide (the last token is always computed)."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.mark.timeout(300)
def test_tp2_ranks_save_and_load_their_own_shards(tiny_llama, tmp_path):
    prefixes = make_prefixes(seed=21, num=3)
    first = [with_suffix(p, seed=1) for p in prefixes]
    again = [with_suffix(p, seed=2) for p in prefixes]  # the same prefixes, new suffixes
    prefix_blocks = len(prefixes[0]) // BLOCK_SIZE

    # 1. Host + disk tiers, TP=2: each request evicts the previous one's device blocks, so the
    #    second round gets every prefix back from the host tier, on both ranks.
    tp2 = store_llm(tiny_llama, "disk", tmp_path, kv_offloading_size=0.01, **TP2)
    tokens = {}
    for prompt in first + again:
        tokens[tuple(prompt)], cached = _run(tp2, prompt)
        assert tokens[tuple(prompt)] == hf_greedy(tiny_llama, prompt, 4)
        assert cached == (0 if prompt in first else len(prefixes[0]))
    assert tp2.llm_engine.scheduler.prefix_cache_hits == 0  # no device hit at all
    ranks = _rank_stats(tp2)
    for rank in ranks:
        assert rank["host"]["hits"] == 3 * prefix_blocks and rank["disk"]["hits"] == 0
        assert rank["host"]["blocks_written"] == rank["disk"]["blocks_written"] > 0
    assert ranks[0]["disk"]["blocks_written"] == ranks[1]["disk"]["blocks_written"]
    tp2.llm_engine.kv_store.tiers[0].check_invariants()
    identity = tp2.llm_engine.kv_store.identity
    hasher = tp2.llm_engine.scheduler.kv_cache_manager.hasher
    tp2.shutdown()  # every rank's queued saves reach the disk

    # 2. The ranks' blocks are separate files: rank 1's keys are neither rank 0's nor TP=1's.
    disk = Path(tmp_path / "kv")
    files = sorted(disk.rglob("*" + SUFFIX))
    assert len(files) == 2 * ranks[0]["disk"]["blocks_written"]
    identities = {bytes.fromhex(f.name[:32]) for f in files}
    assert len(identities) == 2 and identity in identities
    (rank1_identity,) = identities - {identity}
    # Damage rank 1's copy of block 6 of the first `again` prompt (rank 0's stays whole).
    hashes = hasher(Request("x", again[0], SamplingParams()), [])
    damaged = next(f for f in files if f.name.startswith((rank1_identity + hashes[6]).hex()))
    damaged.unlink()

    # 3. TP=1 on the same directory reads none of it, and computes the same tokens.
    tp1 = store_llm(tiny_llama, "disk", tmp_path, cpu_kernels="off")
    for prompt in again:
        assert _run(tp1, prompt) == (tokens[tuple(prompt)], 0)
    assert tp1.llm_engine.kv_store.snapshot_stats()[0].hits == 0
    tp1.shutdown()

    # 4. A new TP=2 engine (a restart) gets every full prompt block back from disk, except
    #    where rank 1 lost block 6: both ranks apply blocks 0-5 only and recompute the rest.
    tp2 = store_llm(tiny_llama, "disk", tmp_path, **TP2)
    for i, prompt in enumerate(again):
        got, cached = _run(tp2, prompt)
        assert got == tokens[tuple(prompt)]
        assert cached == (6 * BLOCK_SIZE if i == 0 else _full_tokens(prompt))
    full_blocks = _full_tokens(again[0]) // BLOCK_SIZE
    hits = [rank["disk"]["hits"] for rank in _rank_stats(tp2)]
    assert hits == [3 * full_blocks, 3 * full_blocks - 1]  # a tier counts every block found
    connector = tp2.llm_engine.scheduler.kv_connector
    assert connector.num_failed_load_tokens == (full_blocks - 6) * BLOCK_SIZE
    tp2.shutdown()


@pytest.mark.timeout(120)
def test_tp2_bad_tier_path_is_a_value_error_and_stops_every_rank(tiny_llama, tmp_path):
    import multiprocessing

    from pagedkv import LLM

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match="kv_offloading_disk_path"):
        LLM(model=str(tiny_llama), block_size=BLOCK_SIZE, kv_cache_memory_bytes=1 << 20,
            kv_offloading_disk_path=str(not_a_dir), **TP2)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pagedkv-tp")]


class _FakeGroup:
    """Rank `rank` of 2 whose peer reports `peer` from every all-gather."""

    size = 2

    def __init__(self, rank: int, peer: dict[int, int]) -> None:
        self.rank, self.peer = rank, peer
        self.is_driver = rank == 0

    def all_gather_objects(self, mine):
        return [mine, self.peer] if self.rank == 0 else [self.peer, mine]


class _Cache:
    def __init__(self) -> None:
        self.written: list[tuple[list[int], int]] = []

    def write_blocks(self, block_ids, rows) -> None:
        assert len(block_ids) == rows.shape[0]
        self.written.append((list(block_ids), rows.shape[0]))


def _loaded(num_rows: int) -> Future:
    future: Future = Future()
    future.set_result(torch.zeros(num_rows, 8, dtype=torch.uint8))
    return future


@pytest.mark.parametrize("rank", [0, 1])
def test_a_load_applies_the_blocks_every_rank_got(rank):
    """Job 0: this rank loaded 4 blocks, the peer 2: both write 2, rank 0 reports 2. Job 1:
    the peer is not done yet: nothing written, nothing reported, still pending."""
    store = TieredKVStore([HostTier(1 << 12, 8)], b"i" * 16, 8, BLOCK_SIZE)
    finished = FinishedLoads()
    worker = StoreConnectorWorker(store, finished, pin_memory=False,
                                  group=_FakeGroup(rank, peer={0: 2}))
    worker._pending = {0: (LoadJob(0, "a", [5, 6, 7, 8], []), _loaded(4), float("inf")),
                       1: (LoadJob(1, "b", [9], []), _loaded(1), float("inf"))}
    cache = _Cache()
    worker.start_load_kv(StoreConnectorMetadata(), cache)
    assert cache.written == [([5, 6], 2)]
    assert finished.take() == ([(0, 2)] if rank == 0 else [])
    assert list(worker._pending) == [1]
    store.close()


def test_agreed_outcomes_take_the_fewest_blocks_of_jobs_every_rank_is_done_with():
    assert agreed_outcomes([{1: 4, 2: 3, 5: 0}, {2: 1, 1: 4, 7: 2}]) == {1: 4, 2: 1}
    assert agreed_outcomes([{3: 2}]) == {3: 2}
