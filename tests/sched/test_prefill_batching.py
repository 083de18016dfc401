"""prefill_batching: 'fill' (vLLM's) admits waiting prompts into the whole step budget, the last
one chunked; 'spread' starts about sqrt(queued prompt tokens x the step's overhead) whole prompt
tokens a step. Exact tokens per step, the reference model's tokens either way, blocks back."""

from __future__ import annotations

import pytest

from pagedkv.cli import build_parser
from pagedkv.commands.engine_flags import engine_args_from_flags
from pagedkv.engine.args import EngineArgs
from pagedkv.kv.manager import KVCacheManager
from pagedkv.sched import Request, SamplingParams
from pagedkv.sched.prefill_batching import PrefillBatching
from pagedkv.sched.scheduler import Scheduler, SchedulerConfig
from pagedkv.sim.closed_loop import ClientDelays, simulate_closed_loop
from pagedkv.sim.config import SimConfig
from pagedkv.sim.latency.fitted import FittedLatency
from tests.sched.fake_runner import FakeRunner, reference_continuation, run_to_end

VOCAB = 1000
BLOCKS, BLOCK_SIZE = 256, 4
MAX_TOKENS = 3


def _request(request_id: str, prompt_len: int, arrival: float = 0.0) -> Request:
    prompt = [(11 * i + 3 * len(request_id) + ord(request_id[-1])) % VOCAB
              for i in range(prompt_len)]
    return Request(request_id=request_id, prompt_token_ids=prompt, arrival_time=arrival,
                   sampling_params=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


def _run(batching: str, prompt_lens: list[int], budget: int = 64, step_overhead: int = 8,
         decode_overhead: int = 1, threshold: int = 0) -> list[dict[str, int]]:
    """Each step's {request id: tokens computed} for prompts arriving at once, run to the end
    through the fake runner: every request's tokens are the reference's, the invariants hold
    after every step and every block comes back."""
    kv = KVCacheManager(num_blocks=BLOCKS, block_size=BLOCK_SIZE)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_model_len=512,
                             prefill_batching=batching, prefill_step_overhead_tokens=step_overhead,
                             prefill_decode_overhead_tokens=decode_overhead,
                             long_prefill_token_threshold=threshold)
    sched = Scheduler(config, kv)
    runner = FakeRunner(BLOCKS, 0, BLOCK_SIZE, VOCAB, None)
    for index, length in enumerate(prompt_lens):
        sched.add_request(_request(f"r{index}", length, arrival=index / 1000))
    steps, finished = run_to_end(sched, runner)
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert sorted(finished) == sorted(f"r{i}" for i in range(len(prompt_lens)))
    for request in finished.values():
        assert request.output_token_ids == reference_continuation(
            request.prompt_token_ids, MAX_TOKENS, VOCAB), request.request_id
    return steps


def test_fill_admits_into_the_whole_budget_and_chunks_the_last_prompt():
    steps = _run("fill", [16] * 8)
    assert steps[0] == {"r0": 16, "r1": 16, "r2": 16, "r3": 16}
    # four decodes, then 60 tokens of prompts: r4-r6 whole, r7 cut to 12
    assert steps[1] == {"r0": 1, "r1": 1, "r2": 1, "r3": 1, "r4": 16, "r5": 16, "r6": 16,
                        "r7": 12}
    assert steps[2] == {"r0": 1, "r1": 1, "r2": 1, "r3": 1, "r4": 1, "r5": 1, "r6": 1, "r7": 4}


def test_spread_starts_sqrt_of_queue_times_overhead_whole_prompts_a_step():
    steps = _run("spread", [16] * 8)
    # queue 128 x overhead 8: isqrt(1024) = 32 tokens, two prompts
    assert steps[0] == {"r0": 16, "r1": 16}
    # two decodes (overhead 8 + 2), queue 96: isqrt(960) = 30, two prompts
    assert steps[1] == {"r0": 1, "r1": 1, "r2": 16, "r3": 16}
    # four decodes (overhead 12), queue 64: isqrt(768) = 27, two prompts
    assert steps[2] == {"r0": 1, "r1": 1, "r2": 1, "r3": 1, "r4": 16, "r5": 16}
    # r0, r1 finished (3 tokens); overhead 12, queue 32: isqrt(384) = 19, two prompts
    assert steps[3] == {"r2": 1, "r3": 1, "r4": 1, "r5": 1, "r6": 16, "r7": 16}
    assert sum(steps[0].values()) + sum(steps[1].values()) < 64 + 64  # smaller steps


def test_a_queue_long_against_the_overhead_fills_the_budget_as_fill_does():
    # queue 24 x 12 = 288 tokens x overhead 64 >= 64 x 64: the whole budget, the third prompt
    # chunked (the queue behind it fills the next steps anyway)
    steps = _run("spread", [24] * 12, step_overhead=64)
    fill = _run("fill", [24] * 12, step_overhead=64)
    assert steps[0] == fill[0] == {"r0": 24, "r1": 24, "r2": 16}
    assert steps[1] == fill[1] == {"r0": 1, "r1": 1, "r2": 8, "r3": 24, "r4": 24, "r5": 6}


def test_the_queues_tail_waits_whole_for_the_next_step_rather_than_be_chunked():
    # the third prompt would be cut to 16 tokens; the next step holds it whole, so it waits
    steps = _run("spread", [24] * 3, step_overhead=1000)
    assert steps[:3] == [{"r0": 24, "r1": 24}, {"r0": 1, "r1": 1, "r2": 24},
                         {"r0": 1, "r1": 1, "r2": 1}]
    fill = _run("fill", [24] * 3, step_overhead=1000)
    assert fill[:3] == [{"r0": 24, "r1": 24, "r2": 16}, {"r0": 1, "r1": 1, "r2": 8},
                        {"r0": 1, "r1": 1, "r2": 1}]


def test_prompts_longer_than_a_step_are_still_chunked():
    # over the budget: chunked as under fill, never held back
    assert _run("spread", [100])[:2] == [{"r0": 64}, {"r0": 36}]
    # over the long-prefill cap (two requests, so it applies): chunked at the cap
    steps = _run("spread", [40, 40], threshold=32, step_overhead=1000)
    assert steps[0] == {"r0": 32, "r1": 32}
    assert steps[1] == {"r0": 8, "r1": 8}


def test_the_queue_is_summed_only_until_it_fills_the_budget():
    batching = PrefillBatching("spread", 64, 8)
    requests = [_request(f"q{i}", 10) for i in range(3)]
    assert batching.target_tokens(requests, 0, 2048) == 43  # isqrt(30 x 64)
    assert batching.target_tokens(requests, 4, 2048) == 53  # isqrt(30 x 96)
    assert batching.target_tokens(requests, 0, 40) == 40  # 30 x 64 >= 40 x 40

    class Exploding:  # a queue entry past the point where the sum reaches the budget
        @property
        def num_tokens(self) -> int:
            raise AssertionError("read past the budget")

    assert batching.target_tokens([_request("big", 100), Exploding()], 0, 64) == 64
    assert PrefillBatching("fill", 64, 8).target_tokens([Exploding()], 0, 64) > 1 << 40


def test_the_options_reach_the_scheduler_from_the_flags_and_are_checked():
    args = build_parser("serve").parse_args(["serve", "m", "--prefill-batching", "fill",
                                             "--prefill-step-overhead-tokens", "100",
                                             "--prefill-decode-overhead-tokens", "3"])
    config = SchedulerConfig.from_options(engine_args_from_flags(args, "m"),
                                          max_num_batched_tokens=64, max_model_len=128)
    assert (config.prefill_batching, config.prefill_step_overhead_tokens,
            config.prefill_decode_overhead_tokens) == ("fill", 100, 3)
    assert EngineArgs(model="m").prefill_batching == "auto"  # the default
    with pytest.raises(ValueError, match="prefill_batching"):
        EngineArgs(model="m", prefill_batching="greedy")
    with pytest.raises(ValueError, match="prefill_step_overhead_tokens"):
        EngineArgs(model="m", prefill_step_overhead_tokens=0)


def test_in_a_closed_loop_spread_cuts_mean_ttft_at_about_the_same_throughput():
    """The simulator's closed loop (clients sending their next request when the last ends):
    under fill the requests run in waves that finish together; spread staggers them."""
    latency = FittedLatency({"intercept": 0.0035, "prefill_tokens": 4.6e-5,
                             "decode_seqs": 3.9e-4})
    results = {}
    for batching in ("fill", "spread"):
        config = SimConfig(num_blocks=2000, block_size=16, max_num_seqs=64,
                           max_num_batched_tokens=2048, prefill_batching=batching)
        results[batching] = simulate_closed_loop(
            config, latency, concurrency=16, num_prompts=48, input_len=256, output_len=32,
            delays=ClientDelays(0.002, 0.0005, 0.001))
    fill, spread = results["fill"], results["spread"]
    for result in results.values():
        assert len(result.records) == 48 and all(r.num_tokens == 32 for r in result.records)
        assert _most_in_flight(result.records) == 16
    assert spread.mean_ttft < 0.8 * fill.mean_ttft
    assert spread.output_throughput > 0.98 * fill.output_throughput


def _most_in_flight(records) -> int:
    """The most requests between their client's send and their end at any moment."""
    events = sorted([(r.arrival, 1) for r in records] + [(r.finish, -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, delta in events:
        now += delta
        most = max(most, now)
    return most


def test_a_closed_loop_of_prompts_that_never_fit_ends():
    """Every prompt refused (the cache is smaller than one prompt): each refusal releases its
    client, the load ends with every request rejected, and no TTFT is reported."""
    latency = FittedLatency({"intercept": 0.001})
    result = simulate_closed_loop(SimConfig(num_blocks=8, block_size=16), latency,
                                  concurrency=2, num_prompts=5, input_len=256, output_len=4)
    assert [r.status for r in result.records] == ["rejected"] * 5
    assert result.mean_ttft != result.mean_ttft  # nan
    with pytest.raises(ValueError, match="concurrency"):
        simulate_closed_loop(SimConfig(num_blocks=8), latency, concurrency=0, num_prompts=1,
                             input_len=4, output_len=1)


def test_a_prompt_the_running_decodes_keep_from_fitting_whole_is_chunked_not_held():
    """A prompt that fits one step's budget but not beside the running decodes (which will run
    next step too) starts at once, chunked as under fill: holding it for a step that never
    comes would keep it waiting until every running request finished."""
    kv = KVCacheManager(num_blocks=BLOCKS, block_size=BLOCK_SIZE)
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=512,
                             prefill_batching="spread", prefill_step_overhead_tokens=8,
                             prefill_decode_overhead_tokens=1)
    sched = Scheduler(config, kv)
    runner = FakeRunner(BLOCKS, 0, BLOCK_SIZE, VOCAB, None)
    long_decode = Request(request_id="d", prompt_token_ids=[5] * 8, arrival_time=0.0,
                          sampling_params=SamplingParams(max_tokens=40, ignore_eos=True))
    sched.add_request(long_decode)
    steps, finished = run_to_end(sched, runner, late={2: _request("p", 64, arrival=1.0)})
    assert steps[2] == {"d": 1, "p": 63} and steps[3] == {"d": 1, "p": 1}
    assert sorted(finished) == ["d", "p"]
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert finished["p"].output_token_ids == reference_continuation(
        finished["p"].prompt_token_ids, MAX_TOKENS, VOCAB)


def test_auto_is_spread_on_cpu_and_fill_on_a_gpu():
    """The default "auto" resolves by device when the engine builds its scheduler (spread's
    step costs are a CPU step's); a named rule is kept on either device."""
    def rule(mode: str | None, on_cuda: bool) -> str:
        args = EngineArgs(model="m") if mode is None else EngineArgs(model="m",
                                                                   prefill_batching=mode)
        return SchedulerConfig.from_options(args, max_num_batched_tokens=64, max_model_len=128,
                                            on_cuda=on_cuda).prefill_batching

    assert (rule(None, False), rule(None, True)) == ("spread", "fill")
    assert (rule("fill", False), rule("spread", True)) == ("fill", "spread")
    # a config built directly (the simulator's): "auto" as on CPU
    kv = KVCacheManager(num_blocks=BLOCKS, block_size=BLOCK_SIZE)
    assert Scheduler(SchedulerConfig(), kv).batching.spreads
    assert SimConfig(num_blocks=64).scheduler_config().prefill_batching == "auto"
