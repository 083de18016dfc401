"""Sampler: exact masks, seeded reproducibility, penalties by hand, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.model.sampler import Sampler, apply_min_p, apply_penalties, apply_top_k_top_p
from pagedkv.sched.output import ScheduledRequest
from pagedkv.sched.sampling_params import SamplingParams

NEG = float("-inf")


def req(rid, params, n=1, prompt=(), output=(), sample_index=0, banned=()):
    return ScheduledRequest(rid, [0], 0, [1], params, num_samples=n, prompt_token_ids=list(prompt),
                            output_token_ids=list(output), sample_index=sample_index,
                            banned_token_ids=tuple(banned))


def kept(logits):
    return [i for i, x in enumerate(logits.tolist()) if x != NEG]


def test_top_k_top_p_min_p_masks_exact():
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15],
                                     [0.05, 0.4, 0.1, 0.3, 0.15],
                                     [0.05, 0.4, 0.1, 0.3, 0.15]]))
    out = apply_top_k_top_p(logits, torch.tensor([2, 5, 5]), torch.tensor([1.0, 0.7, 0.71]))
    assert kept(out[0]) == [1, 3]
    assert kept(out[1]) == [1, 3]  # 0.4 + 0.3 reaches 0.7
    assert kept(out[2]) == [1, 3, 4]  # needs 0.15 more to reach 0.71
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])
    out = apply_min_p(logits, torch.tensor([0.3, 0.5, 0.0]))
    assert kept(out[0]) == [1, 3, 4]  # >= 0.3 * 0.4 = 0.12
    assert kept(out[1]) == [1, 3]
    assert kept(out[2]) == [0, 1, 2, 3, 4]


def test_top_k_sampling_only_draws_kept_tokens():
    sampler = Sampler(seed=0)
    logits = torch.randn(1, 50)
    allowed = set(logits[0].topk(3).indices.tolist())
    params = SamplingParams(temperature=1.5, top_k=3, seed=3)
    toks, _ = sampler(logits, [req("a", params, n=200)])
    assert set(toks[0]) <= allowed and len(set(toks[0])) == 3


def test_greedy_and_seeded_reproducible_whatever_the_batch():
    logits = torch.randn(3, 100)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=42)
    alone, _ = Sampler(seed=1)(logits[1:2], [req("s", seeded, n=4)])
    batch = [req("g", SamplingParams(temperature=0.0)), req("s", seeded, n=4),
             req("u", SamplingParams(temperature=1.0))]
    mixed, _ = Sampler(seed=2)(logits, batch)
    assert mixed[1] == alone[0]
    assert mixed[0] == [int(logits[0].argmax())]
    assert len(set(alone[0])) > 1  # samples of one request differ (seed + i)
    # Sample i of an n > 1 request equals a fresh child with sample_index i and n = 1.
    child, _ = Sampler(seed=5)(logits[1:2], [req("c", seeded, sample_index=2)])
    assert child[0][0] == alone[0][2]
    # Unseeded requests: reproducible from the runner's seed.
    a, _ = Sampler(seed=9)(logits, [req(str(i), SamplingParams()) for i in range(3)])
    b, _ = Sampler(seed=9)(logits, [req(str(i), SamplingParams()) for i in range(3)])
    assert a == b


def test_children_continue_their_samples_stream():
    """After the parent's n samples, child i (id parent#i) draws the next number of stream i."""
    logits = torch.zeros(1, 1000)
    params = SamplingParams(seed=11, n=3)
    sampler = Sampler()
    first, _ = sampler(logits, [req("p", params, n=3)])
    second, _ = sampler(logits.repeat(3, 1), [req("p", params), req("p#1", params, sample_index=1),
                                              req("p#2", params, sample_index=2)])
    for i in range(3):
        gen = torch.Generator().manual_seed(11 + i)
        draws = [int(torch.empty(1000).exponential_(generator=gen).argmin()) for _ in range(2)]
        assert [first[0][i], second[i][0]] == draws


def test_banned_tokens_never_sampled():
    logits = torch.tensor([[5.0, 1.0, 0.0, 4.0]])
    toks, _ = Sampler()(logits, [req("g", SamplingParams(temperature=0.0), banned=[0])])
    assert toks == [[3]]
    toks, _ = Sampler()(logits, [req("s", SamplingParams(seed=1), n=50, banned=[0, 3])])
    assert set(toks[0]) <= {1, 2}


def test_generators_advance_and_are_forgotten():
    logits = torch.zeros(1, 1000)
    sampler = Sampler()
    params = SamplingParams(seed=7)
    first = [sampler(logits, [req("a", params)])[0][0][0] for _ in range(5)]
    assert len(set(first)) > 1  # the stream advances between steps
    sampler.forget("a")
    again = [sampler(logits, [req("a", params)])[0][0][0] for _ in range(5)]
    assert again == first


def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [params], prompt_ids=[[0, 1]], output_ids=[[3, 3, 1]])
    expected = torch.tensor([[2.0 / 2, -1.0 * 2 - 0.25 - 0.5, 0.5, 3.0 / 2 - 0.5 - 0.5, -2.0]])
    torch.testing.assert_close(out, expected)
    same = apply_penalties(logits, [SamplingParams()], [[0]], [[1]])
    assert torch.equal(same, logits)


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.2)
    toks, _ = Sampler()(logits, [req("a", params, output=[0])])
    assert toks == [[1]]


def test_logprobs_raw_topn_plus_sampled():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]])
    lp = logits.log_softmax(-1)[0]
    params = SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=5.0)
    toks, logprobs = Sampler()(logits, [req("a", params, output=[1])])
    assert toks == [[2]]  # the penalty moved the argmax from 1 to 2
    assert logprobs[0] == [{1: pytest.approx(lp[1].item()), 2: pytest.approx(lp[2].item())}]
    params = SamplingParams(temperature=1.0, top_k=1, logprobs=0, seed=0)
    toks, logprobs = Sampler()(torch.tensor([[0.0, 5.0, 1.0]]), [req("b", params, n=2)])
    expected = math.log(math.exp(5) / (1 + math.exp(5) + math.e))
    assert toks == [[1, 1]] and logprobs[0] == [{1: pytest.approx(expected, abs=1e-6)}] * 2
    _, none = Sampler()(logits, [req("c", SamplingParams())])
    assert none == [None]
