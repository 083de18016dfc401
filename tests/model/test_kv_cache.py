"""Swap out / in and block copies move K/V exactly; the runner applies them in order."""

from __future__ import annotations

import pytest
import torch

from pagedkv.model import ModelRunner
from pagedkv.model.kv_cache import KVCache
from pagedkv.sched.output import ScheduledRequest, SchedulerOutput
from pagedkv.sched.sampling_params import SamplingParams


def make_cache():
    cache = KVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8,
                    dtype=torch.float32, device=torch.device("cpu"), num_host_blocks=3)
    assert cache.kv.abs().sum() == 0 and cache.host_kv.shape[3] == 4  # the host null block + 3
    cache.kv.copy_(torch.randn(cache.kv.shape))
    return cache


def test_swap_out_in_and_copy_are_exact():
    cache = make_cache()
    before = cache.kv.clone()
    cache.swap_out([(2, 0), (5, 2)])
    assert torch.equal(cache.host_kv[:, :, :, 0], before[:, :, :, 2])
    assert torch.equal(cache.host_kv[:, :, :, 2], before[:, :, :, 5])
    cache.kv.zero_()
    cache.swap_in([(2, 4), (0, 1)])
    assert torch.equal(cache.kv[:, :, :, 4], before[:, :, :, 5])
    assert torch.equal(cache.kv[:, :, :, 1], before[:, :, :, 2])
    assert cache.kv[:, :, :, [0, 2, 3, 5]].abs().sum() == 0
    cache.copy([(4, 3), (1, 5)])
    assert torch.equal(cache.kv[:, :, :, 3], before[:, :, :, 5])
    assert torch.equal(cache.kv[:, :, :, 5], before[:, :, :, 2])
    assert torch.equal(cache.layers[1][0][:, 3], before[1, 0, :, 5])


def test_bad_block_ids():
    cache = make_cache()
    cache.swap_out([(1, 3)])  # the host pool hands out ids 1..num_host_blocks
    with pytest.raises(ValueError, match="host block id 4"):
        cache.swap_out([(1, 4)])
    with pytest.raises(ValueError, match="device block id 6"):
        cache.copy([(6, 1)])


def test_runner_swap_roundtrip_preserves_generation(tiny_llama):
    """Prefill, swap the request's blocks out, clobber them, swap back into other blocks and
    continue: the next token equals the one without the swap."""
    params = SamplingParams(temperature=0.0)
    prompt = [1, 50, 51, 52, 53, 54, 55]

    def step(runner, table, tokens, start, **moves):
        req = ScheduledRequest("a", tokens, start, table, params, prompt_token_ids=prompt)
        return runner.execute(SchedulerOutput(scheduled=[req], **moves)).sampled_token_ids["a"][0]

    ref = ModelRunner(tiny_llama, block_size=4, num_blocks=8)
    t1 = step(ref, [1, 2], prompt, 0)
    t2 = step(ref, [1, 2], [t1], 7)

    runner = ModelRunner(tiny_llama, block_size=4, num_blocks=8, num_host_blocks=2)
    assert step(runner, [1, 2], prompt, 0) == t1
    runner.execute(SchedulerOutput(blocks_to_swap_out=[(1, 0), (2, 1)]))
    runner.kv_cache.kv[:, :, :, 1:3] = 7.0  # another request overwrites the freed blocks
    assert step(runner, [5, 6], [t1], 7, blocks_to_swap_in=[(0, 5), (1, 3)],
                blocks_to_copy=[(3, 6)]) == t2
    # Copy-on-write: block 3 was copied to 6 before the step wrote position 7 into block 6.
    assert torch.equal(runner.kv_cache.kv[:, :, :, 6, :3], runner.kv_cache.kv[:, :, :, 3, :3])
