"""SimConfig: the simulated engine's settings (`EngineArgs`' names where they exist)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.config.options import CacheOptions, ModelOptions, SchedulerOptions, check_options
from pagedkv.sched.scheduler import SchedulerConfig
from pagedkv.sim.store import TierSpec


@dataclass
class SimConfig:
    """The simulated engine's settings, with `EngineArgs`' names where they exist.
    `num_blocks` counts the null block, as `num_gpu_blocks_override` does; `num_host_blocks`
    is the swap space, used (as the engine uses it) only with `preemption_mode="swap"`.
    ValueError naming a bad setting (also from `dataclasses.replace`, as a sweep makes them)."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: str = "recompute"
    num_host_blocks: int = 0
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    prefill_batching: str = SchedulerOptions.prefill_batching  # (the engine's defaults)
    prefill_step_overhead_tokens: int = SchedulerOptions.prefill_step_overhead_tokens
    prefill_decode_overhead_tokens: int = SchedulerOptions.prefill_decode_overhead_tokens
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    eviction_policy: str = "lru"
    sliding_window: int | None = None
    vocab_size: int = 32000
    jump: bool = True
    # The KV store's tiers, fastest first (none: no store), and one block's bytes (their
    # load times).
    store_tiers: tuple[TierSpec, ...] = ()
    block_bytes: int = 0

    def __post_init__(self) -> None:
        check_options(self, ModelOptions, CacheOptions, SchedulerOptions)  # as EngineArgs'
        for name in ("num_blocks", "block_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), "
                             f"got {self.num_blocks}")
        if not isinstance(self.num_host_blocks, int) or self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be an int >= 0, got {self.num_host_blocks!r}")
        if self.vocab_size < 16:
            raise ValueError(f"vocab_size must be at least 16, got {self.vocab_size}")
        if not isinstance(self.store_tiers, tuple) or \
                not all(isinstance(t, TierSpec) for t in self.store_tiers):
            raise ValueError(f"store_tiers must be a tuple of TierSpec, got {self.store_tiers!r}")

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens,
                               max_model_len=self.max_model_len,
                               preemption_mode=self.preemption_mode,
                               scheduling_policy=self.scheduling_policy,
                               long_prefill_token_threshold=self.long_prefill_token_threshold,
                               prefill_batching=self.prefill_batching,
                               prefill_step_overhead_tokens=self.prefill_step_overhead_tokens,
                               prefill_decode_overhead_tokens=self.prefill_decode_overhead_tokens)
