"""pagedkv's model runtime against transformers on transformers' own tiny checkpoints."""

from __future__ import annotations

import functools

import pytest
import torch

from pagedkv.model import ModelRunner
from tests.model.driver import greedy_generate, prefill_logits
from tests.tiny_models import load_hf_model

pytest.importorskip("transformers")

# Prompt lengths 3..21 tokens; with Mistral's window of 8 most prompts exceed the window.
PROMPTS = [[1, 17, 93, 5], [1] + list(range(40, 60)), [1, 300, 301, 302, 303, 304, 305, 306, 307],
           [1] + list(range(100, 113))]


def hf_last_logits(hf, prompts):
    with torch.no_grad():
        return torch.stack([hf(torch.tensor([p])).logits[0, -1].float() for p in prompts])


@functools.lru_cache(maxsize=8)
def hf_greedy_cached(model_dir: str, n: int) -> list[list[int]]:
    return hf_greedy(load_hf_model(model_dir), PROMPTS, n)


def hf_greedy(hf, prompts, n):
    """transformers' greedy generate, eos ignored (like our loop, which never stops early)."""
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


# The driver's allocator never reuses blocks; tiny Gemma 3 has 6 KV cache groups, each with its
# own blocks: room for that many.
MAX_KV_GROUPS = 6


def test_last_position_logits_float32(tiny_model):
    runner = ModelRunner(tiny_model, block_size=4, num_blocks=64 * MAX_KV_GROUPS)
    ref = hf_last_logits(load_hf_model(tiny_model), PROMPTS)
    ours = prefill_logits(runner, PROMPTS)
    # 1e-4 relative to the logits' scale.
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize(("dtype", "tolerance"), [("bfloat16", 0.05), ("float16", 0.01)])
def test_last_position_logits_half(tiny_llama, dtype, tolerance):
    """Stated tolerances, relative to the logits' scale, against transformers in the same dtype:
    5% in bfloat16 (8-bit mantissa), 1% in float16 (11-bit)."""
    torch_dtype = getattr(torch, dtype)
    runner = ModelRunner(tiny_llama, block_size=16, num_blocks=16, dtype=dtype)
    assert runner.model.embed_tokens.weight.dtype == torch_dtype
    assert runner.kv_cache.kv.dtype == torch_dtype
    ref = hf_last_logits(load_hf_model(tiny_llama, torch_dtype), PROMPTS)
    ours = prefill_logits(runner, PROMPTS)
    assert (ours - ref).abs().max() <= tolerance * ref.abs().max()


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_matches_transformers(tiny_model, block_size):
    runner = ModelRunner(tiny_model, block_size=block_size,
                         num_blocks=1 + (4 * 64 // block_size + 8) * MAX_KV_GROUPS)
    ours = greedy_generate(runner, PROMPTS, 10)
    assert ours == hf_greedy_cached(str(tiny_model), 10)


def test_mistral_sliding_window_matters(tiny_mistral):
    """The window changes the result for a prompt longer than it (so the test above sees it)."""
    runner = ModelRunner(tiny_mistral, block_size=4, num_blocks=64)
    windowed = prefill_logits(runner, PROMPTS[1:2])
    for layer in runner.model.layers:
        layer.self_attn.window = None
    full = prefill_logits(runner, PROMPTS[1:2])
    assert (windowed - full).abs().max() > 1e-3


@pytest.mark.parametrize("chunk_size", [1, 3, 8])
def test_chunked_prefill_equals_one_shot(tiny_mistral, chunk_size):
    runner = ModelRunner(tiny_mistral, block_size=4, num_blocks=64)
    one_shot = greedy_generate(runner, PROMPTS, 6)
    chunked = greedy_generate(runner, PROMPTS, 6, chunk_size=chunk_size)
    assert chunked == one_shot
