"""vLLM's long_prefill_token_threshold: a request computes at most that many tokens a step, so a
long prompt is prefilled in chunks and a short request behind it starts at once; the tokens are
the reference model's either way."""

from __future__ import annotations

import pytest

from pagedkv.cli import build_parser
from pagedkv.commands.engine_flags import engine_args_from_flags
from pagedkv.engine.args import EngineArgs
from pagedkv.kv.manager import KVCacheManager
from pagedkv.sched import Request, SamplingParams
from pagedkv.sched.scheduler import Scheduler, SchedulerConfig
from tests.sched.fake_runner import FakeRunner, reference_continuation, run_to_end

VOCAB = 1000
BLOCKS, BLOCK_SIZE = 256, 4


def _request(request_id: str, prompt_len: int, arrival: float) -> Request:
    prompt = [(7 * i + len(request_id)) % VOCAB for i in range(prompt_len)]
    return Request(request_id=request_id, prompt_token_ids=prompt, arrival_time=arrival,
                   sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))


def _run(threshold: int, late: dict[int, Request] | None = None,
         requests: tuple[Request, ...] | None = None,
         ) -> tuple[list[dict[str, int]], dict[str, Request]]:
    """Each step's {request id: tokens computed}, and the finished requests. `requests` (default:
    a 200-token prompt and a 5-token one) arrive at once; `late`: {step index: a request that
    arrives before that step}."""
    kv = KVCacheManager(num_blocks=BLOCKS, block_size=BLOCK_SIZE)
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=1024,
                             long_prefill_token_threshold=threshold)
    sched = Scheduler(config, kv)
    runner = FakeRunner(BLOCKS, 0, BLOCK_SIZE, VOCAB, None)
    for request in requests or (_request("long", 200, 0.0), _request("short", 5, 1.0)):
        sched.add_request(request)
    steps, finished = run_to_end(sched, runner, late)
    assert kv.num_free_blocks == kv.num_usable_blocks
    return steps, finished


def _first_step(steps: list[dict[str, int]], request_id: str) -> int:
    return next(i for i, step in enumerate(steps) if request_id in step)


def test_a_capped_long_prompt_lets_a_short_request_start_in_the_first_step():
    uncapped, _ = _run(0)
    capped, finished = _run(16)
    # uncapped: the long prompt takes the whole budget for three steps; the short one waits
    assert [step.get("long") for step in uncapped[:4]] == [64, 64, 64, 8]
    assert _first_step(uncapped, "short") == 3
    # capped: 16 tokens a step for the long prompt, and the short one runs beside it at once
    assert capped[0] == {"long": 16, "short": 5}
    # 16 a step while the short request runs (4 steps); alone afterwards, the whole budget
    assert [step.get("long") for step in capped[:7]] == [16, 16, 16, 16, 64, 64, 8]
    assert all("short" not in step for step in capped[4:])
    assert sum(step.get("long", 0) for step in capped) == 200 + 4 - 1
    assert sorted(finished) == ["long", "short"]
    for request_id, request in finished.items():
        assert request.output_token_ids == reference_continuation(
            request.prompt_token_ids, 4, VOCAB), request_id


def test_the_option_reaches_the_scheduler_from_the_flag_and_is_checked():
    args = build_parser("serve").parse_args(["serve", "m", "--long-prefill-token-threshold",
                                             "32"])
    engine_args = engine_args_from_flags(args, "m")
    config = SchedulerConfig.from_options(engine_args, max_num_batched_tokens=64,
                                          max_model_len=128)
    assert config.long_prefill_token_threshold == 32
    assert EngineArgs(model="m").long_prefill_token_threshold == 0
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be an integer >= 0, "
                                         "got -1"):
        EngineArgs(model="m", long_prefill_token_threshold=-1)


def test_a_long_prompt_alone_is_not_capped_and_is_capped_again_once_another_arrives():
    """vLLM's rule: the cap keeps a long prompt from starving the others, so a request alone
    takes the whole budget (its first token two steps sooner here); a second arrival brings the
    cap back from the next step."""
    alone, finished = _run(16, requests=(_request("long", 200, 0.0),))
    assert [step["long"] for step in alone[:4]] == [64, 64, 64, 8]
    assert len(alone) == 4 + 3  # 200 prompt tokens in 4 steps, then 3 more decode steps
    assert finished["long"].output_token_ids == reference_continuation(
        finished["long"].prompt_token_ids, 4, VOCAB)
    joined, finished = _run(16, late={1: _request("short", 5, 1.0)},
                            requests=(_request("long", 200, 0.0),))
    assert joined[0] == {"long": 64}
    assert joined[1] == {"long": 16, "short": 5}
    assert sum(step.get("long", 0) for step in joined) == 200 + 4 - 1
    assert sorted(finished) == ["long", "short"]
