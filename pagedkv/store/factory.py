"""Build a KV store and its connector halves from a `StoreConfig` (config.py).

Tensor parallel: every rank builds its own store (`build_worker`, run on each rank by its model
runner once its KV cache exists) over its own KV heads, whose keys name the rank and the group
size (`shard_tag`), so no other rank, and no engine of another size, ever reads them; rank 0's
store also serves the scheduler's lookups (`build_scheduler_side`) and the KV events."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pagedkv.kv.hybrid_spec import HybridKVCacheSpec
from pagedkv.store.config import StoreConfig
from pagedkv.store.connector import FinishedLoads, StoreConnectorScheduler, StoreConnectorWorker
from pagedkv.store.identity import model_identity
from pagedkv.store.tier import KVTier
from pagedkv.store.tiered import TieredKVStore

if TYPE_CHECKING:
    from pagedkv.kv.manager import KVCacheManager
    from pagedkv.kv.spec import KVCacheSpec
    from pagedkv.store.interfaces import RankGroup


def build_tiers(config: StoreConfig, block_bytes: int, pin_memory: bool = False,
                rank: int = 0) -> list[KVTier]:
    """The configured tiers, fastest first: host RAM (`pin_memory`: its slot pool is pinned),
    local disk, Redis; a push consumer's tier of pushed blocks, which tensor-parallel rank
    `rank` listens for on `kv_port + rank`."""
    tiers: list[KVTier] = []
    transfer = config.transfer
    host_bytes = config.host_bytes
    if transfer is not None and transfer.is_push and transfer.is_producer:
        host_bytes = max(host_bytes, int(transfer.kv_buffer_size))  # the push's staging
    if host_bytes > 0:
        from pagedkv.store.host import HostTier

        tiers.append(HostTier(host_bytes, block_bytes, pin_memory=pin_memory))
    if config.disk_path:
        from pagedkv.store.disk import DiskTier

        tiers.append(DiskTier(config.disk_path, config.disk_bytes))
    if config.remote_url:
        from pagedkv.store.redis_tier import RedisTier

        tiers.append(RedisTier(config.remote_url))
    if transfer is not None and transfer.is_push and transfer.is_consumer:
        from pagedkv.store.transfer_push import PushReceiverTier

        tiers.append(PushReceiverTier(transfer.kv_ip, transfer.kv_port + rank,
                                      int(transfer.kv_buffer_size), transfer.extra("hold_s"),
                                      block_bytes))
    return tiers


def shard_tag(group: RankGroup | None) -> str | None:
    """What a tensor-parallel rank's store keys add: its rank and the group's size (with the
    model's config, already in the key, that fixes which KV heads the rank holds); None for
    one process (whose keys stay those of earlier versions)."""
    if group is None or group.size == 1:
        return None
    return f"tensor-parallel rank {group.rank} of {group.size}"


def build_kv_store(config: StoreConfig, spec: KVCacheSpec, layout: Sequence[str],
                   dtype_tag: str, *, enable_events: bool, pin_memory: bool = False,
                   shard: str | None = None, rank: int = 0) -> TieredKVStore:
    """The store of the KV cache `spec` describes: a block is `spec.page_size_bytes` bytes laid
    out as `layout` (the cache's dimension names). `dtype_tag` says what the bytes mean (the
    cache dtype, the weights' dtype, fp8's scales): part of every key, as is `shard`
    (`shard_tag`: which tensor-parallel rank's heads the blocks hold). So is the layout, KV
    cache groups included: a store written by a grouped layout is never read by an all-full
    one (a block of one holds other layers than a block of the other), and back. `rank`: the
    tensor-parallel rank (its push tier's port)."""
    shape = {k: v for k, v in spec.to_dict().items() if k != "dtype"}  # the dtype: dtype_tag
    key_layout = ",".join(layout) + ":" + json.dumps(shape, sort_keys=True)
    if shard is not None:
        key_layout += "|" + shard
    identity = model_identity(config.model_dir, [Path(p) for p in config.weight_files], dtype_tag,
                              key_layout, spec.block_size)
    block_bytes = spec.page_size_bytes
    return TieredKVStore(build_tiers(config, block_bytes, pin_memory, rank), identity, block_bytes,
                         spec.block_size, enable_events=enable_events,
                         grouped=isinstance(spec, HybridKVCacheSpec))


def build_worker(config: StoreConfig, spec: KVCacheSpec, layout: Sequence[str], dtype_tag: str,
                 *, pin_memory: bool, group: RankGroup | None = None) -> StoreConnectorWorker:
    """This rank's store (its KV heads, its keys) behind the runner's side of the connector,
    with this rank's side of prefill/decode disaggregation when configured. KV events come
    from rank 0's store only."""
    rank = 0 if group is None else group.rank
    store = build_kv_store(config, spec, layout, dtype_tag, pin_memory=pin_memory,
                           enable_events=config.enable_events
                           and (group is None or group.is_driver),
                           shard=shard_tag(group), rank=rank)
    transfer = None
    if config.transfer is not None:
        from pagedkv.store.transfer_rank import RankTransfer

        transfer = RankTransfer(config.transfer, store, rank)
    return StoreConnectorWorker(store, FinishedLoads(), pin_memory=pin_memory, group=group,
                                transfer=transfer)


def build_scheduler_side(worker: StoreConnectorWorker, kv_cache_manager: KVCacheManager
                         ) -> StoreConnectorScheduler:
    """The scheduler's side of the connector over rank 0's `worker` (its store and the loads
    it reports)."""
    return StoreConnectorScheduler(worker.store, kv_cache_manager, worker.finished)
