"""The lines `pagedkv serve` logs once it is ready: where it listens, what it serves and how
much KV cache it has, from what the engine core reported when it was built (`EngineReady`).

    pagedkv 0.1.0 ready on http://127.0.0.1:8000 (OpenAI API under /v1, dashboard /dashboard)
    model: /models/SmolLM2-135M, served as '/models/SmolLM2-135M'
    weights: 256.6 MiB bfloat16 on cpu
    KV cache: 32768 blocks of 16 tokens, 9.00 KiB each: 288.00 MiB (bfloat16)
    Maximum concurrency for 8192 tokens per request: 64.00x
    engine core: pid 4242
    CPU kernels: fused C++ kernels (avx512_bf16 panels)

With data parallelism the KV cache line is per core and the core line lists every core:

    data parallel: 2 engine cores (pids 4242, 4243), 1 CPU thread per rank each

"Maximum concurrency" is vLLM's figure: the usable blocks over the blocks one request of
max_model_len tokens holds at most (fewer with sliding-window layers).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from pagedkv.kv.sizes import format_size

logger = logging.getLogger("pagedkv.server")


def listen_url(sock: socket.socket) -> str:
    """The http URL of a bound socket (its real port: `--port 0` binds a free one)."""
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def max_concurrency(num_usable_blocks: int, max_blocks_per_request: int) -> float:
    """Requests of max_model_len tokens the KV cache holds at once (vLLM's "Maximum
    concurrency ... Nx"); 0 when the core did not say how many blocks a request holds."""
    return num_usable_blocks / max_blocks_per_request if max_blocks_per_request > 0 else 0.0


def core_pid(engine: Any) -> int | None:
    """The engine core process's pid; None when the core runs in this process."""
    process = getattr(getattr(engine, "client", None), "process", None)
    return None if process is None else process.pid


def cores_line(engine: Any, ready: Any) -> str:
    """The engine core line: in-process, its pid, or every data-parallel core's pid (and,
    on CPU, each rank's compute threads)."""
    cores = getattr(getattr(engine, "client", None), "cores", None)
    malloc = f", malloc: {ready.malloc}" if getattr(ready, "malloc", "") else ""
    if not cores:
        pid = core_pid(engine)
        return f"engine core: {'in-process' if pid is None else f'pid {pid}'}{malloc}"
    pids = ", ".join(str(core.process.pid) for core in cores)
    line = f"data parallel: {len(cores)} engine cores (pids {pids})"
    threads = engine.args.cpu_threads
    if str(ready.device).startswith("cpu"):
        from pagedkv.engine.dp_client import cpu_share

        count = cpu_share(engine.args, len(os.sched_getaffinity(0))) if threads is None \
            else threads
        line += f", {count} CPU thread{'s' if count != 1 else ''} per rank each"
    return line


def banner_lines(engine: Any, *, url: str, served_model_name: str, version: str) -> list[str]:
    """The start-up banner of a server for `engine` (an `LLMEngine`) at `url`."""
    ready = engine.ready
    blocks = ready.num_gpu_blocks
    per_core = " per core" if getattr(engine.args, "data_parallel_size", 1) > 1 else ""
    lines = [
        f"pagedkv {version} ready on {url} (OpenAI API under /v1, dashboard {url}/dashboard)",
        f"model: {engine.args.model}, served as {served_model_name!r}",
        f"weights: {format_size(ready.weights_bytes)} {ready.model_dtype} on {ready.device}",
        f"KV cache: {blocks} blocks of {ready.block_size} tokens, "
        f"{format_size(ready.block_bytes)} each: {format_size(blocks * ready.block_bytes)} "
        f"({ready.kv_cache_dtype}){per_core}"
        + (f"; budget: {ready.kv_budget}" if ready.kv_budget else ""),
        f"Maximum concurrency for {ready.max_model_len} tokens per request: "
        f"{max_concurrency(ready.num_usable_blocks, ready.max_blocks_per_request):.2f}x",
        cores_line(engine, ready),
    ]
    if ready.draft_num_blocks:
        lines.append(f"draft model KV cache: {ready.draft_num_blocks} blocks of "
                     f"{ready.block_size} tokens, {format_size(ready.draft_block_bytes)} each: "
                     f"{format_size(ready.draft_num_blocks * ready.draft_block_bytes)}")
    if ready.cpu_kernels:
        lines.append(f"CPU kernels: {ready.cpu_kernels}")
    return lines


def log_banner(engine: Any, *, url: str, served_model_name: str, version: str) -> None:
    """Log `banner_lines` at INFO on the "pagedkv.server" logger, one record per line."""
    for line in banner_lines(engine, url=url, served_model_name=served_model_name,
                             version=version):
        logger.info("%s", line)
