"""The engine core's composition root: the one place that builds the parts of an engine core
from `EngineArgs`, each part given what it needs through its constructor, in this order:

1. the KV cache's size (kv_setup.py; on CUDA without an explicit size, after the loaded
   model's profile forward pass);
2. the executor (executor.py): the model runner, or rank 0 of a tensor-parallel group, every
   rank built from one `RunnerConfig`; each rank then allocates its KV cache and, with a KV
   store configured (`StoreConfig`), builds its store behind the connector's worker side;
3. with a draft model (`speculative_config` method "draft_model"), its runner and its own KV
   manager (draft_setup.py); the KV cache manager and the scheduler, the store's scheduler
   side and the draft's proposer passed to it;
4. the KV-event publisher and the step log.

A failed start leaves nothing behind: worker ranks, store threads, weights and the publisher
are released before the error propagates."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.draft_setup import build_draft_proposer
from pagedkv.engine.executor import build_executor, runner_config
from pagedkv.engine.kv_setup import (
    GpuMemoryProfile,
    KVCacheSetup,
    device_is_cuda,
    plan_kv_cache,
    resolve_max_num_batched_tokens,
)
from pagedkv.engine.model_files import open_model_dir
from pagedkv.engine.warmup import warmup_skipped, warmup_steps
from pagedkv.events.config import parse_kv_events_config
from pagedkv.events.publisher import ZmqEventPublisher, make_event_publisher
from pagedkv.kv.factory import make_kv_cache_manager
from pagedkv.kv.hybrid_spec import HybridKVCacheSpec
from pagedkv.kv.sizes import GiB
from pagedkv.sched.scheduler import Scheduler, SchedulerConfig
from pagedkv.store.config import StoreConfig
from pagedkv.store.factory import build_scheduler_side
from pagedkv.store.transfer_config import parse_kv_transfer_config

if TYPE_CHECKING:
    from pagedkv.engine.draft_proposer import DraftModelProposer
    from pagedkv.engine.step_log import StepLog
    from pagedkv.model.executor import Executor
    from pagedkv.model.tokenizer import Tokenizer
    from pagedkv.store.tiered import TieredKVStore
    from pagedkv.store.transfer import KVTransfer


@dataclass
class CoreParts:
    """An engine core's parts as `build_core` made them; the core owns them from then on.
    `kv_store` is rank 0's store (the one the scheduler looks up), None without tiers."""

    args: EngineArgs
    tokenizer: Tokenizer
    executor: Executor
    kv_setup: KVCacheSetup
    scheduler: Scheduler
    kv_store: TieredKVStore | None
    event_publisher: ZmqEventPublisher | None
    step_log: StepLog | None
    kv_transfer: KVTransfer | None = None


def build_core(args: EngineArgs, tokenizer: Tokenizer | None = None) -> CoreParts:
    """Check `args`, load the model and build every part of an engine core (see the module
    docstring). ValueError for settings that cannot work, before any weight is loaded where
    the settings alone tell."""
    from pagedkv.model.runner import resolve_device

    args.validate()
    if not args.model:
        raise ValueError("model must be a model directory, got ''")
    tokenizer = open_model_dir(args, tokenizer)  # hub id resolved, directory checked
    profiled = resolve_device(args.device).type == "cuda" \
        and args.num_gpu_blocks_override is None and args.kv_cache_memory_bytes is None
    setup: KVCacheSetup | None = None if profiled else plan_kv_cache(args)  # fails early
    events_config = parse_kv_events_config(args.kv_events_config)
    store = store_config(args, events_config.enabled)
    if setup is not None:
        check_store_supports(store, setup)
    # The executor: the ModelRunner itself, or rank 0 of a tensor-parallel group (the
    # scheduler below decides once, on rank 0, for every rank).
    executor = build_executor(args, runner_config(args, None if setup is None else setup.spec,
                                                  store))
    with contextlib.ExitStack() as on_failure:  # no rank, store thread or weight outlives it
        on_failure.callback(executor.shutdown)
        if setup is None:
            setup = plan_kv_cache(args, profile_memory(executor, args))
            check_store_supports(store, setup)
        elif args.num_gpu_blocks_override is None and args.kv_cache_memory_bytes is None:
            # CPU: the memory budget less the weights as loaded (packed ones as packed)
            setup = plan_kv_cache(args, weights_bytes=executor.weights_bytes)
        prepare_executor(executor, args, setup)
        proposer = build_draft_proposer(args, setup, executor.model_config.vocab_size)
        if proposer is not None:
            on_failure.callback(proposer.runner.shutdown)
        scheduler = build_scheduler(args, setup, executor, store is not None,
                                    events_config.enabled, proposer)
        publisher = make_event_publisher(events_config, args.data_parallel_rank)
        if publisher is not None:
            on_failure.callback(publisher.close)
        step_log = open_step_log(args)
        on_failure.pop_all()
    kv_store = None if store is None else executor.kv_connector.store
    return CoreParts(args=args, tokenizer=tokenizer, executor=executor, kv_setup=setup,
                     scheduler=scheduler, kv_store=kv_store, event_publisher=publisher,
                     step_log=step_log, kv_transfer=build_kv_transfer(args, store, executor,
                                                                      scheduler))


def build_kv_transfer(args: EngineArgs, store: StoreConfig | None, executor: Executor,
                      scheduler: Scheduler) -> KVTransfer | None:
    """The core's side of prefill/decode disaggregation over every rank's (None without
    `kv_transfer_config`)."""
    connector = None if store is None else executor.kv_connector
    if store is None or store.transfer is None or connector is None:
        return None
    from pagedkv.kv.hashing import group_key_suffix
    from pagedkv.store.transfer import KVTransfer

    kv = scheduler.kv_cache_manager
    return KVTransfer(store.transfer, connector.transfer, kv.hasher,
                      f"kv_cache_dtype={args.kv_cache_dtype};dtype={args.dtype}",
                      rank_calls(executor),
                      num_groups=len(getattr(kv, "window_blocks", None) or [None]),
                      device_holds=lambda block_hash, group: kv.pool.get_cached_block(
                          block_hash + group_key_suffix(group)) is not None)


def rank_calls(executor: Executor) -> Callable[..., list[Any]]:
    """Calls `method` (a dotted path below a rank's runner) on every rank, results in rank
    order: the executor's collective call, or with one process the runner's own method."""
    if hasattr(executor, "collective_rpc"):
        return executor.collective_rpc

    def local(method: str, *args: Any) -> list[Any]:
        target: Any = executor
        for part in method.split("."):
            target = getattr(target, part)
        return [target(*args)]

    return local


def store_config(args: EngineArgs, enable_events: bool) -> StoreConfig | None:
    """The KV store `args` configures (None when no tier is): its tiers and the model's weight
    files, whose digests are part of every key."""
    if not args.uses_kv_store:
        return None
    from pagedkv.model.loader import weight_files

    return StoreConfig(model_dir=args.model,
                       weight_files=tuple(str(p) for p in weight_files(args.model)),
                       host_bytes=int(args.kv_offloading_size * GiB),
                       disk_path=args.kv_offloading_disk_path or None,
                       disk_bytes=int(args.kv_offloading_disk_size * GiB),
                       remote_url=args.kv_offloading_remote_url or None,
                       enable_events=enable_events,
                       transfer=parse_kv_transfer_config(args.kv_transfer_config))


def check_store_supports(store: StoreConfig | None, setup: KVCacheSetup) -> None:
    """ValueError for a KV store over a cache it cannot serve: KV cache groups (sliding
    groups beside full ones) are stored per group, but a model whose every layer slides (one
    sliding group) is refused."""
    window = setup.sliding_window
    if store is not None and window is not None \
            and not isinstance(setup.spec, HybridKVCacheSpec):
        raise ValueError("the KV store (kv_offloading_*) does not support sliding-window models "
                         f"(sliding_window={window})")


def profile_memory(executor: Executor, args: EngineArgs) -> GpuMemoryProfile:
    """(CUDA, no explicit KV size) This engine's weights and the peak activation of a profile
    forward pass at max_num_batched_tokens, and the memory free afterwards."""
    import torch

    max_len = args.max_model_len or executor.model_config.max_position_embeddings
    peak = executor.profile_activation_peak(resolve_max_num_batched_tokens(args),
                                            args.max_num_seqs, max_len)
    free, total = torch.cuda.mem_get_info(executor.device)
    return GpuMemoryProfile(total_bytes=total, free_bytes=free,
                            weights_bytes=executor.weights_bytes, activation_peak_bytes=peak)


def prepare_executor(executor: Executor, args: EngineArgs, setup: KVCacheSetup) -> None:
    """Allocate every rank's KV cache (and store), capture the decode CUDA graphs unless
    `enforce_eager`, and on CPU run the warm-up steps (unless $PAGEDKV_SKIP_WARMUP is 1)."""
    from pagedkv.model.cuda_graphs import decode_batch_sizes
    from pagedkv.model.runner import resolve_device

    executor.allocate_kv_cache(setup.num_blocks, setup.num_host_blocks)
    if not args.enforce_eager:
        executor.capture_cuda_graphs(decode_batch_sizes(args.max_num_seqs), setup.max_model_len)
    if resolve_device(args.device).type == "cpu" and not warmup_skipped():
        warm_up(executor, args, setup)


def warm_up(executor: Executor, args: EngineArgs, setup: KVCacheSetup) -> None:
    """(CPU) Run the throwaway warm-up steps (warmup.py) through the executor: the first
    request's steps then run as fast as later ones. Skipped for caches of several KV cache
    groups (their block tables differ per group)."""
    if getattr(executor, "layer_groups", None) is not None:
        return
    for out in warmup_steps(setup.max_num_batched_tokens, args.max_num_seqs,
                            setup.max_model_len, args.block_size, setup.num_blocks):
        executor.execute(out)


def build_scheduler(args: EngineArgs, setup: KVCacheSetup, executor: Executor,
                    uses_store: bool, events_enabled: bool,
                    proposer: DraftModelProposer | None = None) -> Scheduler:
    """The KV cache manager over `setup`'s blocks and the scheduler that allocates through it;
    with a KV store, the store's scheduler side over rank 0's worker side; `proposer`: the
    draft model's (draft_setup.py), None for any other speculation."""
    kv = make_kv_cache_manager(
        setup.spec, num_blocks=setup.num_blocks,
        num_host_blocks=setup.num_host_blocks, enable_caching=args.enable_prefix_caching,
        watermark=args.watermark, hash_algo=args.prefix_caching_hash_algo,
        enable_kv_cache_events=events_enabled, eviction_policy=args.eviction_policy,
        max_pinned_fraction=args.max_pinned_fraction,
        prefix_match_unit=args.prefix_match_unit,
        max_num_batched_tokens=setup.max_num_batched_tokens)
    connector = build_scheduler_side(executor.kv_connector, kv) if uses_store else None
    return Scheduler(SchedulerConfig.from_options(
        args, max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len, on_cuda=device_is_cuda(args.device)), kv,
        kv_connector=connector, proposer=proposer)


def open_step_log(args: EngineArgs) -> StepLog | None:
    """The step log `args.step_log` names (None: none)."""
    if not args.step_log:
        return None
    from pagedkv.engine.step_log import StepLog

    return StepLog(args.step_log)
