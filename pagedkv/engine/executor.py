"""Which executor runs the model for an engine: the ModelRunner itself in one process, or a
MultiProcExecutor (or, with distributed_executor_backend='ray', a RayExecutor) over
`tensor_parallel_size` ranks (pagedkv.model.executor)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pagedkv.engine.args import EngineArgs
from pagedkv.kv.spec import KVCacheSpec
from pagedkv.model.runner_config import RunnerConfig
from pagedkv.store.config import StoreConfig

if TYPE_CHECKING:
    from pagedkv.model.executor import Executor

logger = logging.getLogger(__name__)


def runner_config(args: EngineArgs, spec: KVCacheSpec | None,
                  kv_store: StoreConfig | None) -> RunnerConfig:
    """What every rank's ModelRunner is built from, for `args` (`spec`: one rank's KV cache
    spec, or None to build it from the model's config; `kv_store`: the store each rank builds
    over its KV cache, None for none)."""
    return RunnerConfig(model=args.model, block_size=args.block_size, dtype=args.dtype,
                        device=args.device, seed=args.seed, kv_cache_spec=spec,
                        cpu_kernels=args.cpu_kernels, cpu_threads=rank_cpu_threads(args),
                        kv_cache_dtype=args.kv_cache_dtype, kv_store=kv_store,
                        quantization=args.quantization)


def rank_cpu_threads(args: EngineArgs) -> int | None:
    """Each rank's torch threads: `cpu_threads` when given; with tensor parallelism on a CPU,
    this machine's cores shared out evenly (at least 1 each: two ranks on two cores run one
    thread each, so no rank waits for a thread that lost its core)."""
    if args.cpu_threads is not None or args.tensor_parallel_size == 1:
        return args.cpu_threads
    from pagedkv.model.cpu_threads import allowed_cpus

    return max(1, len(allowed_cpus()) // (args.tensor_parallel_size // args.nnodes))


def init_method(args: EngineArgs) -> str | None:
    """The ranks' rendezvous: None (a file in a temp dir) on one machine, else node 0's
    `tcp://master_addr:master_port`."""
    if args.nnodes == 1:
        return None
    return f"tcp://{args.master_addr}:{args.master_port}"


def build_executor(args: EngineArgs, config: RunnerConfig) -> Executor:
    """The executor for `args`' parallel layout, every rank's runner built from `config`, with
    its model loaded and no KV cache yet."""
    from pagedkv.model.runner import ModelRunner

    if args.node_rank > 0:
        raise ValueError(f"node_rank={args.node_rank} runs only this machine's worker ranks "
                         "(`pagedkv serve MODEL --node-rank K ...`), not an engine")
    if args.tensor_parallel_size > 1:  # before any process starts
        from pagedkv.model.parallel.sharding import check_tensor_parallel_size
        from pagedkv.model.registry import model_config_from_dir

        cfg = model_config_from_dir(args.model)
        check_tensor_parallel_size(args.tensor_parallel_size, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.intermediate_size)
    if args.tensor_parallel_size == 1:
        return ModelRunner.from_config(config)
    if args.distributed_executor_backend == "ray":
        from pagedkv.model.executor.ray_executor import RayExecutor

        return RayExecutor(config, size=args.tensor_parallel_size,
                           timeout_s=args.distributed_timeout_s, nnodes=args.nnodes,
                           master_port=args.master_port)
    from pagedkv.model.executor.multiproc import MultiProcExecutor

    return MultiProcExecutor(config, size=args.tensor_parallel_size,
                             ranks_per_node=args.tensor_parallel_size // args.nnodes,
                             timeout_s=args.distributed_timeout_s, init_method=init_method(args))


def run_node_ranks(args: EngineArgs) -> int:
    """Machine `node_rank` > 0 of `nnodes`: run this machine's tensor-parallel ranks (worker
    processes that join node 0's rendezvous at master_addr:master_port and take their model
    and every step from rank 0) until rank 0 shuts them down. Returns 0 when every rank ended
    cleanly, else the first non-zero exit code."""
    import torch.multiprocessing as mp

    if args.node_rank == 0:
        raise ValueError("node_rank 0 runs the engine, not worker ranks only")
    per_node = args.tensor_parallel_size // args.nnodes
    first = args.node_rank * per_node
    ranks = range(first, first + per_node)
    logger.info("node %d of %d: starting tensor-parallel rank%s %s of %d, joining node 0 at %s",
                args.node_rank, args.nnodes, "" if per_node == 1 else "s",
                ", ".join(map(str, ranks)), args.tensor_parallel_size, init_method(args))
    ctx = mp.get_context("spawn")
    log_level = logging.getLogger().getEffectiveLevel()
    procs = [ctx.Process(target=node_rank_main, name=f"pagedkv-tp-rank{r}",
                         args=(log_level, r, r - first, args.tensor_parallel_size,
                               init_method(args), args.device, args.distributed_timeout_s,
                               rank_cpu_threads(args)))
             for r in ranks]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    code = next((p.exitcode for p in procs if p.exitcode), 0)
    logger.info("node %d of %d: every rank ended (exit code %d)", args.node_rank, args.nnodes,
                code)
    return code


def node_rank_main(log_level: int, *worker_args: Any) -> None:
    """The process body of a rank of `run_node_ranks`: this node's log level and format (so
    the rank says when it joined and loaded), then `worker_main(*worker_args)`."""
    from pagedkv.model.executor.worker import worker_main

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker_main(*worker_args)
