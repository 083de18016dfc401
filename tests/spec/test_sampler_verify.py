"""Sampler.verify: the target distribution of each verified position is the sampler's own
(temperature, top-k, penalties counting the drafts before it as output), and the emitted
tokens follow it (chi-square over many seeds); greedy verification takes the argmax."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pagedkv.model.sampler import Sampler, apply_penalties
from pagedkv.sched.output import ScheduledRequest
from pagedkv.sched.sampling_params import SamplingParams
from tests.spec.test_rejection import chi_square_p_value

LOGITS = torch.tensor([[0.1, 1.2, 0.9, 0.3, -0.5, 0.0],
                       [0.8, 0.2, 0.7, 0.6, -0.2, 0.1],
                       [0.0, 0.0, 0.5, 0.5, 0.0, 0.0]])
DRAFTS = [2, 0]
SEEDS = 2000


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread (more only contend on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def request(params: SamplingParams, request_id: str = "r") -> ScheduledRequest:
    return ScheduledRequest(request_id, [4, *DRAFTS], 10, [0, 1, 2, 3], params,
                            prompt_token_ids=[1, 3, 5], output_token_ids=[3],
                            spec_token_ids=list(DRAFTS))


def test_greedy_verification_takes_the_penalised_argmax():
    sampler = Sampler()
    plain = SamplingParams(temperature=0.0)
    assert sampler.verify(LOGITS, [request(plain)])[0] == [[1]]  # 1 is not draft 2
    # With a penalty: the argmax of each row, the drafts before it counted as output.
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    rows = apply_penalties(LOGITS, [penalised] * 3, [[1, 3, 5]] * 3, [[3], [3, 2], [3, 2, 0]])
    expected = rows.argmax(-1).tolist()
    tokens, logprobs = sampler.verify(LOGITS, [request(penalised)])
    run = tokens[0]
    assert run[0] == expected[0]
    if run[0] == DRAFTS[0]:
        assert run[1] == expected[1]
    assert logprobs == [None]


def test_sampled_verification_follows_the_sampler_distribution():
    params = SamplingParams(temperature=0.8, top_k=4, repetition_penalty=1.3, seed=0)
    sampler = Sampler()
    first, second = Counter(), Counter()
    for seed in range(SEEDS):
        params.seed = seed
        req = request(params, f"r{seed}")
        run = sampler.verify(LOGITS, [req])[0][0]
        sampler.forget(req.request_id)
        first[run[0]] += 1
        if run[0] == DRAFTS[0] and len(run) > 1:
            second[run[1]] += 1
    penalised = apply_penalties(LOGITS, [params] * 3, [[1, 3, 5]] * 3,
                                [[3], [3, 2], [3, 2, 0]])
    target = sampler._probs(penalised, [params] * 3)
    kept0 = [i for i in range(6) if target[0, i] > 0]
    assert set(first) <= set(kept0)  # top-k: nothing outside it
    assert chi_square_p_value(Counter({j: first[i] for j, i in enumerate(kept0)}),
                              target[0, kept0]) > 1e-4
    kept1 = [i for i in range(6) if target[1, i] > 0]
    assert set(second) <= set(kept1)
    assert chi_square_p_value(Counter({j: second[i] for j, i in enumerate(kept1)}),
                              target[1, kept1]) > 1e-4
    assert 0 < first[DRAFTS[0]] < SEEDS


def test_logprobs_per_emitted_token_are_the_raw_ones():
    params = SamplingParams(temperature=0.0, logprobs=1)
    tokens, logprobs = Sampler().verify(LOGITS, [request(params)])
    raw = LOGITS.log_softmax(-1)
    assert len(logprobs[0]) == len(tokens[0])
    for row, (token, entry) in enumerate(zip(tokens[0], logprobs[0], strict=True)):
        assert entry[token] == float(raw[row, token])
