"""The KL-divergence measure of KV cache quality (pagedkv.testing.kv_quant_accuracy): the chunked
prompt logits equal a one-pass prefill's, KL is zero for the same logits and matches the
closed form, and the p99 / top-1 figures come from the per-position values."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedkv.model.runner import ModelRunner
from pagedkv.testing.kv_quant_accuracy import kl_divergence, kl_per_position, prompt_logits


def test_chunked_prompt_logits_equal_one_prefill(tiny_llama):
    runner = ModelRunner(tiny_llama, block_size=4, num_blocks=32, device="cpu",
                         cpu_kernels="off")
    rng = random.Random(0)
    tokens = [rng.randrange(4, 200) for _ in range(50)]
    whole = prompt_logits(runner, tokens, chunk_size=64)
    chunked = prompt_logits(runner, tokens, chunk_size=16)
    assert whole.shape == (50, runner.model_config.vocab_size)
    assert torch.allclose(whole, chunked, atol=1e-5)


def test_kl_is_zero_for_equal_logits_and_matches_the_closed_form():
    ref = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]])  # p = (1/4, 3/4), (1/2, 1/2)
    got = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    kl = kl_per_position(ref, got)
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert math.isclose(float(kl[0]), expected, rel_tol=1e-6)
    assert float(kl[1]) == pytest.approx(0.0, abs=1e-9)  # identical rows
    summary = kl_divergence([ref, ref], [got, ref])
    assert summary.positions == 4 and math.isclose(summary.mean_kl, expected / 4, rel_tol=1e-6)
    assert math.isclose(summary.max_kl, expected, rel_tol=1e-6)
    assert expected / 4 < summary.p99_kl <= expected
    # row 0: argmax 1 vs 0 (a tie resolves to the first)
    assert summary.top1_agreement == pytest.approx(0.75)
