"""Random workloads and memory settings through the scheduler and the fake runner: outputs always
equal the reference, nothing deadlocks, and every block comes back."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.sched import Request, SamplingParams
from tests.sched.test_scheduler import VOCAB, assert_reference, run


@st.composite
def workloads(draw):
    seed = draw(st.integers(0, 10**6))
    rng = random.Random(seed)
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_requests = draw(st.integers(1, 8))
    shared = [rng.randrange(VOCAB) for _ in range(draw(st.integers(0, 24)))]
    requests = []
    for i in range(num_requests):
        prompt = shared[:rng.randint(0, len(shared))] + [
            rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
        params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True,
                                n=draw(st.integers(1, 3)))
        requests.append(Request(request_id=f"r{i}", prompt_token_ids=prompt,
                                sampling_params=params, arrival_time=float(rng.randint(0, 3)),
                                priority=rng.randint(0, 2)))
    # Enough blocks for the largest single request (prompt + outputs, n samples) to fit alone.
    need = max(-(-(len(r.prompt_token_ids) + r.sampling_params.max_tokens) // block_size)
               * r.sampling_params.n for r in requests)
    num_blocks = need + 1 + draw(st.integers(0, 40))
    config = dict(
        block_size=block_size, num_blocks=num_blocks,
        preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        num_host_blocks=draw(st.sampled_from([0, 4, 200])),
        max_num_batched_tokens=draw(st.integers(1, 64)),
        max_num_seqs=draw(st.integers(1, 16)),
        enable_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        window=draw(st.sampled_from([None, None, 3, 8])),
    )
    return requests, config


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_exactly_and_return_every_block(case):
    requests, config = case
    _, finished = run(requests, **config)
    assert_reference(requests, finished, window=config["window"])
