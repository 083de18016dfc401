"""Simulated requests make their prompt tokens when the scheduler first reads them and drop
them when they finish (`pagedkv.sim.lazy_request`)."""

from __future__ import annotations

import gc
import math
import weakref

from pagedkv.sched.request import Request
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.sim.config import SimConfig
from pagedkv.sim.instance import SimInstance
from pagedkv.sim.latency.fixed import LinearLatency
from pagedkv.sim.lazy_request import LazyPromptRequest
from pagedkv.sim.records import RequestRecord
from pagedkv.sim.traces import TraceRequest, prompt_token_ids

from .workloads import shared_prefix_trace


def test_tokens_are_made_on_first_read_and_equal_the_trace_runs():
    row = TraceRequest(arrival=0.5, input_length=21, output_length=4, block_ids=(3, 9),
                       block_tokens=8)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    lazy = LazyPromptRequest("7", row, 1000, 7, params, arrival_time=0.5)
    eager = Request("7", prompt_token_ids(row, 1000, 7), params, arrival_time=0.5)
    assert not lazy.is_materialized
    assert (lazy.num_tokens, lazy.num_prompt_tokens) == (21, 21) == (eager.num_tokens,
                                                                      eager.num_prompt_tokens)
    assert not lazy.is_materialized  # the length alone makes nothing
    assert lazy.all_token_ids == eager.all_token_ids == prompt_token_ids(row, 1000, 7)
    assert lazy.is_materialized
    assert lazy.prompt_token_ids == eager.prompt_token_ids
    assert lazy.all_token_ids is not lazy.prompt_token_ids  # outputs grow only all_token_ids
    lazy.append_output_token(5)
    assert (lazy.num_tokens, len(lazy.prompt_token_ids)) == (22, 21)
    assert not hasattr(lazy, "no_such_attribute")


def test_only_the_queue_head_holds_tokens_and_finished_requests_are_freed():
    config = SimConfig(num_blocks=40, block_size=8, max_num_seqs=4, max_num_batched_tokens=64,
                       max_model_len=512, vocab_size=1000)
    inst = SimInstance(config, LinearLatency())
    trace = shared_prefix_trace(num=30, block_tokens=8)
    refs = []
    for i, row in enumerate(trace):
        request = inst.add(RequestRecord(i, 0.0, row.input_length, row.output_length), row)
        refs.append(weakref.ref(request))
    del request
    sched = inst.scheduler
    for _ in range(3):
        assert inst.step()
        sched.check_invariants()
        assert all(r.is_materialized for r in sched.running)
        assert len(sched.waiting) > 20
        # Behind the head, no waiting request has made its tokens.
        assert not any(r.is_materialized for r in sched.waiting[1:])
    inst.run_until(math.inf)
    sched.check_invariants()
    assert sorted(r.index for r in inst.finished) == list(range(len(trace)))
    assert all(r.status == "length" and r.num_tokens == r.output_tokens for r in inst.finished)
    assert inst.kv.pool.get_num_free_blocks() == config.num_blocks - 1
    gc.collect()
    assert [i for i, ref in enumerate(refs) if ref() is not None] == []
