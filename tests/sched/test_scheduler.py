"""Scheduler + KV manager driven by a fake runner that checks every block table it is given."""

from __future__ import annotations

import random

import pytest

from pagedkv.kv.manager import KVCacheManager
from pagedkv.sched import Request, RequestStatus, SamplingParams
from pagedkv.sched.output import ModelRunnerOutput
from pagedkv.sched.request import child_request_id
from pagedkv.sched.scheduler import Scheduler, SchedulerConfig
from tests.sched.fake_runner import FakeRunner, reference_continuation

VOCAB = 1000


def make_requests(num: int, seed: int = 0, min_len: int = 3, max_len: int = 60,
                  max_tokens: int = 12, shared_prefix: int = 0, n: int = 1) -> list[Request]:
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared_prefix)]
    requests = []
    for i in range(num):
        prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(min_len, max_len))]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n)
        requests.append(Request(request_id=f"r{i}", prompt_token_ids=prompt,
                                sampling_params=params, arrival_time=float(i)))
    return requests


def run(requests: list[Request], *, num_blocks: int = 512, block_size: int = 4,
        num_host_blocks: int = 0, max_num_batched_tokens: int = 256, max_num_seqs: int = 16,
        preemption_mode: str = "recompute", enable_caching: bool = True,
        window: int | None = None, max_model_len: int = 4096, policy: str = "fcfs",
        max_steps: int = 5000):
    """Run to completion, checking invariants after every step. Returns (scheduler, finished)."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size,
                        num_host_blocks=num_host_blocks, enable_caching=enable_caching,
                        sliding_window=window)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len,
                                      preemption_mode=preemption_mode,
                                      scheduling_policy=policy), kv)
    runner = FakeRunner(num_blocks, num_host_blocks, block_size, VOCAB, window)
    for request in requests:
        sched.add_request(request)
    finished: dict[str, Request] = {}
    sched.swaps = 0
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sched.swaps += len(out.blocks_to_swap_out)
        result = runner.execute(out)
        for request in sched.update(out, result):
            if request.is_finished:
                finished[request.request_id] = request
        sched.check_invariants()
    else:
        raise AssertionError("did not finish: a deadlock or starvation")
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    assert kv.usage == 0.0
    if kv.host_pool is not None:
        assert kv.host_pool.get_num_free_blocks() == num_host_blocks
    return sched, finished


def assert_reference(requests: list[Request], finished: dict[str, Request], window=None) -> None:
    for request in requests:
        n = request.sampling_params.n
        for i in range(n):
            rid = request.request_id if i == 0 else child_request_id(request.request_id, i)
            got = finished[rid]
            assert got.status == RequestStatus.FINISHED_LENGTH, (rid, got.status, got.error)
            want = reference_continuation(request.prompt_token_ids, request.sampling_params.max_tokens,
                                          VOCAB, sample_index=i, window=window)
            assert got.output_token_ids == want, rid


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("enable_caching", [True, False])
def test_outputs_exact_with_ample_memory(block_size, enable_caching):
    requests = make_requests(12, seed=block_size, shared_prefix=20)
    sched, finished = run(requests, block_size=block_size, enable_caching=enable_caching,
                          num_blocks=4096 // block_size)
    assert_reference(requests, finished)
    assert sched.num_preemptions == 0
    if enable_caching:
        assert sched.prefix_cache_hits > 0  # the shared prefix was reused
    else:
        assert sched.prefix_cache_hits == 0


def test_chunked_prefill_with_tiny_token_budget():
    requests = make_requests(6, seed=1, min_len=30, max_len=50)
    _, finished = run(requests, max_num_batched_tokens=7)
    assert_reference(requests, finished)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("block_size", [1, 4])
def test_preemption_keeps_outputs_exact(mode, block_size):
    requests = make_requests(10, seed=3, min_len=10, max_len=30, max_tokens=20)
    num_blocks = 60 // block_size + 1 + (1 if block_size == 4 else 0) * 2
    sched, finished = run(requests, block_size=block_size, num_blocks=num_blocks,
                          preemption_mode=mode, num_host_blocks=400 if mode == "swap" else 0)
    assert_reference(requests, finished)
    assert sched.num_preemptions > 0
    if mode == "swap":
        assert sched.swaps > 0
    else:
        assert sched.swaps == 0


def test_swap_falls_back_to_recompute_when_host_is_full():
    requests = make_requests(10, seed=4, min_len=10, max_len=30, max_tokens=20)
    sched, finished = run(requests, block_size=4, num_blocks=17, preemption_mode="swap",
                          num_host_blocks=3)
    assert_reference(requests, finished)
    assert sched.num_preemptions > 0


def test_request_that_can_never_fit_errors_while_others_finish():
    requests = make_requests(4, seed=5, min_len=5, max_len=10)
    huge = Request(request_id="huge", prompt_token_ids=list(range(200)),
                   sampling_params=SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=1.5)
    sched, finished = run([*requests, huge], block_size=4, num_blocks=33)
    assert finished["huge"].status == RequestStatus.FINISHED_ERROR
    assert "needs 50 KV blocks" in finished["huge"].error
    assert_reference(requests, finished)


def test_parallel_sampling_forks_and_copies_on_write():
    # Prompts of 10 tokens with block size 4: the last block is partly full and shared after fork.
    requests = make_requests(3, seed=6, min_len=10, max_len=10, n=3, max_tokens=6)
    sched, finished = run(requests, block_size=4)
    assert_reference(requests, finished)


def test_parallel_sampling_under_preemption():
    requests = make_requests(4, seed=7, min_len=9, max_len=15, n=3, max_tokens=10)
    for mode in ("recompute", "swap"):
        fresh = [Request(r.request_id, r.prompt_token_ids, r.sampling_params,
                         arrival_time=r.arrival_time) for r in requests]
        sched, finished = run(fresh, block_size=4, num_blocks=30, preemption_mode=mode,
                              num_host_blocks=200)
        assert_reference(fresh, finished)
        assert sched.num_preemptions > 0


def test_sliding_window_frees_blocks_and_stays_exact():
    requests = make_requests(5, seed=8, min_len=20, max_len=40, max_tokens=16)
    _, finished = run(requests, block_size=4, window=8)
    assert_reference(requests, finished, window=8)


def test_priority_policy_admits_lower_value_first():
    requests = make_requests(4, seed=9, min_len=5, max_len=5)
    for request, priority in zip(requests, [3, 2, 1, 0], strict=True):
        request.priority = priority
    sched, finished = run(requests, max_num_seqs=1, policy="priority")
    assert_reference(requests, finished)
    assert list(finished) == ["r3", "r2", "r1", "r0"]  # finish order: one at a time


def test_abort_frees_every_block():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(), kv)
    for request in make_requests(5, seed=10):
        sched.add_request(request)
    runner = FakeRunner(64, 0, 4)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    assert kv.usage > 0
    sched.finish_requests([f"r{i}" for i in range(5)], RequestStatus.FINISHED_ABORTED)
    sched.check_invariants()
    assert kv.usage == 0.0 and not sched.has_unfinished_requests()


def test_running_request_that_outgrows_the_whole_cache_ends_with_length():
    request = make_requests(1, seed=11, min_len=8, max_len=8, max_tokens=200)[0]
    sched, finished = run([request], block_size=4, num_blocks=9, max_model_len=10_000)
    got = finished["r0"]
    assert got.status == RequestStatus.FINISHED_LENGTH
    # 8 blocks x 4 tokens of KV, plus the token sampled from the last of them.
    assert got.num_tokens == 33
    assert got.output_token_ids == reference_continuation(request.prompt_token_ids, 25, VOCAB)


def test_requests_arriving_together_compute_a_shared_prefix_once():
    # Four requests share a 32-token prefix (8 blocks of 4) and arrive at once. The first one
    # computes it; the others wait one step and hit it instead of computing it again.
    requests = make_requests(4, seed=12, min_len=3, max_len=6, shared_prefix=32)
    sched, finished = run(requests, block_size=4, max_num_batched_tokens=512)
    assert_reference(requests, finished)
    assert sched.prefix_cache_hits == 3 * 32
    assert [r.num_cached_tokens for r in requests] == [0, 32, 32, 32]


def test_prefix_deferral_is_off_without_prefix_caching():
    requests = make_requests(4, seed=12, min_len=3, max_len=6, shared_prefix=32)
    sched, finished = run(requests, block_size=4, max_num_batched_tokens=512, enable_caching=False)
    assert_reference(requests, finished)
    assert all(r.num_cached_tokens == 0 for r in requests)


def test_scheduled_block_ids_are_kept_in_place_per_slot():
    """Each of a request's two ScheduledRequests keeps one block-id list, brought up to date
    each time it is scheduled (kv/block_table.py), equal to the manager's table."""
    kv = KVCacheManager(num_blocks=64, block_size=4, watermark=0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=256), kv)
    sched.add_request(Request(request_id="r", prompt_token_ids=list(range(10)),
                              sampling_params=SamplingParams(max_tokens=30, ignore_eos=True)))
    tables = []
    for _ in range(12):
        out = sched.schedule()
        (scheduled,) = out.scheduled
        assert scheduled.block_table == kv.get_block_ids("r")
        tables.append(scheduled.block_table)
        sched.update(out, ModelRunnerOutput(sampled_token_ids={"r": [7]}))
        sched.check_invariants()
    assert len(tables[-1]) == 6  # 10 + 11 tokens in blocks of 4
    assert all(t is tables[i % 2] for i, t in enumerate(tables))
