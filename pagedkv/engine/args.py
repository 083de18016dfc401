"""EngineArgs: every engine knob, with vLLM's names, and its validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from pagedkv.config import MODEL_DTYPE_CHOICES as _DTYPES
from pagedkv.config.dtypes import KV_CACHE_DTYPE_CHOICES
from pagedkv.events.config import parse_kv_events_config
from pagedkv.kernels.modes import CPU_KERNEL_MODES
from pagedkv.kv.eviction import DEFAULT_EVICTION_POLICY, eviction_policy_class
from pagedkv.kv.partial_hits import check_prefix_match_unit
from pagedkv.kv.pins import check_max_pinned_fraction
from pagedkv.structured.limits import StructuredOutputsLimits

_SO_LIMITS = StructuredOutputsLimits()


@dataclass
class EngineArgs:
    """Arguments of `LLM(...)`, `LLMEngine` and `pagedkv serve` (vLLM's names and meanings).

    KV cache size: `num_gpu_blocks_override` wins; else `kv_cache_memory_bytes`; else on CUDA
    `gpu_memory_utilization` of the device minus weights and activation peak; else on CPU a
    default budget (`DEFAULT_CPU_KV_CACHE_BYTES`). `swap_space` is GiB of host memory for swapped
    blocks. `max_num_batched_tokens` is the per-step token budget (chunked prefill splits longer
    prompts). `enforce_eager` turns off CUDA graphs for decode steps (CUDA only). `cpu_kernels`
    (CPU only): "auto" builds the fused C++ kernels in the background on first use and switches
    to them once built, "wait" builds them before the engine starts, "off" keeps the pure-torch
    path (see pagedkv.kernels.cpu). `kv_cache_dtype`
    "fp8" / "fp8_e4m3" / "fp8_e5m2" / "int8" stores K/V in one byte per value
    (pagedkv/model/kv_quant.py, kv_int8.py).
    """

    model: str = ""
    tokenizer: str | None = None
    # A Hugging Face id as `model` (pagedkv.model.hub): the revision (branch, tag or commit) and
    # the cache directory to download into and look in (default: HF_HUB_CACHE / HF_HOME).
    revision: str | None = None
    download_dir: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    swap_space: float = 4.0
    preemption_mode: str = "recompute"
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    scheduling_policy: str = "fcfs"
    watermark: float = 0.01
    # vLLM's kv_events_config: a dict or JSON string (see pagedkv.events.config).
    kv_events_config: str | dict | None = None
    # Tiered KV store (pagedkv.store): host RAM GiB, a disk directory and its GiB, a Redis URL.
    kv_offloading_size: float = 0.0
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: float = 10.0
    kv_offloading_remote_url: str | None = None
    enforce_eager: bool = False
    # vLLM's async_scheduling: build step N+1's batch while step N's forward pass runs (in a
    # worker thread), and process step N's outputs while N+1 runs (pagedkv/engine/overlap.py).
    # Same tokens as the serial loop. Off by default: on a 2-core CPU the host work contends
    # with the forward for the cores and the GIL (README, "Overlapped scheduling").
    async_scheduling: bool = False
    # CPU: the fused C++ kernels (pagedkv.kernels.cpu): "auto" | "wait" | "off".
    cpu_kernels: str = "auto"
    # CPU: torch's thread count; None: follow the cores other processes leave free
    # (pagedkv.model.cpu_threads), N: exactly N.
    cpu_threads: int | None = None
    # Which free cached block is evicted first (pagedkv.kv.eviction: lru, lfu, arc), and the
    # most of the device cache pinned prefixes may hold (LLMEngine.pin_prefix).
    eviction_policy: str = DEFAULT_EVICTION_POLICY
    max_pinned_fraction: float = 0.5
    # KV cache storage dtype: "auto" (the model's), fp8 ("fp8" = "fp8_e4m3", "fp8_e5m2") or
    # "int8" (one scale per token and KV head; pagedkv/model/kv_int8.py).
    kv_cache_dtype: str = "auto"
    # Append one JSON line per step (its shape and duration) to this file, for `pagedkv
    # profile --fit-from` (pagedkv.sim.step_log).
    step_log: str | None = None
    # Structured outputs (pagedkv.structured.limits): the largest constraint of each kind, how
    # long one request waits for its compile, and the compile pool's threads.
    structured_outputs_max_choices: int = _SO_LIMITS.max_choices
    structured_outputs_max_pattern_chars: int = _SO_LIMITS.max_pattern_chars
    structured_outputs_max_grammar_chars: int = _SO_LIMITS.max_grammar_chars
    structured_outputs_max_schema_chars: int = _SO_LIMITS.max_schema_chars
    structured_outputs_compile_timeout_s: float = _SO_LIMITS.compile_timeout_s
    structured_outputs_compile_threads: int = _SO_LIMITS.compile_threads
    # Tensor parallelism (pagedkv.model.executor): ranks, how long a collective may wait before
    # the engine fails, and torchrun-style machines (node 0 runs the engine; nodes 1.. run
    # `pagedkv serve MODEL --node-rank K`, all with the same --master-addr/--master-port).
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 60.0
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # vLLM's prefix_match_unit: prefix hits count in units of this many tokens (a divisor of
    # block_size; 1: token granularity), reusing part of a cached block by copy-on-write
    # (pagedkv.kv.partial_hits). None (or block_size): whole blocks only.
    prefix_match_unit: int | None = None
    # vLLM's --disable-hybrid-kv-cache-manager: a model mixing attention types keeps
    # full-attention blocks on every layer (one KV cache group) instead of a group per type.
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def positive_int(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        positive_int("block_size")
        positive_int("max_num_seqs")
        positive_int("max_num_batched_tokens", allow_none=True)
        positive_int("max_model_len", allow_none=True)
        positive_int("num_gpu_blocks_override", allow_none=True)
        positive_int("kv_cache_memory_bytes", allow_none=True)
        positive_int("cpu_threads", allow_none=True)
        check_prefix_match_unit(self.prefix_match_unit, self.block_size)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.prefix_caching_hash_algo not in ("sha256", "xxhash"):
            raise ValueError("prefix_caching_hash_algo must be 'sha256' or 'xxhash', "
                             f"got {self.prefix_caching_hash_algo!r}")
        if (not isinstance(self.swap_space, (int, float)) or isinstance(self.swap_space, bool)
                or not math.isfinite(self.swap_space) or self.swap_space < 0):
            raise ValueError(f"swap_space must be a non-negative number of GiB, got {self.swap_space!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        parse_kv_events_config(self.kv_events_config)
        self._validate_offloading()
        for name in ("enforce_eager", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.cpu_kernels not in CPU_KERNEL_MODES:
            raise ValueError(f"cpu_kernels must be one of {CPU_KERNEL_MODES}, got {self.cpu_kernels!r}")
        eviction_policy_class(self.eviction_policy)
        check_max_pinned_fraction(self.max_pinned_fraction)
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, "
                             f"got {self.kv_cache_dtype!r}")
        self._validate_parallel()
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        self.structured_outputs_limits()

    def structured_outputs_limits(self) -> StructuredOutputsLimits:
        """The `structured_outputs_*` fields as limits (ValueError naming a bad one)."""
        prefix = "structured_outputs_"
        return StructuredOutputsLimits(**{
            name[len(prefix):]: getattr(self, name)
            for name in self.field_names() if name.startswith(prefix)})

    def _validate_parallel(self) -> None:
        for name in ("tensor_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes} must divide tensor_parallel_size="
                             f"{self.tensor_parallel_size} (the same ranks on every machine)")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), "
                             f"got {self.node_rank!r}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("nnodes > 1 needs master_port (and master_addr: node 0's address)")
        if self.master_port is not None and (not isinstance(self.master_port, int)
                                             or not 0 < self.master_port < 65536):
            raise ValueError(f"master_port must be a port number, got {self.master_port!r}")
        t = self.distributed_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
            raise ValueError(f"distributed_timeout_s must be a number > 0, got {t!r}")
        if self.async_scheduling and self.uses_kv_store:
            raise ValueError("async_scheduling=True does not support the KV store "
                             "(kv_offloading_*) yet: use one or the other")

    def _validate_offloading(self) -> None:
        for name in ("kv_offloading_size", "kv_offloading_disk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of GiB, got {value!r}")
        for name in ("kv_offloading_disk_path", "kv_offloading_remote_url"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.kv_offloading_disk_path is not None and self.kv_offloading_disk_size <= 0:
            raise ValueError("kv_offloading_disk_size must be > 0 with kv_offloading_disk_path, "
                             f"got {self.kv_offloading_disk_size!r}")
        if self.uses_kv_store and not self.enable_prefix_caching:
            raise ValueError("the KV store (kv_offloading_*) needs enable_prefix_caching=True: "
                             "its keys are the prefix-cache block hashes")

    @property
    def uses_kv_store(self) -> bool:
        """Whether any tier of the KV store is configured."""
        return bool(self.kv_offloading_size > 0 or self.kv_offloading_disk_path
                    or self.kv_offloading_remote_url)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
