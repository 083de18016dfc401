"""Swap preemption with a host pool that fills, and a model step that raises: outputs stay exact
(equal to transformers), only the failed step's requests end with an error, no block leaks."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from pagedkv.config.errors import ErrorKind
from pagedkv.model.kv_cache import KVCache
from tests.engine.conftest import assert_pool_empty, hf_greedy, make_prompts

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# The tiny Llama's page: 2 layers x (K, V) x 2 KV heads x 4 tokens x 16 dims x 4 bytes.
PAGE_BYTES = 2 * 2 * 2 * 4 * 16 * 4


def _swap_space(num_host_blocks: int) -> float:
    return num_host_blocks * PAGE_BYTES / 2**30


def test_swap_with_a_host_pool_that_fills_matches_transformers(tiny_llama, make_llm):
    """8 host blocks for 8 growing requests on 31 device blocks: swaps happen, then the host
    pool is full and preemption falls back to recompute; every output equals transformers'."""
    prompts = make_prompts(seed=11, vocab=400, num=8, shared_prefix=0, lengths=(6, 10))
    max_tokens = 24
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=32, preemption_mode="swap",
                   swap_space=_swap_space(8), dtype="float32")
    kv = llm.llm_engine.scheduler.kv_cache_manager
    runner_cache: KVCache = llm.llm_engine.runner.kv_cache
    # One number sizes both: every id the host pool can hand out has a slot in the host tensor.
    assert kv.host_pool.num_usable_blocks == 8
    assert runner_cache.host_kv.shape[3] == kv.host_pool.num_blocks == 9
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, max_tokens)
    stats = llm.llm_engine.get_stats()
    assert stats.num_swaps > 0, "no swap happened: the test does not test swapping"
    assert stats.num_preemptions > stats.num_swaps, "the host pool never filled"


def test_swap_to_the_last_host_block_through_llm(tiny_llama, make_llm):
    """The issue's repro, offline: a host pool so small that its last id is used at once."""
    prompts = make_prompts(seed=12, vocab=400, num=12, shared_prefix=0, lengths=(6, 12))
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=16, preemption_mode="swap",
                   swap_space=_swap_space(2), dtype="float32")
    params = SamplingParams(temperature=0.8, n=2, max_tokens=12, ignore_eos=True, seed=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length"
               for o in outputs for c in o.outputs)
    assert llm.llm_engine.get_stats().num_swaps > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("fail_at", [1, 4, 9])
def test_a_failing_step_ends_only_its_requests(tiny_llama, make_llm, mode, fail_at):
    """Step `fail_at` raises inside the runner: the requests of that step (scheduled, swapped
    out or in) finish with an error naming the fault; every other request equals transformers."""
    prompts = make_prompts(seed=13, vocab=400, num=6, shared_prefix=0, lengths=(10, 20))
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=20, preemption_mode=mode,
                   swap_space=_swap_space(8), max_num_seqs=3, dtype="float32")
    engine = llm.llm_engine
    real_execute = engine.runner.execute
    calls, victims = [0], set()

    def execute(out):
        calls[0] += 1
        if calls[0] == fail_at:
            victims.update(r.request_id for r in out.scheduled)
            victims.update(out.swapped_request_ids)
            raise RuntimeError("injected fault")
        return real_execute(out)

    engine.runner.execute = execute
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.check_invariants()
    assert victims and len(victims) < len(prompts)
    assert set(finished) == {str(i) for i in range(len(prompts))}
    for rid, output in finished.items():
        completion = output.outputs[0]
        if rid in victims:
            assert completion.finish_reason == "error"
            assert "injected fault" in output.error and "model step failed" in output.error
            assert output.error_kind is ErrorKind.INTERNAL
        else:
            assert output.error is None and output.error_kind is None
            assert completion.token_ids == hf_greedy(tiny_llama, prompts[int(rid)], MAX_TOKENS)
    assert_pool_empty(llm)
