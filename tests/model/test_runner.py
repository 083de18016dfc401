"""ModelRunner: input validation, n > 1 sampling, logprobs, device and dtype choice."""

from __future__ import annotations

import pytest
import torch

from pagedkv.model import ModelRunner
from pagedkv.sched.output import ScheduledRequest, SchedulerOutput
from pagedkv.sched.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def runner(tiny_llama):
    return ModelRunner(tiny_llama, block_size=4, num_blocks=32, seed=3)


def test_defaults(runner, tiny_llama):
    assert runner.device == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert runner.dtype == torch.float32 and runner.model_config.num_layers == 2
    assert runner.execute(SchedulerOutput()).sampled_token_ids == {}
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        ModelRunner(tiny_llama, block_size=4, num_blocks=8, dtype="int8")


def test_block_table_too_short(runner):
    req = ScheduledRequest("a", list(range(5, 14)), 0, [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="request 'a': block table has 2 blocks, 3 needed"):
        runner.execute(SchedulerOutput(scheduled=[req]))


def test_n_samples_seeded_and_logprobs(runner):
    params = SamplingParams(n=3, temperature=1.0, seed=5, logprobs=2)
    prompt = [1, 20, 21, 22, 23, 24]

    def run():
        req = ScheduledRequest("p", prompt, 0, [1, 2], params, num_samples=3, prompt_token_ids=prompt)
        other = ScheduledRequest("q", prompt[:3], 0, [3], SamplingParams(temperature=0.0))
        out = runner.execute(SchedulerOutput(scheduled=[other, req], finished_request_ids=["p", "p#1", "p#2"]))
        return out.sampled_token_ids["p"], out.logprobs["p"], out.sampled_token_ids["q"]

    toks, logprobs, greedy = run()
    assert len(toks) == 3 and len(greedy) == 1 and "q" not in runner.execute(
        SchedulerOutput(scheduled=[ScheduledRequest("q", [1, 2], 0, [3], SamplingParams())])).logprobs
    assert run()[0] == toks  # the seed (and forgetting finished requests) makes it repeatable
    for tok, lp in zip(toks, logprobs, strict=True):
        assert tok in lp and 2 <= len(lp) <= 3 and all(v <= 0 for v in lp.values())
