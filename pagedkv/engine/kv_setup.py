"""How big the KV cache is: blocks on the device, blocks on the host, and the lengths that follow.

Order of precedence for the number of device blocks (block 0, the null block, included, as in
vLLM): `num_gpu_blocks_override`; else `kv_cache_memory_bytes // page_size_bytes`; else on CUDA
with a measured `GpuMemoryProfile` (the engine loads the weights and runs a profile forward pass
at `max_num_batched_tokens` first, as vLLM does) `gpu_kv_cache_bytes`: device memory x
`gpu_memory_utilization` minus this engine's weights and peak activation, and never more than
what is really free beside them; on CUDA without a profile the estimate formula; else on CPU
the memory the engine may use (`cpu_memory_bytes`, by default `CPU_MEMORY_FRACTION` of the memory
available before the weights were loaded, as vLLM's CPU worker takes a fraction of the memory)
minus the loaded weights' bytes (packed ones count as packed: smaller weights leave more for
the cache) and the activation peak estimate, never more blocks than `max_num_seqs` sequences of
`max_model_len` can use (`cpu_kv_cache_bytes`). `KVCacheSetup.budget` says which rule sized
it (the start-up banner prints it). With a draft model the budget buys as many blocks for the draft's
cache as for the target's (draft_budget.py); an explicit block count is each cache's. Host blocks (`swap_space` GiB) exist only with
`preemption_mode="swap"`.

A size the user asked for (`--kv-cache-memory-bytes`, `--num-gpu-blocks-override`, and on CPU
`--swap-space`'s host blocks) is checked against what the machine has: more than its memory
(the device's on CUDA; on CPU the RAM, or the cgroup's limit when lower) is a ValueError
naming the flag, more than is available now a warning.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pagedkv.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.draft_budget import draft_budget
from pagedkv.kv.hf_spec import kv_cache_spec_from_hf_config
from pagedkv.kv.hybrid_spec import HybridKVCacheSpec, sequence_capacity
from pagedkv.kv.plan import (
    default_max_model_len,
    estimate_activation_peak_bytes,
    estimate_weights_bytes,
    plan_num_blocks,
)
from pagedkv.kv.shard import shard_kv_cache_spec
from pagedkv.kv.spec import KVCacheSpec, SlidingWindowSpec
from pagedkv.model.config_files import load_hf_config

logger = logging.getLogger(__name__)

# On CPU without an explicit size: the fraction of the memory available at start the engine
# takes for its weights, activations and KV cache (vLLM's CPU worker: 0.92 of the node's memory
# less what the process holds; half leaves room for the other processes of a shared host).
CPU_MEMORY_FRACTION = 0.5
GiB = 1 << 30


@dataclass(frozen=True)
class KVCacheSetup:
    """The KV cache the engine builds, as `plan_kv_cache` sized it (immutable; valid for the
    engine's lifetime). `spec` shapes both the runner's KV tensors and the KV manager's
    block-table policy; `max_model_len` may be lowered to the cache's capacity when the caller
    gave none; `sliding_window` is the spec's window when every layer slides, else None."""

    spec: KVCacheSpec
    num_blocks: int  # device blocks, null block included
    num_host_blocks: int  # host blocks for swapping, null block excluded
    max_model_len: int
    max_num_batched_tokens: int
    sliding_window: int | None
    budget: str = ""  # which rule gave num_blocks, with its figures


@dataclass(frozen=True)
class GpuMemoryProfile:
    """Device memory as measured by the engine before it allocates the KV cache: the device's
    total, what is free now (weights loaded, profile run over, cache emptied), and this
    engine's own weights and peak activation bytes."""

    total_bytes: int
    free_bytes: int
    weights_bytes: int
    activation_peak_bytes: int


def gpu_kv_cache_bytes(profile: GpuMemoryProfile, utilization: float) -> int:
    """Bytes for the KV cache: `utilization` of the device minus this engine's weights and
    activation peak, capped by the free memory less the peak and the (1 - utilization) headroom
    (so memory that other engines or processes hold is never counted as ours). May be < 0."""
    own = profile.total_bytes * utilization - profile.weights_bytes \
        - profile.activation_peak_bytes
    free = profile.free_bytes - profile.activation_peak_bytes \
        - profile.total_bytes * (1.0 - utilization)
    return int(min(own, free))


def cpu_kv_cache_bytes(args: EngineArgs, weights_bytes: int, activation_peak_bytes: int
                       ) -> tuple[int, str]:
    """(bytes for the KV cache on CPU, how they were found): `args.cpu_memory_bytes`, else
    CPU_MEMORY_FRACTION of the host's available memory (measured now, with `weights_bytes`
    already loaded, so those are added back), minus the weights and the activation peak.
    May be < 0."""
    if args.cpu_memory_bytes is not None:
        memory, source = args.cpu_memory_bytes, f"--cpu-memory-bytes {_gib(args.cpu_memory_bytes)}"
    else:
        available = host_memory_bytes()[1] + weights_bytes
        memory = int(CPU_MEMORY_FRACTION * available)
        source = f"{CPU_MEMORY_FRACTION} x {_gib(available)} available"
    kv = memory - weights_bytes - activation_peak_bytes
    return kv, (f"{source} - weights {_gib(weights_bytes)} - activations "
                f"{_gib(activation_peak_bytes)} = {_gib(max(kv, 0))}")


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def resolve_max_num_batched_tokens(args: EngineArgs) -> int:
    return args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS


def device_is_cuda(device: str) -> bool:
    """Whether the engine runs on CUDA (`device` "cuda", or "auto" with a GPU present)."""
    if device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


def plan_kv_cache(args: EngineArgs, profile: GpuMemoryProfile | None = None,
                  weights_bytes: int | None = None) -> KVCacheSetup:
    """Size the KV cache for `args` (with a measured `profile` on CUDA; on CPU with the loaded
    weights' `weights_bytes`, before loading the config's estimate). Raises ValueError when
    the settings cannot work."""
    config = load_hf_config(args.model)
    # One rank's KV heads: every byte count below is per rank (each rank holds its heads of
    # every block, so the block count is the same on every rank).
    spec = shard_kv_cache_spec(kv_cache_spec_from_hf_config(
        config, args.block_size, args.dtype, args.kv_cache_dtype,
        hybrid=not args.disable_hybrid_kv_cache_manager), args.tensor_parallel_size)
    config_len = default_max_model_len(config)
    if args.max_model_len is not None and args.max_model_len > config_len:
        raise ValueError(f"max_model_len={args.max_model_len} exceeds the model's "
                         f"max_position_embeddings ({config_len})")
    max_model_len = args.max_model_len or config_len
    max_num_batched_tokens = resolve_max_num_batched_tokens(args)
    draft = draft_budget(args)  # a draft model's cache gets as many blocks (draft_budget.py)
    page = spec.page_size_bytes + draft.page_bytes

    budget = ""
    if args.num_gpu_blocks_override is not None:
        num_blocks = args.num_gpu_blocks_override
        budget = "--num-gpu-blocks-override"
    elif args.kv_cache_memory_bytes is not None:
        num_blocks = args.kv_cache_memory_bytes // page
        budget = f"--kv-cache-memory-bytes {_gib(args.kv_cache_memory_bytes)}"
    elif profile is not None:
        kv_bytes = gpu_kv_cache_bytes(profile, args.gpu_memory_utilization) - draft.weights_bytes
        num_blocks = max(kv_bytes, 0) // page
        budget = (f"{args.gpu_memory_utilization} x {_gib(profile.total_bytes)} - weights "
                  f"{_gib(profile.weights_bytes)} - activation peak "
                  f"{_gib(profile.activation_peak_bytes)} (measured)")
        if num_blocks < 2:
            raise ValueError(
                f"not even one KV block fits: {args.gpu_memory_utilization} x "
                f"{profile.total_bytes / GiB:.2f} GiB - weights {profile.weights_bytes / GiB:.2f} "
                f"GiB - activation peak {profile.activation_peak_bytes / GiB:.2f} GiB "
                f"({profile.free_bytes / GiB:.2f} GiB free); lower max_num_batched_tokens or "
                "raise gpu_memory_utilization")
    elif device_is_cuda(args.device):
        import torch

        free, total = torch.cuda.mem_get_info()
        plan = plan_num_blocks(
            spec, memory_bytes=total, utilization=args.gpu_memory_utilization,
            weights_bytes=(total - free) + estimate_weights_bytes(config, args.dtype)
            + draft.weights_bytes,
            activation_peak_bytes=estimate_activation_peak_bytes(
                config, max_num_batched_tokens, args.dtype, args.max_num_seqs))
        num_blocks = plan.num_blocks * spec.page_size_bytes // page
        budget = f"{args.gpu_memory_utilization} x {_gib(total)} (estimated weights)"
    else:
        weights = estimate_weights_bytes(config, args.dtype) if weights_bytes is None \
            else weights_bytes
        kv_bytes, budget = cpu_kv_cache_bytes(args, weights + draft.weights_bytes,
                                              estimate_activation_peak_bytes(
                                                  config, max_num_batched_tokens, args.dtype,
                                                  args.max_num_seqs))
        useful = args.max_num_seqs * spec.max_blocks_per_seq(max_model_len) + 1
        num_blocks = min(max(kv_bytes, 0) // page, useful)
        if num_blocks == useful:
            budget += f", capped at what {args.max_num_seqs} sequences of {max_model_len} use"
    if num_blocks < 2:
        raise ValueError(f"the KV cache has room for {num_blocks} blocks of {page} bytes; "
                         "at least 2 (one is the reserved null block) are needed")

    capacity = sequence_capacity(spec, num_blocks - 1)
    if capacity < max_model_len and not isinstance(spec, SlidingWindowSpec):
        if args.max_model_len is None:
            logger.info("max_model_len lowered from %d to the KV cache capacity %d",
                        max_model_len, capacity)
            max_model_len = capacity
        else:
            logger.warning("max_model_len=%d exceeds the KV cache capacity (%d tokens): longer "
                           "requests will fail", max_model_len, capacity)
    host_page = spec.page_size_bytes  # swapping is the target's alone
    num_host_blocks = int(args.swap_space * GiB) // host_page \
        if args.preemption_mode == "swap" else 0
    if args.num_gpu_blocks_override is not None or args.kv_cache_memory_bytes is not None:
        check_fits_in_memory(args, num_blocks * page, num_host_blocks * host_page,
                             profile is not None or device_is_cuda(args.device))
    window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
    if isinstance(spec, HybridKVCacheSpec):  # the largest window of its sliding groups
        window = max((g.sliding_window or 0 for g in spec.groups), default=0) or None
    return KVCacheSetup(spec=spec, num_blocks=num_blocks, num_host_blocks=num_host_blocks,
                        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                        sliding_window=window, budget=budget)


def check_fits_in_memory(args: EngineArgs, device_bytes: int, host_bytes: int,
                         cuda: bool) -> None:
    """ValueError naming the flag when the KV cache asked for is more than the memory this
    machine has (see the module docstring); a warning when it is more than is available now."""
    flag = ("--num-gpu-blocks-override" if args.num_gpu_blocks_override is not None
            else "--kv-cache-memory-bytes")
    if cuda:
        import torch

        available, total = torch.cuda.mem_get_info()
        where, asked = "the GPU", device_bytes
    else:
        total, available = host_memory_bytes()
        where, asked = "this machine", device_bytes + host_bytes
        if host_bytes:
            flag += " plus --swap-space"
    if asked > total:
        raise ValueError(f"{flag} asks for a {asked / GiB:.1f} GiB KV cache, more than "
                         f"{where} has ({total / GiB:.1f} GiB, {available / GiB:.1f} GiB "
                         "available): ask for less")
    if asked > available:
        logger.warning("%s asks for a %.1f GiB KV cache; only %.1f GiB of %s's memory is "
                       "available now", flag, asked / GiB, available / GiB, where)


def host_memory_bytes() -> tuple[int, int]:
    """(total, available) bytes of this machine's memory: /proc/meminfo's MemTotal and
    MemAvailable, each capped by the cgroup v2 memory limit when there is one; without
    /proc (not Linux) os.sysconf's physical and free pages."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        total = int(info["MemTotal"].split()[0]) * 1024
        available = int(info.get("MemAvailable", info["MemFree"]).split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    try:
        limit = int(Path("/sys/fs/cgroup/memory.max").read_text())
    except (OSError, ValueError):  # no cgroup v2 limit ("max", or no such file)
        return total, available
    return min(total, limit), min(available, limit)
