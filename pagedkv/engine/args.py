"""EngineArgs: every engine knob, with vLLM's names, and its validation.

The knobs are declared once, in typed groups (pagedkv/config/options.py): `EngineArgs` inherits
them all and stays flat (`EngineArgs(model, block_size=32)`, `LLM(model, block_size=32)`).
`validate()` checks each field against its declaration (type, range, choices) and then the rules
that span fields, which are the only ones written here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pagedkv.config.options import (
    CacheOptions,
    ModelOptions,
    ParallelOptions,
    RuntimeOptions,
    SchedulerOptions,
    StoreOptions,
    StructuredOptions,
    check_options,
)
from pagedkv.events.config import parse_kv_events_config
from pagedkv.kv.partial_hits import check_prefix_match_unit
from pagedkv.spec.config import parse_speculative_config
from pagedkv.store.transfer_config import parse_kv_transfer_config
from pagedkv.structured.limits import StructuredOutputsLimits


# The groups in reverse: a dataclass lists the fields of its last base first (model, ...).
@dataclass(kw_only=True)
class EngineArgs(ParallelOptions, StructuredOptions, RuntimeOptions, StoreOptions,
                 SchedulerOptions, CacheOptions, ModelOptions):
    """Arguments of `LLM(...)`, `LLMEngine` and `pagedkv serve` (vLLM's names and meanings).

    KV cache size: `num_gpu_blocks_override` wins; else `kv_cache_memory_bytes`; else on CUDA
    `gpu_memory_utilization` of the device minus weights and activation peak; else on CPU
    `cpu_memory_bytes` (default: half the available memory) minus the loaded weights and the
    activation peak (engine/kv_setup.py). `swap_space` is GiB of host memory for swapped
    blocks. `max_num_batched_tokens` is the per-step token budget (chunked prefill splits longer
    prompts). `enforce_eager` turns off CUDA graphs for decode steps (CUDA only). `cpu_kernels`
    (CPU only): "auto" builds the fused C++ kernels in the background on first use and switches
    to them once built, "wait" builds them before the engine starts, "off" keeps the pure-torch
    path (see pagedkv.kernels.cpu). `kv_cache_dtype` "fp8" / "fp8_e4m3" / "fp8_e5m2" / "int8"
    stores K/V in one byte per value (pagedkv/model/kv_quant.py, kv_int8.py).
    `async_scheduling` (vLLM's) builds step N+1's batch while step N's forward pass runs
    (pagedkv/engine/overlap.py): same tokens as the serial loop; off by default, as on a small
    CPU the host work contends with the forward for the cores. A model id as `model`
    (pagedkv.model.hub) is downloaded at `revision` into `download_dir`. Tensor parallelism
    over machines: node 0 runs the engine; nodes 1.. run `pagedkv serve MODEL --node-rank K`,
    all with the same --master-addr/--master-port.
    """

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first bad field (its value and the limit)."""
        check_options(self)
        check_prefix_match_unit(self.prefix_match_unit, self.block_size)
        parse_kv_events_config(self.kv_events_config)
        if parse_speculative_config(self.speculative_config) and self.async_scheduling:
            raise ValueError("async_scheduling=True does not support speculative_config yet: "
                             "use one or the other")
        self._validate_offloading()
        self._validate_parallel()
        self.structured_outputs_limits()

    def structured_outputs_limits(self) -> StructuredOutputsLimits:
        """The `structured_outputs_*` fields as limits (ValueError naming a bad one)."""
        prefix = "structured_outputs_"
        return StructuredOutputsLimits(**{
            name[len(prefix):]: getattr(self, name)
            for name in self.field_names() if name.startswith(prefix)})

    def _validate_parallel(self) -> None:
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes} must divide tensor_parallel_size="
                             f"{self.tensor_parallel_size} (the same ranks on every machine)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), "
                             f"got {self.node_rank!r}")
        if self.nnodes > 1 and self.master_port is None and \
                self.distributed_executor_backend == "mp":
            raise ValueError("nnodes > 1 needs master_port (and master_addr: node 0's address)")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, data_parallel_size="
                             f"{self.data_parallel_size}), got {self.data_parallel_rank!r}")
        if self.data_parallel_size > 1 and self.nnodes > 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size} runs every core on "
                             f"this machine: it does not combine with nnodes={self.nnodes}")
        if self.async_scheduling and self.uses_kv_store:
            raise ValueError("async_scheduling=True does not support the KV store "
                             "(kv_offloading_*) yet: use one or the other")

    def _validate_offloading(self) -> None:
        if self.kv_offloading_disk_path is not None and self.kv_offloading_disk_size <= 0:
            raise ValueError("kv_offloading_disk_size must be > 0 with kv_offloading_disk_path, "
                             f"got {self.kv_offloading_disk_size!r}")
        transfer = parse_kv_transfer_config(self.kv_transfer_config)
        if transfer is not None and transfer.is_push and self.nnodes > 1:
            raise ValueError("kv_transfer_config: PagedKVPushConnector needs every "
                             f"tensor-parallel rank on one machine (nnodes 1), got nnodes "
                             f"{self.nnodes}: rank r pushes and listens on kv_port + r of its "
                             "engine's kv_ip (use PagedKVStoreConnector through a shared tier)")
        if transfer is not None and self.data_parallel_size > 1:
            raise ValueError("kv_transfer_config: a prefill/decode role needs "
                             f"data_parallel_size 1, got {self.data_parallel_size} (run one "
                             "server per engine core behind `pagedkv router --prefill/--decode`)")
        if transfer is not None and not transfer.is_push and not (
                self.kv_offloading_disk_path or self.kv_offloading_remote_url):
            raise ValueError("kv_transfer_config: PagedKVStoreConnector moves blocks through "
                             "a shared tier: set kv_offloading_disk_path (a shared disk) or "
                             "kv_offloading_remote_url (Redis)")
        if self.uses_kv_store and not self.enable_prefix_caching:
            raise ValueError("the KV store (kv_offloading_*) needs enable_prefix_caching=True: "
                             "its keys are the prefix-cache block hashes")

    @property
    def uses_kv_store(self) -> bool:
        """Whether any tier of the KV store is configured."""
        return bool(self.kv_offloading_size > 0 or self.kv_offloading_disk_path
                    or self.kv_offloading_remote_url or self.kv_transfer_config)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
