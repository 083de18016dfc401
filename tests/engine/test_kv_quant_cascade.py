"""The engine with an int8 or fp8 KV cache read in place: requests that hit a cached prefix
decode through cascade attention over its quantized blocks (backends/quantized_native.py) and
produce the same greedy tokens and log-probabilities as the same engine without the cascade
split, with a request of its own in the batch and suffixes of different lengths."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from tests.engine.conftest import make_prompts
from tests.model.test_kv_quant_cascade import cascade_spy

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def qwen2_hd64(tmp_path_factory):
    """Head size 64 (the tiled kernel's), GQA 5: layer 0 full, layer 1 sliding over 8."""
    from tests.tiny_models import build_tiny_hf_model

    return build_tiny_hf_model(tmp_path_factory.mktemp("qwen2_hd64") / "m", "qwen2_hd64")


def _run(make_llm, model_dir, cache_dtype, dtype, prompts, monkeypatch, cascade,
         kernels="wait"):
    """(token ids, sampled tokens' logprobs, tiled prefix calls) of the prompts (the first
    alone, caching the prefix), with or without the cascade split (kernels "off": the torch
    path over a dequantized copy, which cascades in torch)."""
    with cascade_spy(monkeypatch, cascade) as calls:
        llm = make_llm(model_dir, dtype=dtype, block_size=16, kv_cache_dtype=cache_dtype,
                       enable_prefix_caching=True, cpu_kernels=kernels, device="cpu")
        outs = [o for batch in (prompts[:1], prompts[1:])
                for o in llm.generate([{"prompt_token_ids": p} for p in batch], PARAMS,
                                      use_tqdm=False)]
        llm.llm_engine.check_invariants()
    assert all(o.num_cached_tokens >= 80 for o in outs[1:] if len(o.prompt_token_ids) > 80)
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].logprobs for o in outs], \
        calls


def _assert_same_until_a_tie(a_tokens, a_logprobs, b_tokens, b_logprobs, tol, ties):
    """Equal tokens with log-probabilities within `tol`; with `ties`, a sequence may part at a
    step whose two best tokens are within `tol` of each other in both runs (a bfloat16 near
    tie), and is compared up to there."""
    for a, la, b, lb in zip(a_tokens, a_logprobs, b_tokens, b_logprobs, strict=True):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                assert ties, f"tokens part at step {i}: {a} != {b}"
                assert abs(la[i][x] - la[i][y]) < tol and abs(lb[i][x] - lb[i][y]) < tol
                break
            assert la[i][x] == pytest.approx(lb[i][x], abs=tol)


@pytest.mark.parametrize("cache_dtype, dtype", [("int8", "float32"), ("fp8", "float32"),
                                                ("fp8_e5m2", "float32"), ("int8", "bfloat16")])
def test_cascade_over_quantized_prefix_blocks_keeps_tokens(qwen2_hd64, make_llm, monkeypatch,
                                                           cache_dtype, dtype):
    """Three of six requests hit a 96-token cached prefix (suffixes of 2-20 tokens), three
    are their own: the shared prefix goes through the quantized cascade, and tokens and
    logprobs equal the in-place path without it (float32: and the torch path without the
    kernels; bfloat16: up to a near tie)."""
    prompts = make_prompts(seed=5, vocab=400, num=7, shared_prefix=96, lengths=(2, 20))
    tokens, logprobs, calls = _run(make_llm, qwen2_hd64, cache_dtype, dtype, prompts,
                                   monkeypatch, True)
    assert calls, "no decode attended the shared prefix through the tiled kernel"
    plain_tokens, plain_logprobs, plain_calls = _run(make_llm, qwen2_hd64, cache_dtype, dtype,
                                                     prompts, monkeypatch, False)
    assert not plain_calls
    if dtype == "float32":
        _assert_same_until_a_tie(tokens, logprobs, plain_tokens, plain_logprobs, 1e-3, False)
        torch_tokens, torch_logprobs, _ = _run(make_llm, qwen2_hd64, cache_dtype, dtype,
                                               prompts, monkeypatch, True, kernels="off")
        _assert_same_until_a_tie(tokens, logprobs, torch_tokens, torch_logprobs, 1e-3, False)
    else:
        _assert_same_until_a_tie(tokens, logprobs, plain_tokens, plain_logprobs, 5e-2, True)
        assert sum(a == b for a, b in zip(tokens, plain_tokens, strict=True)) >= 5
