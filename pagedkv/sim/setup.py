"""The simulated engine's `SimConfig` from `pagedkv simulate`'s flags and a model config.

KV blocks: `--num-gpu-blocks-override` as given; else `--kv-cache-memory-bytes` over the
model's bytes per block; else `pagedkv plan`'s figure for the hardware's memory (utilization x
memory - estimated weights - estimated activation peak). `max_model_len` defaults to the
config's, lowered to the cache's capacity as the engine lowers it. Torch-free.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from pagedkv.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, load_hf_config
from pagedkv.config.hf_config import config_int, text_config
from pagedkv.kv.plan import (
    default_max_model_len,
    estimate_activation_peak_bytes,
    estimate_weights_bytes,
    plan_num_blocks,
)
from pagedkv.kv.sizes import parse_size
from pagedkv.kv.spec import bundled_config_names, bundled_config_path, kv_cache_spec_from_hf_config
from pagedkv.sim.instance import SimConfig

GiB = 1 << 30


def load_model_config(name: str) -> dict[str, Any]:
    """A config.json path, a directory holding one, or a bundled config name."""
    if not os.path.exists(name) and name in bundled_config_names():
        name = bundled_config_path(name)
    return load_hf_config(name)


def build_sim_config(args: argparse.Namespace) -> tuple[SimConfig, dict[str, Any], str]:
    """(config, the model's config dict, the hardware spec) for the parsed flags."""
    from pagedkv.sim.latency.roofline import HARDWARE_PRESETS

    config = load_model_config(args.model)
    spec = kv_cache_spec_from_hf_config(config, args.block_size, "auto")
    batched = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    if args.num_gpu_blocks_override is not None:
        num_blocks = args.num_gpu_blocks_override
    elif args.kv_cache_memory_bytes is not None:
        num_blocks = parse_size(args.kv_cache_memory_bytes) // spec.page_size_bytes
    else:
        hw = HARDWARE_PRESETS.get(args.hardware)
        if hw is None or not hw.memory_bytes:
            raise ValueError(f"hardware {args.hardware!r} gives no memory size: pass "
                             "--num-gpu-blocks-override or --kv-cache-memory-bytes")
        num_blocks = plan_num_blocks(
            spec, memory_bytes=hw.memory_bytes, utilization=args.gpu_memory_utilization,
            weights_bytes=estimate_weights_bytes(config),
            activation_peak_bytes=estimate_activation_peak_bytes(
                config, batched, "auto", args.max_num_seqs)).num_blocks
    if num_blocks < 2:
        raise ValueError(f"the KV cache has {num_blocks} blocks; at least 2 are needed")
    max_len = args.max_model_len or default_max_model_len(config)
    if args.max_model_len is None:
        max_len = min(max_len, (num_blocks - 1) * args.block_size)
    host = (int(args.swap_space * GiB) // spec.page_size_bytes
            if args.preemption_mode == "swap" else 0)
    window = getattr(spec, "sliding_window", None)
    sim = SimConfig(
        num_blocks=num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=batched, max_model_len=max_len,
        preemption_mode=args.preemption_mode, num_host_blocks=host,
        scheduling_policy=args.scheduling_policy, watermark=args.watermark,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        eviction_policy=args.eviction_policy, sliding_window=window,
        vocab_size=config_int(text_config(config), "vocab_size", 32000), jump=args.jump)
    return sim, config, args.hardware
