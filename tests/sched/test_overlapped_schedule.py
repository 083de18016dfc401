"""Overlapped scheduling at the scheduler (issue 26): step N+1 is scheduled before step N's
tokens are applied, and step N's "forward" (the fake runner, which reads every position back
through the block tables) runs only after that: a block table that lost a block to the next
step, a placeholder left unfilled or a wrong position changes the tokens read, so the outputs
must still equal the reference continuation, with preemption, swap, chunked prefill, n > 1,
prefix caching and sliding windows."""

from __future__ import annotations

import pytest

from pagedkv.kv.manager import KVCacheManager
from pagedkv.sched import Request, RequestStatus, SamplingParams
from pagedkv.sched.output import ModelRunnerOutput
from pagedkv.sched.scheduler import PLACEHOLDER_TOKEN_ID, Scheduler, SchedulerConfig
from tests.sched.fake_runner import FakeRunner
from tests.sched.test_scheduler import VOCAB, assert_reference, make_requests


def run_overlapped(requests: list[Request], *, num_blocks: int = 512, block_size: int = 4,
                   num_host_blocks: int = 0, max_num_batched_tokens: int = 256,
                   max_num_seqs: int = 16, preemption_mode: str = "recompute",
                   window: int | None = None, max_steps: int = 5000):
    """Run to completion in the overlapped order; invariants checked every step."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size,
                        num_host_blocks=num_host_blocks, enable_caching=True,
                        sliding_window=window)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      preemption_mode=preemption_mode), kv)
    runner = FakeRunner(num_blocks, num_host_blocks, block_size, VOCAB, window)
    for request in requests:
        sched.add_request(request)
    finished: dict[str, Request] = {}
    running = sched.schedule()
    for _ in range(max_steps):
        following = sched.schedule()  # built before `running` has run
        result = runner.execute(running)
        for request in sched.update(running, result):
            if request.is_finished:
                finished[request.request_id] = request
        sched.fill_placeholders(following)
        assert all(PLACEHOLDER_TOKEN_ID not in s.token_ids for s in following.scheduled)
        assert following.total_num_scheduled_tokens == sum(
            len(s.token_ids) for s in following.scheduled)
        sched.check_invariants()
        running = following
        if not sched.has_unfinished_requests():
            break
    else:
        raise AssertionError("did not finish: a deadlock or starvation")
    sched.update(running, runner.execute(running))
    assert not sched._unapplied
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    return sched, finished


@pytest.mark.parametrize("block_size", [1, 4])
def test_outputs_exact_with_prefix_hits_and_chunks(block_size):
    requests = make_requests(12, seed=block_size, shared_prefix=20)
    sched, finished = run_overlapped(requests, block_size=block_size,
                                     num_blocks=4096 // block_size, max_num_batched_tokens=40)
    assert_reference(requests, finished)
    assert sched.prefix_cache_hits > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_never_takes_a_running_steps_blocks(mode):
    requests = make_requests(10, seed=3, min_len=10, max_len=30, max_tokens=20)
    sched, finished = run_overlapped(requests, block_size=4, num_blocks=19, preemption_mode=mode,
                                     num_host_blocks=400 if mode == "swap" else 0)
    assert_reference(requests, finished)
    assert sched.num_preemptions > 0
    if mode == "swap":
        assert sched.num_swaps > 0


def test_parallel_samples_and_sliding_window():
    requests = make_requests(6, seed=5, max_tokens=10, n=3)
    _, finished = run_overlapped(requests, num_blocks=400)
    assert_reference(requests, finished)
    windowed = make_requests(6, seed=6, min_len=20, max_len=40, max_tokens=16)
    _, finished = run_overlapped(windowed, num_blocks=64, window=8)
    assert_reference(windowed, finished, window=8)


def test_a_request_that_ends_meanwhile_leaves_the_next_step():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    sched.add_request(Request("a", [1, 2, 3, 4, 5], params))
    sched.add_request(Request("b", [6, 7, 8], SamplingParams(max_tokens=5, ignore_eos=True)))
    first = sched.schedule()
    following = sched.schedule()  # both get a placeholder token
    assert [s.token_ids for s in following.scheduled] == [[PLACEHOLDER_TOKEN_ID]] * 2
    assert [s.start_pos for s in following.scheduled] == [5, 3]
    ended = sched.update(first, ModelRunnerOutput(sampled_token_ids={"a": [9], "b": [10]}))
    assert [r.request_id for r in ended if r.is_finished] == ["a"]  # max_tokens=1
    sched.fill_placeholders(following)
    assert [(s.request_id, s.token_ids) for s in following.scheduled] == [("b", [10])]
    # An id reused by a new request while a step ran: the old step's results skip it.
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    sched.add_request(Request("b", [1, 1, 1], SamplingParams(max_tokens=2)))
    assert sched.update(following, ModelRunnerOutput(sampled_token_ids={"b": [11]})) == []
    assert sched.requests["b"].num_computed_tokens == 0
    sched.check_invariants()
