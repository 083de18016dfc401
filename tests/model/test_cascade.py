"""Cascade attention pieces: log-sum-exp attention and the exact merge of partial results."""

from __future__ import annotations

import pytest
import torch

from pagedkv.model.cascade import (
    SharedPrefix,
    attention_with_lse,
    attention_with_lse_reference,
    merge_states,
    shared_prefix_attention,
)


def _inputs(dtype, seed=0, b=2, h=3, m=5, n=40, d=16):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, x, d, generator=gen).to(dtype) for x in (m, n, n))
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_lse_matches_softmax(dtype):
    q, k, v = _inputs(dtype)
    hidden = torch.rand(q.shape[0], 1, q.shape[2], k.shape[2],
                        generator=torch.Generator().manual_seed(1)) < 0.3
    hidden[..., 0] = False  # every row sees a key
    bias = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))
    scores = (q.double() @ k.double().transpose(-1, -2)) * 0.25 + bias.double()
    ref_lse = torch.logsumexp(scores, -1)
    ref = torch.softmax(scores, -1) @ v.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for fn in (attention_with_lse, attention_with_lse_reference):
        out, lse = fn(q, k, v, bias, 0.25)
        assert out.dtype == dtype and lse.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-4)


def test_merge_of_two_halves_is_attention_over_all_keys():
    q, k, v = _inputs(torch.float32, seed=2)
    full, full_lse = attention_with_lse_reference(q, k, v, None, 0.3)
    a = attention_with_lse_reference(q, k[:, :, :13], v[:, :, :13], None, 0.3)
    b = attention_with_lse_reference(q, k[:, :, 13:], v[:, :, 13:], None, 0.3)
    torch.testing.assert_close(merge_states(a[0], a[1], b[0], b[1]), full, rtol=1e-5, atol=1e-6)
    # A part whose keys are all far less likely leaves the other part's output unchanged.
    torch.testing.assert_close(merge_states(a[0], a[1], b[0], b[1] - 1e4), a[0])


def test_shared_prefix_attention_reads_prefix_blocks_only():
    """Queries of 3 requests (8 heads on 2 KV heads) over 2 shared blocks of size 4."""
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(2, 6, 4, 8, generator=gen)
    v_cache = torch.randn(2, 6, 4, 8, generator=gen)
    q = torch.randn(3, 8, 8, generator=gen)
    prefix = SharedPrefix(rows=[0, 1, 2], num_blocks=2, block_ids=torch.tensor([4, 1]),
                          row_index=torch.tensor([0, 1, 2]))
    out, lse = shared_prefix_attention(q, k_cache, v_cache, prefix, 0.5)
    keys = k_cache[:, [4, 1]].reshape(2, 8, 8).repeat_interleave(4, 0)  # [heads, 8 keys, D]
    vals = v_cache[:, [4, 1]].reshape(2, 8, 8).repeat_interleave(4, 0)
    scores = torch.einsum("shd,hkd->shk", q, keys) * 0.5
    torch.testing.assert_close(out, torch.einsum("shk,hkd->shd", scores.softmax(-1), vals),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=1e-5, atol=1e-5)


def test_engine_greedy_tokens_same_with_cascade(tmp_path, monkeypatch):
    """Requests that hit a cached 80-token prefix prefill and decode through cascade attention
    and produce the same greedy tokens as with prefix caching off (no shared blocks)."""
    import random

    from pagedkv import LLM, SamplingParams
    from pagedkv.model import attention
    from pagedkv.model.backends import cpu_native
    from pagedkv.testing.random_model import build_random_model_dir

    model_dir = tmp_path / "tiny"
    build_random_model_dir(model_dir, seed=0)
    rng = random.Random(0)
    prefix = [rng.randrange(4, 300) for _ in range(80)]
    prompts = [{"prompt_token_ids": prefix + [rng.randrange(4, 300) for _ in range(3 + i)]}
               for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    calls = []
    real = attention.shared_prefix_attention
    counted = lambda q, *a: calls.append(q.shape[0]) or real(q, *a)  # noqa: E731
    monkeypatch.setattr(attention, "shared_prefix_attention", counted)
    monkeypatch.setattr(cpu_native, "shared_prefix_attention", counted)  # the fused path
    results = {}
    for caching in (True, False):
        llm = LLM(model=str(model_dir), dtype="float32", block_size=4, seed=0, device="cpu",
                  enable_prefix_caching=caching, kv_cache_memory_bytes=64 << 20)
        llm.generate(prompts[:1], params, use_tqdm=False)  # caches the prefix when on
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[caching] = [o.outputs[0].token_ids for o in outs]
        llm.llm_engine.check_invariants()
        if caching:
            assert all(o.num_cached_tokens >= 80 for o in outs)
            assert 5 in calls  # the five decodes attend to the shared prefix together
            assert max(calls) > 5  # and so do the prefill chunks' tokens (one call per layer)
        else:
            assert not calls
        calls.clear()
    assert results[True] == results[False]
