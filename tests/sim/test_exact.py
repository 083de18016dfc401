"""The simulator makes the real engine's scheduling decisions: one workload through LLMEngine
(tiny random model, a fixed step-time function on a virtual clock) and through the simulator,
compared step by step (scheduled requests, positions, tokens) and in preemptions."""

from __future__ import annotations

import pytest

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.sim.config import SimConfig
from pagedkv.sim.latency import FunctionLatency, StepShape
from pagedkv.sim.records import StepRecord
from pagedkv.sim.simulator import simulate
from pagedkv.sim.traces import prompt_token_ids
from tests.sim.workloads import shared_prefix_trace


def step_time(shape: StepShape) -> float:
    return 1e-3 + 2e-4 * shape.prefill_tokens + 1e-4 * shape.decode_seqs \
        + 1e-6 * shape.decode_context + 5e-5 * shape.swapped_blocks


def run_engine(engine: LLMEngine, trace) -> tuple[list[StepRecord], dict[str, float]]:
    """Drive the real engine on a virtual clock exactly as the simulator steps: arrivals up
    to the clock join before each step; a step advances the clock by `step_time`."""
    sched = engine.scheduler
    captured = []
    real_schedule = sched.schedule

    def schedule():
        out = real_schedule()
        captured.append(out)
        return out

    sched.schedule = schedule
    vocab = engine.vocab_size
    steps: list[StepRecord] = []
    finish: dict[str, float] = {}
    clock, i = 0.0, 0
    while i < len(trace) or engine.has_unfinished_requests():
        while i < len(trace) and trace[i].arrival <= clock:
            r = trace[i]
            engine.add_request(str(i), prompt_token_ids(r, vocab, i),
                               SamplingParams(max_tokens=r.output_length, ignore_eos=True),
                               arrival_time=r.arrival)
            i += 1
        if not engine.has_unfinished_requests():
            clock = trace[i].arrival
            continue
        outputs = engine.step()
        out = captured[-1]
        if out.scheduled:
            clock += step_time(StepShape.of(out))
            steps.append(StepRecord(
                tuple((s.request_id, s.start_pos, len(s.token_ids)) for s in out.scheduled),
                sched.num_preemptions, sched.num_swaps))
        elif i < len(trace):
            clock = max(clock, trace[i].arrival)
        for o in outputs:
            if o.finished:
                finish[o.request_id] = clock
        engine.check_invariants()
    return steps, finish


@pytest.mark.parametrize("mode, cap, batching", [
    ("recompute", 0, "fill"), ("swap", 0, "fill"), ("recompute", 6, "fill"),
    ("recompute", 0, "spread")])
def test_simulator_makes_the_engines_decisions(tiny_llama, mode, cap, batching):
    """`cap`: long_prefill_token_threshold (0: none); `batching`: prefill_batching (the
    workload preempts under 'fill')."""
    args = EngineArgs(model=str(tiny_llama), device="cpu", block_size=4,
                      num_gpu_blocks_override=36, max_num_batched_tokens=24, max_num_seqs=5,
                      max_model_len=256, preemption_mode=mode, long_prefill_token_threshold=cap,
                      prefill_batching=batching,
                      swap_space=0.00002 if mode == "swap" else 4.0, cpu_kernels="off")
    engine = LLMEngine(args)
    trace = shared_prefix_trace(num=14, block_tokens=8)
    engine_steps, engine_finish = run_engine(engine, trace)
    setup = engine.kv_setup
    config = SimConfig(num_blocks=setup.num_blocks, block_size=4, max_num_seqs=5,
                       max_num_batched_tokens=24, max_model_len=engine.max_model_len,
                       preemption_mode=mode, num_host_blocks=setup.num_host_blocks,
                       long_prefill_token_threshold=cap, prefill_batching=batching,
                       vocab_size=engine.vocab_size,
                       jump=False)
    result = simulate(trace, config, FunctionLatency(step_time), record_steps=True)
    sim_steps = result.instances[0].steps
    assert engine_steps[-1].num_preemptions > 0 or batching != "fill"  # the workload preempts
    if mode == "swap":
        assert engine_steps[-1].num_swaps > 0
    assert len(sim_steps) == len(engine_steps)
    for i, (sim, real) in enumerate(zip(sim_steps, engine_steps, strict=True)):
        assert sim == real, f"step {i} differs"
    sim_finish = {str(r.index): r.finish for r in result.records}
    assert sim_finish == pytest.approx(engine_finish, rel=0, abs=1e-12)
    assert all(r.status == "length" and r.num_tokens == r.output_tokens for r in result.records)
    sched = result.instances[0].scheduler
    assert sched.prefix_cache_hits == engine.scheduler.prefix_cache_hits > 0
    sched.check_invariants()
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_usable_blocks
