"""KV cache sizing from a measured GPU memory profile (the arithmetic runs anywhere)."""

from __future__ import annotations

import pytest

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.kv_setup import GpuMemoryProfile, gpu_kv_cache_bytes, plan_kv_cache

GiB = 1 << 30


def test_own_budget_when_the_device_is_ours():
    p = GpuMemoryProfile(total_bytes=80 * GiB, free_bytes=77 * GiB, weights_bytes=2 * GiB,
                         activation_peak_bytes=1 * GiB)
    # 0.9 x 80 - 2 - 1 = 69 GiB; free check: 77 - 1 - 8 = 68 GiB (the CUDA context counts).
    assert gpu_kv_cache_bytes(p, 0.9) == 68 * GiB


def test_memory_held_by_others_is_not_counted_as_ours():
    """Another engine holds 40 GiB: only what is free beside it is used."""
    p = GpuMemoryProfile(total_bytes=80 * GiB, free_bytes=37 * GiB, weights_bytes=2 * GiB,
                         activation_peak_bytes=1 * GiB)
    assert gpu_kv_cache_bytes(p, 0.9) == 28 * GiB


def test_plan_uses_the_profile_and_names_the_figures_when_nothing_fits(tiny_llama):
    args = EngineArgs(model=str(tiny_llama), device="cpu")
    page = plan_kv_cache(EngineArgs(model=str(tiny_llama), device="cpu",
                                    num_gpu_blocks_override=4)).spec.page_size_bytes
    fits = GpuMemoryProfile(total_bytes=1000 * page, free_bytes=1000 * page, weights_bytes=0,
                            activation_peak_bytes=0)
    assert plan_kv_cache(args, fits).num_blocks == 900
    full = GpuMemoryProfile(total_bytes=GiB, free_bytes=GiB // 20, weights_bytes=GiB // 2,
                            activation_peak_bytes=GiB // 4)
    with pytest.raises(ValueError, match="activation peak 0.25 GiB"):
        plan_kv_cache(args, full)
