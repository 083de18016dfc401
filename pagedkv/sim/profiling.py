"""`pagedkv profile MODEL`: time a grid of step shapes through the real model runner and fit
the simulator's latency model (`FittedLatency`) to them, then add the engine's own work around
the runner (scheduling, applying tokens, outputs), timed on a short burst of real requests per
step and per scheduled request (`host_overhead`).

Each grid point is one step built by hand: `decode_seqs` requests decoding one token at
`context` tokens of context, plus `prefill_tokens` prompt tokens (from position 0) split into
`prefill_seqs` chunks of as many requests, each starting at position `prefill_context` (a
grid without those keys: one chunk from position 0; several chunks cover the steps of a busy
server, which admit several prompts at once, and a start past 0 the later chunks of a long
prompt and prefix hits, whose attention to the cached part takes another path). Blocks come from the
engine's own KV manager (contents are whatever the cache holds: only the time matters). Each
point runs `repeats` times after a warm-up; the median is kept. The engine is built as
`pagedkv serve` builds it (same flags), so the runner, kernels and threads are the ones that
serve. Imports torch (through the engine).
"""

from __future__ import annotations

import itertools
import logging
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.sched.output import ScheduledRequest, SchedulerOutput
from pagedkv.sched.request import Request
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.sim.latency.base import StepShape
from pagedkv.sim.latency.fitted import FittedLatency

logger = logging.getLogger(__name__)

QUICK_GRID = dict(prefill_tokens=(0, 64, 256, 1024), prefill_seqs=(1, 4),
                  prefill_context=(0, 512), decode_seqs=(0, 1, 8, 32), context=(64, 512, 1536))
FULL_GRID = dict(prefill_tokens=(0, 16, 64, 256, 512, 1024, 2048), prefill_seqs=(1, 4),
                 prefill_context=(0, 1024), decode_seqs=(0, 1, 4, 16, 32, 64),
                 context=(32, 256, 1024, 2048))


def grid_points(grid: dict[str, Sequence[int]]) -> list[tuple[int, int, int, int, int]]:
    """(prefill tokens, prefill chunks, their start position, decode sequences, context) of
    every grid point: each decode count at each context (no decode: once), chunks of at least
    2 tokens."""
    return [(p, k, s, d, c) for p in grid["prefill_tokens"]
            for k in (grid.get("prefill_seqs", (1,)) if p else (1,))
            for s in (grid.get("prefill_context", (0,)) if p else (0,))
            for d in grid["decode_seqs"]
            for c in (grid["context"] if d else grid["context"][:1])
            if (p == 0 and d) or p >= 2 * k]


def _step(engine: Any, prefill_tokens: int, decode_seqs: int, context: int,
          serial: itertools.count, prefill_seqs: int = 1, prefill_start: int = 0
          ) -> tuple[SchedulerOutput, list[Request]] | None:
    """A hand-built step and the requests holding its blocks (None: the cache is too small).
    Allocates the requests' blocks in the engine's KV manager (the caller frees them)."""
    kv = engine.scheduler.kv_cache_manager
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    requests, scheduled = [], []
    chunks = [prefill_tokens // prefill_seqs + (i < prefill_tokens % prefill_seqs)
              for i in range(prefill_seqs)] if prefill_tokens else []
    shapes = [(context, 1)] * decode_seqs + [(prefill_start, n) for n in chunks if n > 1]
    for start, n in shapes:
        ids = [(7 * i + next(serial)) % vocab for i in range(start + n)]
        request = Request(request_id=f"profile-{next(serial)}", prompt_token_ids=ids,
                          sampling_params=params)
        if kv.allocate_slots(request, start + n) is None:
            for r in requests:
                kv.free(r)
            return None
        requests.append(request)
        scheduled.append(ScheduledRequest(
            request_id=request.request_id, token_ids=ids[start:start + n], start_pos=start,
            block_table=kv.get_block_ids(request.request_id), sampling_params=params,
            num_samples=1, prompt_token_ids=ids, output_token_ids=[]))
    return SchedulerOutput(scheduled=scheduled), requests


CLOCKS = ("wall", "cpu")


def profile_engine(engine: Any, grid: dict[str, Sequence[int]] | None = None, *,
                   repeats: int = 3, log: Callable[[str], None] | None = None
                   ) -> tuple[list[StepShape], dict[str, list[float]]]:
    """(shapes, median seconds by clock) for every grid point the engine's cache can hold:
    "wall", and "cpu" (this thread's CPU time: the work alone, without what other processes
    take on a shared machine; all of it with --cpu-threads 1)."""
    grid = grid or QUICK_GRID
    runner = engine.runner
    kv = engine.scheduler.kv_cache_manager
    serial = itertools.count()
    shapes: list[StepShape] = []
    times: dict[str, list[float]] = {"wall": [], "cpu": []}
    points = grid_points(grid)
    for i, (p, k, start, d, c) in enumerate(points):
        built = _step(engine, p, d, c, serial, k, start)
        if built is None:
            if log:
                log(f"  skip prefill={p}/{k}@{start} decode={d}x{c}: the KV cache is too small")
            continue
        out, requests = built
        wall, cpu = [], []
        for rep in range(repeats + 1):
            start, cpu_start = time.perf_counter(), time.thread_time()
            runner.execute(out)
            if rep:  # the first run warms up
                wall.append(time.perf_counter() - start)
                cpu.append(time.thread_time() - cpu_start)
        ids = [r.request_id for r in requests]
        for r in requests:
            kv.free(r)
        runner.execute(SchedulerOutput(finished_request_ids=ids))
        shapes.append(StepShape.of(out))
        times["wall"].append(statistics.median(wall))
        times["cpu"].append(statistics.median(cpu))
        if log:
            log(f"  [{i + 1}/{len(points)}] prefill={p}/{k}@{start} decode={d}x{c}: "
                f"{times['wall'][-1] * 1e3:.1f} ms ({times['cpu'][-1] * 1e3:.1f} ms CPU)")
    kv.check_invariants()
    return shapes, times


def host_overhead(engine: Any, clock: str, num_requests: int = 12,
                  seed: int = 0) -> tuple[float, float]:
    """(seconds per step, seconds per scheduled request) that `engine.step()` spends outside
    the model runner (scheduling, applying the tokens, outputs), timed by `clock` on a short
    burst of real requests, the runner's own time taken away. The grid times the runner
    alone; a real step costs this much more. Mutates the engine (runs and frees requests)."""
    import numpy as np

    from pagedkv.sched.sampling_params import SamplingParams

    now = time.perf_counter if clock == "wall" else time.thread_time
    runner = engine.runner
    execute = runner.execute
    runner_time = [0.0]
    scheduled = [0]

    def timed_execute(out: SchedulerOutput) -> Any:
        scheduled[0] += len(out.scheduled)
        start = now()
        try:
            return execute(out)
        finally:
            runner_time[0] += now() - start

    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    for i in range(num_requests):
        ids = rng.integers(0, vocab, int(rng.integers(16, 200))).tolist()
        engine.add_request(f"profile-host-{i}", ids, SamplingParams(
            max_tokens=int(rng.integers(4, 16)), ignore_eos=True, temperature=0.0))
    rows, host = [], []
    runner.execute = timed_execute
    try:
        while engine.has_unfinished_requests():
            runner_time[0], scheduled[0] = 0.0, 0
            start = now()
            engine.step()
            if scheduled[0]:
                host.append(now() - start - runner_time[0])
                rows.append((1.0, float(scheduled[0])))
    finally:
        runner.execute = execute
    x, y = np.array(rows[1:]), np.array(host[1:])  # the first step warms up
    coef = np.maximum(np.linalg.lstsq(x, y, rcond=None)[0], 0.0)
    return float(coef[0]), float(coef[1])


def profile_model(args: Any, grid: dict[str, Sequence[int]] | None = None, *,
                  repeats: int = 3, log: Callable[[str], None] | None = None,
                  clock: str = "wall") -> FittedLatency:
    """Build the engine for `args` (EngineArgs), time the grid, fit `clock`'s times and return
    the model; `meta["wall_over_cpu"]` says how much longer wall time was than CPU time (1 on
    a machine to itself)."""
    from pagedkv.engine.llm_engine import LLMEngine

    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    engine = LLMEngine(args)
    try:
        shapes, by_clock = profile_engine(engine, grid, repeats=repeats, log=log)
        per_step, per_request = host_overhead(engine, clock)
        engine.check_invariants()
    finally:
        engine.shutdown()
    if log:
        log(f"  host work outside the runner: {per_step * 1e3:.2f} ms a step + "
            f"{per_request * 1e6:.1f} us a request")
    meta = {"model": str(args.model), "block_size": args.block_size, "dtype": args.dtype,
            "machine": platform.machine(), "processor": platform.processor(),
            "profiled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "repeats": repeats, "clock": clock,
            "wall_over_cpu": sum(by_clock["wall"]) / max(sum(by_clock["cpu"]), 1e-9),
            "host_overhead": {"per_step": per_step, "per_request": per_request},
            "points": [{**s.__dict__, "wall_seconds": w, "cpu_seconds": c} for s, w, c in
                       zip(shapes, by_clock["wall"], by_clock["cpu"], strict=True)]}
    fitted = FittedLatency.fit(shapes, by_clock[clock], meta, relative=True)
    c = fitted.coefficients
    return FittedLatency({**c, "intercept": c["intercept"] + per_step,
                          "prefill_seqs": c["prefill_seqs"] + per_request,
                          "decode_seqs": c["decode_seqs"] + per_request}, fitted.meta)
