"""What an operator or a router reads of a server: GET /version, GET /kv_cache_info (how this
engine hashes prefix blocks and what a block is) and GET /metrics (Prometheus text)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedkv import __version__
from pagedkv.engine.async_engine import EngineDeadError
from pagedkv.http.errors import APIError

router = APIRouter()
KERNEL_CHOICE_TIMEOUT_S = 10.0  # the core answers between steps


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/kv_cache_info")
async def kv_cache_info(raw: Request) -> dict[str, Any]:
    """How this engine hashes prefix blocks, for a KV-aware router, and what a block is:
    the KV cache's format ("auto" resolved) and one block's bytes (read-only); and the CPU
    kernels' choice so far, read from the core (null where none runs or the core is gone).
    `num_gpu_blocks` is one core's pool (what a router caps its prefix record at);
    `engine_cores` lists every engine core (one, or `data_parallel_size`);
    `draft_num_gpu_blocks` is a draft model's own pool (0 without one); `weights_bytes` the
    model's weights as loaded (packed ones as packed) and `kv_budget` which rule sized the
    pool (engine/kv_setup.py)."""
    args, ready = raw.app.state.engine_facts.args, raw.app.state.engine_facts.ready
    return {"model": raw.app.state.serving.model_name, "block_size": args.block_size,
            "prefix_caching_hash_algo": args.prefix_caching_hash_algo,
            "enable_prefix_caching": args.enable_prefix_caching,
            "num_gpu_blocks": ready.num_gpu_blocks,
            "kv_cache_dtype": ready.kv_cache_dtype,
            "block_bytes": ready.block_bytes,
            "draft_num_gpu_blocks": ready.draft_num_blocks,
            "weights_bytes": ready.weights_bytes,
            "kv_budget": ready.kv_budget,
            "data_parallel_size": args.data_parallel_size,
            "engine_cores": [{"data_parallel_rank": rank, "num_gpu_blocks": core.num_gpu_blocks,
                              "pid": pid}
                             for rank, (core, pid) in enumerate(raw.app.state.engine_facts.cores)],
            "cpu_kernels": await cpu_kernel_choice(raw)}


async def cpu_kernel_choice(raw: Request) -> dict[str, Any] | None:
    """The core's utility call "cpu_kernel_choice" (engine/runner_facts.py), None when the core
    does not answer: /kv_cache_info's hash settings stay readable for a router."""
    try:
        return await raw.app.state.async_engine.call_utility("cpu_kernel_choice",
                                                             timeout=KERNEL_CHOICE_TIMEOUT_S)
    except (EngineDeadError, TimeoutError):
        return None


@router.get("/metrics")
async def prometheus_metrics(raw: Request) -> Response:
    """Every family, or with `?name[]=...` only those samples (prometheus_client's filter,
    as on vLLM's /metrics: a router's load scrape renders three gauges)."""
    metrics = raw.app.state.metrics
    try:
        metrics.update(await raw.app.state.async_engine.call_utility("get_core_stats"))
    except (EngineDeadError, TimeoutError) as exc:
        raise APIError(str(exc), status_code=503, type="server_unavailable") from exc
    names = raw.query_params.getlist("name[]")
    return Response(metrics.render(names or None), media_type=metrics.content_type)
