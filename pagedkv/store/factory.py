"""Build an engine's KV store and its connector halves from `EngineArgs` (one place).

Tensor parallel: every rank builds its own store (`store_connector_worker`, run on each rank
by the executor) over its own KV heads, whose keys name the rank and the group size
(`shard_tag`), so no other rank, and no engine of another size, ever reads them; rank 0's
store also serves the scheduler's lookups and the KV events."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from pagedkv.kv.hybrid_spec import HybridKVCacheSpec
from pagedkv.kv.sizes import GiB
from pagedkv.store.identity import model_identity
from pagedkv.store.payload import pin_host_memory
from pagedkv.store.tier import KVTier
from pagedkv.store.tiered import TieredKVStore

if TYPE_CHECKING:
    from pagedkv.engine.args import EngineArgs
    from pagedkv.kv.spec import KVCacheSpec
    from pagedkv.model.executor import Executor
    from pagedkv.model.parallel.group import TensorParallelGroup
    from pagedkv.model.runner import ModelRunner
    from pagedkv.sched.scheduler import Scheduler
    from pagedkv.store.connector import StoreConnectorWorker


def build_tiers(args: EngineArgs, block_bytes: int, pin_memory: bool = False) -> list[KVTier]:
    """The configured tiers, fastest first: host RAM (`pin_memory`: its slot pool is pinned),
    local disk, Redis."""
    tiers: list[KVTier] = []
    if args.kv_offloading_size > 0:
        from pagedkv.store.host import HostTier

        tiers.append(HostTier(int(args.kv_offloading_size * GiB), block_bytes,
                              pin_memory=pin_memory))
    if args.kv_offloading_disk_path:
        from pagedkv.store.disk import DiskTier

        tiers.append(DiskTier(args.kv_offloading_disk_path,
                              int(args.kv_offloading_disk_size * GiB)))
    if args.kv_offloading_remote_url:
        from pagedkv.store.redis_tier import RedisTier

        tiers.append(RedisTier(args.kv_offloading_remote_url))
    return tiers


def shard_tag(group: TensorParallelGroup | None) -> str | None:
    """What a tensor-parallel rank's store keys add: its rank and the group's size (with the
    model's config, already in the key, that fixes which KV heads the rank holds); None for
    one process (whose keys stay those of earlier versions)."""
    if group is None or group.size == 1:
        return None
    return f"tensor-parallel rank {group.rank} of {group.size}"


def build_kv_store(args: EngineArgs, spec: KVCacheSpec, weight_files: list,
                   enable_events: bool, pin_memory: bool = False,
                   dtype_tag: str | None = None, shard: str | None = None
                   ) -> TieredKVStore | None:
    """The store for `args` and the KV cache `spec` describes (None when no tier is
    configured): a block is `spec.page_size_bytes` bytes laid out as `KVCache.LAYOUT`.
    `dtype_tag` says what the bytes mean (`store_dtype_tag`: the cache dtype, the weights'
    dtype, fp8's scales; default the spec's dtype): part of every key, as is `shard`
    (`shard_tag`: which tensor-parallel rank's heads the blocks hold). So is the layout, KV
    cache groups included: a store written by a grouped layout is never read by an all-full
    one (a block of one holds other layers than a block of the other), and back."""
    if not args.uses_kv_store:
        return None
    from pagedkv.model.kv_cache import KVCache

    shape = {k: v for k, v in spec.to_dict().items() if k != "dtype"}  # the dtype: dtype_tag
    layout = ",".join(KVCache.LAYOUT) + ":" + json.dumps(shape, sort_keys=True)
    if shard is not None:
        layout += "|" + shard
    identity = model_identity(args.model, weight_files, dtype_tag or spec.dtype, layout,
                              spec.block_size)
    block_bytes = spec.page_size_bytes
    return TieredKVStore(build_tiers(args, block_bytes, pin_memory), identity, block_bytes,
                         spec.block_size, enable_events=enable_events,
                         grouped=isinstance(spec, HybridKVCacheSpec))


def store_dtype_tag(runner: ModelRunner) -> str:
    """What `runner`'s KV bytes mean, for the store's keys: the cache's `dtype_tag()` (its
    dtype, int8's scale layout, fp8's scales) and the weights' dtype, which computed them: an
    int8 (or fp8, or bfloat16) block of float32 weights is not what bfloat16 weights would
    write, so the two never share blocks, as two "auto" caches of those dtypes never do."""
    return f"{runner.kv_cache.dtype_tag()};weights={runner.dtype}"


def store_connector_worker(args: EngineArgs, runner: ModelRunner,
                           enable_events: bool) -> StoreConnectorWorker:
    """This rank's store (its KV heads, its keys) behind the runner's side of the connector.
    KV events come from rank 0's store only."""
    from pagedkv.model.loader import weight_files
    from pagedkv.store.connector import FinishedLoads, StoreConnectorWorker

    group = runner.tensor_parallel
    pin_memory = pin_host_memory(runner.kv_cache.device)
    store = build_kv_store(args, runner.kv_cache_spec, weight_files(args.model),
                           enable_events and (group is None or group.is_driver), pin_memory,
                           store_dtype_tag(runner), shard_tag(group))
    return StoreConnectorWorker(store, FinishedLoads(), pin_memory=pin_memory, group=group)


def attach_kv_store(args: EngineArgs, sliding_window: int | None, runner: Executor,
                    scheduler: Scheduler, enable_events: bool) -> TieredKVStore | None:
    """Build every rank's store and plug the connector halves into `scheduler` and the
    runners (sets their `kv_connector`). Returns rank 0's store (the one the scheduler looks
    up); None, and nothing plugged, when no tier is configured. KV cache groups (sliding
    groups beside full ones) are stored per group; a model whose every layer slides (one
    sliding group) is refused."""
    if not args.uses_kv_store:
        return None
    if sliding_window is not None and not isinstance(runner.kv_cache_spec, HybridKVCacheSpec):
        raise ValueError("the KV store (kv_offloading_*) does not support sliding-window models "
                         f"(sliding_window={sliding_window})")
    from pagedkv.store.connector import StoreConnectorScheduler

    runner.attach_kv_store(args, enable_events)
    worker = runner.kv_connector  # rank 0's
    scheduler.kv_connector = StoreConnectorScheduler(worker.store, scheduler.kv_cache_manager,
                                                     worker.finished)
    return worker.store
