"""Overlapped scheduling (`async_scheduling`, pagedkv/engine/overlap.py, issue 26): step N+1 is
built while step N's forward pass runs, and every request's tokens equal the serial loop's
(and transformers' for greedy), with seeded sampling, n > 1, prefix-cache hits, stop strings,
bad words, min_tokens and preemption (recompute and swap)."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.overlap import OverlappedStepper
from tests.engine.conftest import hf_greedy, make_prompts

pytestmark = pytest.mark.timeout(240)


def _params(stop_text: str) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=9, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=14, stop=[stop_text]),
        SamplingParams(temperature=0.8, seed=2, max_tokens=10, min_tokens=6, bad_words=["a b"]),
        SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1),
    ]


def _run(llm, prompts, params):  # noqa: ANN001, ANN202
    """(exact: tokens, text, finish per sample; float: logprobs) of every request."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.check_invariants()
    exact = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
             for o in outs]
    floats = [[(c.cumulative_logprob, c.logprobs) for c in o.outputs] + [o.prompt_logprobs]
              for o in outs]
    return exact, floats


def _assert_same(got, expected):  # noqa: ANN001, ANN202
    # Tokens exactly; logprobs to float rounding (other requests share a step's matmuls).
    assert got[0] == expected[0]
    assert _flat(got[1]) == pytest.approx(_flat(expected[1]), rel=1e-5, abs=1e-5)


def _flat(value):  # noqa: ANN001, ANN202
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in (k, *_flat(value[k]))]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [] if value is None else [value]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_same_tokens_as_the_serial_loop(tiny_llama, make_llm, preemption_mode):
    # 40 blocks of 4 tokens for 12 requests of up to 60 + 14 tokens: requests are preempted
    # (and half share a 40-token prefix: prefix-cache hits).
    prompts = make_prompts(seed=3, vocab=400, num=12, shared_prefix=40, lengths=(5, 20))
    kw = dict(block_size=4, num_gpu_blocks_override=40, max_model_len=128,
              preemption_mode=preemption_mode, swap_space=0.01, max_num_batched_tokens=64)
    serial = make_llm(tiny_llama, **kw)
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    first = serial.generate({"prompt_token_ids": prompts[3]}, greedy, use_tqdm=False)[0]
    stop_text = first.outputs[0].text[4:7]  # a stop string the greedy text contains
    params = [_params(stop_text)[i % 6] for i in range(len(prompts))]
    token_prompts = [{"prompt_token_ids": p} for p in prompts]
    expected = _run(serial, token_prompts, params)
    overlapped = make_llm(tiny_llama, async_scheduling=True, **kw)
    assert isinstance(overlapped.llm_engine.core.overlap, OverlappedStepper)
    got = _run(overlapped, token_prompts, params)
    _assert_same(got, expected)
    stats = overlapped.llm_engine.get_stats()
    assert stats.num_preemptions > 0  # the case under test happened
    if preemption_mode == "swap":
        assert stats.num_swaps > 0
    assert stats.prefix_cache_hits > 0
    assert expected[0][3][0][2:] == ("stop", stop_text)
    assert len(expected[0][2]) == 3 and expected[0][2][1][0] != expected[0][2][2][0]
    for i in (0, 6):  # greedy: transformers' tokens
        assert got[0][i][0][0] == hf_greedy(tiny_llama, prompts[i], 14)
    # Runs again on the same engine (a step may still be in flight): same tokens.
    _assert_same(_run(overlapped, token_prompts, params), expected)


def test_a_step_is_built_while_the_forward_runs(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, async_scheduling=True, num_gpu_blocks_override=64, block_size=4)
    engine = llm.llm_engine
    core = engine.core
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8, 9]},
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        steps += 1
        engine.check_invariants()
        if engine.has_unfinished_requests():
            assert core.overlap.is_running  # the next forward runs while we process
    assert tokens == {"a": hf_greedy(tiny_llama, [5, 6, 7, 8, 9], 4),
                      "b": hf_greedy(tiny_llama, [5, 6, 7], 2)}
    assert steps == 4  # one forward per step: prefill + 3 decodes, nothing thrown away


def test_async_scheduling_is_validated():
    with pytest.raises(ValueError, match="async_scheduling must be a bool, got 'yes'"):
        EngineArgs(model="m", async_scheduling="yes")
    with pytest.raises(ValueError, match="async_scheduling=True does not support the KV store"):
        EngineArgs(model="m", async_scheduling=True, kv_offloading_size=1.0)


def _engine_tokens(engine) -> dict[str, list]:  # noqa: ANN001
    requests = {"greedy": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                "seeded": SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=8,
                                         ignore_eos=True)}
    for rid, params in requests.items():
        engine.add_request(rid, [5, 6, 7, 8, 9, 10], params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    engine.check_invariants()
    return done


def test_core_process_with_async_scheduling(tiny_llama):
    from pagedkv.engine.llm_engine import LLMEngine

    def args(**kw) -> EngineArgs:  # noqa: ANN003
        return EngineArgs(model=str(tiny_llama), dtype="float32", block_size=4,
                          num_gpu_blocks_override=64, max_model_len=128, seed=0,
                          cpu_threads=1, **kw)

    serial = LLMEngine(args())
    try:
        expected = _engine_tokens(serial)
    finally:
        serial.shutdown()
    overlapped = LLMEngine(args(async_scheduling=True), core_process=True)
    try:
        assert _engine_tokens(overlapped) == expected
        assert overlapped.get_stats().num_free_blocks == overlapped.get_stats().num_blocks
    finally:
        overlapped.shutdown()
    assert expected["greedy"] == [hf_greedy(tiny_llama, [5, 6, 7, 8, 9, 10], 10)]


def test_a_failed_overlapped_step_ends_its_requests_and_the_engine_goes_on(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, async_scheduling=True, num_gpu_blocks_override=64, block_size=4)
    engine = llm.llm_engine
    core = engine.core
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8, 9]}, greedy)
    engine.step()  # a forward runs; the next step is scheduled ahead of it
    real = core.scheduler.update
    core.scheduler.update = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    core.scheduler.update = real
    outputs = engine.outputs.process(core.fail_all("boom"))[0]  # what the server loop does
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outputs] == [("a", "error")]
    engine.check_invariants()
    assert not core.scheduler._unapplied
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, greedy, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama, [5, 6, 7, 8, 9], 6)


@pytest.mark.parametrize("device, current, want", [("cuda", 3, 3), ("cuda:1", 3, 1)])
def test_the_forward_thread_gets_an_indexed_cuda_device(monkeypatch, device, current, want):
    """torch.cuda.set_device refuses a bare "cuda": the forward thread's initializer names the
    index, the current device's where the stepper is built unless the engine's names one."""
    import torch

    from pagedkv.engine.overlap import _worker_init

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    _worker_init(device)()
    assert calls == [torch.device("cuda", want)]
    _worker_init("cpu")()
    assert len(calls) == 1
