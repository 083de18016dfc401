"""The CPU warm-up at engine start (pagedkv/engine/warmup.py, issue 26): its steps fit the
budgets and the cache, and they leave nothing behind: no block held, no generator advanced
(unseeded sampling gives the same tokens as an engine without the warm-up)."""

from __future__ import annotations

from pagedkv import SamplingParams
from pagedkv.engine import compose
from pagedkv.engine.warmup import SKIP_ENV, WARMUP_TOKENS, warmup_steps
from tests.engine.conftest import make_prompts


def test_warmup_steps_fit_the_budgets_and_the_cache():
    prefill, decode, drop = warmup_steps(8192, 6, 1000, 16, 400)
    lens = [len(s.token_ids) for s in prefill.scheduled]
    assert sum(lens) == WARMUP_TOKENS and max(lens) <= 999  # chunks of max_model_len - 1
    blocks = [b for s in prefill.scheduled for b in s.block_table]
    assert len(set(blocks)) == len(blocks) and min(blocks) == 1 and max(blocks) < 400
    assert all(len(s.block_table) * 16 > len(s.token_ids) for s in prefill.scheduled)
    assert [len(s.token_ids) for s in decode.scheduled] == [1] * 6
    assert all(s.sampling_params.temperature == 0.0 for s in prefill.scheduled + decode.scheduled)
    assert set(drop.finished_request_ids) == {s.request_id for s in prefill.scheduled
                                              + decode.scheduled}
    small, _, _ = warmup_steps(100, 2, 64, 4, 9)  # 8 usable blocks: 7 * 4 tokens at most
    assert sum(len(s.token_ids) for s in small.scheduled) == 28
    assert warmup_steps(100, 2, 64, 4, 2) == []  # no room


def test_warmup_leaves_no_trace(tiny_llama, make_llm, monkeypatch):
    prompts = [{"prompt_token_ids": p} for p in make_prompts(seed=7, vocab=400, num=4)]
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)  # unseeded
    ran = []
    real = compose.warm_up
    monkeypatch.setattr(compose, "warm_up", lambda *parts: ran.append(real(*parts)))
    monkeypatch.setenv(SKIP_ENV, "1")  # as the test suite sets it: skipped
    make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=128, device="cpu")
    assert not ran
    monkeypatch.delenv(SKIP_ENV)
    warm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=128, device="cpu")
    assert ran  # it ran (CPU)
    warm_out = [o.outputs[0].token_ids for o in warm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(compose, "warm_up", lambda *parts: None)
    cold = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=128, device="cpu")
    cold_out = [o.outputs[0].token_ids for o in cold.generate(prompts, params, use_tqdm=False)]
    assert warm_out == cold_out
