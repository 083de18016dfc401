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

from pagedkv.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from pagedkv.config.hf_config import config_int, text_config
from pagedkv.kv.hf_spec import kv_cache_spec_from_hf_config
from pagedkv.kv.plan import (
    default_max_model_len,
    estimate_activation_peak_bytes,
    estimate_weights_bytes,
    plan_num_blocks,
)
from pagedkv.kv.sizes import parse_size
from pagedkv.kv.spec import bundled_config_names, bundled_config_path
from pagedkv.model.config_files import load_hf_config
from pagedkv.sim.config import SimConfig
from pagedkv.sim.store import DEFAULT_TIER_SPEEDS, TierSpec
from pagedkv.store.sizing import disk_tier_blocks, host_tier_blocks

GiB = 1 << 30


def load_model_config(name: str) -> dict[str, Any]:
    """A config.json path, a directory holding one, or a bundled config name."""
    if not os.path.exists(name) and name in bundled_config_names():
        name = bundled_config_path(name)
    return load_hf_config(name)


def build_sim_config(args: argparse.Namespace) -> tuple[SimConfig, dict[str, Any], str]:
    """(config, the model's config dict, the hardware spec) for the parsed flags."""
    from pagedkv.sim.latency.roofline import load_hardware

    config = load_model_config(args.model)
    spec = kv_cache_spec_from_hf_config(config, args.block_size, "auto",
                                        getattr(args, "kv_cache_dtype", "auto"))
    batched = (DEFAULT_MAX_NUM_BATCHED_TOKENS if args.max_num_batched_tokens is None
               else args.max_num_batched_tokens)
    if args.num_gpu_blocks_override is not None:
        num_blocks = args.num_gpu_blocks_override
    elif args.kv_cache_memory_bytes is not None:
        num_blocks = parse_size(args.kv_cache_memory_bytes) // spec.page_size_bytes
    else:
        hw = None if args.hardware == "cpu" else load_hardware(args.hardware)  # cpu: measured
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
    max_len = args.max_model_len
    if max_len is None:
        max_len = min(default_max_model_len(config), (num_blocks - 1) * args.block_size)
    if not (isinstance(args.swap_space, (int, float)) and 0 <= args.swap_space < float("inf")):
        raise ValueError(f"swap_space must be a non-negative number of GiB, got "
                         f"{args.swap_space!r}")
    host = int(args.swap_space * GiB) // spec.page_size_bytes  # used in swap mode only
    window = getattr(spec, "sliding_window", None)
    sim = SimConfig(
        num_blocks=num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=batched, max_model_len=max_len,
        preemption_mode=args.preemption_mode, num_host_blocks=host,
        scheduling_policy=args.scheduling_policy, watermark=args.watermark,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        prefill_batching=args.prefill_batching,
        prefill_step_overhead_tokens=args.prefill_step_overhead_tokens,
        prefill_decode_overhead_tokens=args.prefill_decode_overhead_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        eviction_policy=args.eviction_policy, sliding_window=window,
        vocab_size=config_int(text_config(config), "vocab_size", 32000), jump=args.jump,
        store_tiers=store_tiers(args, spec.page_size_bytes), block_bytes=spec.page_size_bytes)
    if sim.store_tiers and (window is not None or not sim.enable_prefix_caching):
        raise ValueError("the KV store's tiers need prefix caching and no sliding window "
                         "(as the engine's)")
    return sim, config, args.hardware


def parse_tier_speeds(text: str | None) -> dict[str, tuple[float, float]]:
    """`host=10e9:2e-5,disk=2e9` -> {tier: (bytes/s, latency s)} over the defaults."""
    speeds = dict(DEFAULT_TIER_SPEEDS)
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        bandwidth, _, latency = value.partition(":")
        if name not in speeds:
            raise ValueError(f"unknown store tier {name!r} in --tier-speeds; known: "
                             f"{sorted(speeds)}")
        try:
            speeds[name] = (float(bandwidth), float(latency) if latency else speeds[name][1])
        except ValueError:
            raise ValueError(f"--tier-speeds {item!r}: expected TIER=BYTES/S[:LATENCY_S]") from None
    return speeds


def store_tiers(args: argparse.Namespace, block_bytes: int) -> tuple[TierSpec, ...]:
    """The store's tiers, fastest first, sized in blocks as the engine's tiers size them."""
    speeds = parse_tier_speeds(getattr(args, "tier_speeds", None))
    hash_size = 32 if args.prefix_caching_hash_algo == "sha256" else 16
    tiers = []
    if getattr(args, "kv_offloading_size", 0):
        tiers.append(TierSpec("host", host_tier_blocks(_gib(args.kv_offloading_size,
                                                             "kv_offloading_size"), block_bytes),
                              *speeds["host"]))
    if getattr(args, "kv_offloading_disk_path", None):
        tiers.append(TierSpec("disk", disk_tier_blocks(
            _gib(args.kv_offloading_disk_size, "kv_offloading_disk_size"), block_bytes,
            hash_size), *speeds["disk"]))
    if getattr(args, "kv_offloading_remote_url", None):
        size = getattr(args, "kv_offloading_remote_size", None)
        tiers.append(TierSpec("redis", None if size is None else disk_tier_blocks(
            _gib(size, "kv_offloading_remote_size"), block_bytes, hash_size), *speeds["redis"],
            shared=True))
    return tuple(tiers)


def _gib(value: float, name: str) -> int:
    if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
        raise ValueError(f"{name} must be a positive number of GiB, got {value!r}")
    return int(value * GiB)
