"""Build an engine's KV store and its connector halves from `EngineArgs` (one place)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.kv.sizes import GiB
from pagedkv.store.identity import model_identity
from pagedkv.store.tier import KVTier
from pagedkv.store.tiered import TieredKVStore

if TYPE_CHECKING:
    from pagedkv.engine.args import EngineArgs
    from pagedkv.model.kv_cache import KVCache
    from pagedkv.model.runner import ModelRunner
    from pagedkv.sched.scheduler import Scheduler


def build_tiers(args: EngineArgs) -> list[KVTier]:
    """The configured tiers, fastest first: host RAM, local disk, Redis."""
    tiers: list[KVTier] = []
    if args.kv_offloading_size > 0:
        from pagedkv.store.host import HostTier

        tiers.append(HostTier(int(args.kv_offloading_size * GiB)))
    if args.kv_offloading_disk_path:
        from pagedkv.store.disk import DiskTier

        tiers.append(DiskTier(args.kv_offloading_disk_path,
                              int(args.kv_offloading_disk_size * GiB)))
    if args.kv_offloading_remote_url:
        from pagedkv.store.redis_tier import RedisTier

        tiers.append(RedisTier(args.kv_offloading_remote_url))
    return tiers


def build_kv_store(args: EngineArgs, kv_cache: KVCache, weight_files: list,
                   enable_events: bool) -> TieredKVStore | None:
    """The store for `args` (None when no tier is configured). Raises ValueError for a
    sliding-window model (its freed blocks are nulled, so its prefixes are not block chains)."""
    if not args.uses_kv_store:
        return None
    kv = kv_cache.kv
    layout = "x".join(str(d) for i, d in enumerate(kv.shape) if i != 3)
    identity = model_identity(args.model, weight_files, kv_cache.dtype_tag(), layout,
                              args.block_size)
    block_bytes = kv[:, :, :, 0].numel() * kv.element_size()
    return TieredKVStore(build_tiers(args), identity, block_bytes, args.block_size,
                         enable_events=enable_events)


def attach_kv_store(args: EngineArgs, sliding_window: int | None, runner: ModelRunner,
                    scheduler: Scheduler, enable_events: bool) -> TieredKVStore | None:
    """Build the store and plug its connector halves into `scheduler` and `runner` (sets their
    `kv_connector`). None, and nothing plugged, when no tier is configured."""
    if not args.uses_kv_store:
        return None
    if sliding_window is not None:
        raise ValueError("the KV store (kv_offloading_*) does not support sliding-window models "
                         f"(sliding_window={sliding_window})")
    from pagedkv.model.loader import weight_files
    from pagedkv.store.connector import StoreConnectorScheduler, StoreConnectorWorker

    store = build_kv_store(args, runner.kv_cache, weight_files(args.model), enable_events)
    scheduler.kv_connector = StoreConnectorScheduler(store, scheduler.kv_cache_manager)
    runner.kv_connector = StoreConnectorWorker(store)
    return store
