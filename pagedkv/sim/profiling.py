"""`pagedkv profile MODEL`: time a grid of step shapes through the real model runner and fit
the simulator's latency model (`FittedLatency`) to them.

Each grid point is one step built by hand: `decode_seqs` requests decoding one token at
`context` tokens of context, plus one prefill chunk of `prefill_tokens` tokens (from position
0). Blocks come from the engine's own KV manager (contents are whatever the cache holds: only
the time matters). Each point runs `repeats` times after a warm-up; the median is kept. The
engine is built as `pagedkv serve` builds it (same flags), so the runner, kernels and threads
are the ones that serve. Imports torch (through the engine).
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

QUICK_GRID = dict(prefill_tokens=(0, 64, 256, 1024), decode_seqs=(0, 1, 8, 32),
                  context=(64, 512, 1536))
FULL_GRID = dict(prefill_tokens=(0, 16, 64, 256, 512, 1024, 2048),
                 decode_seqs=(0, 1, 4, 16, 32, 64), context=(32, 256, 1024, 2048))


def _step(engine: Any, prefill_tokens: int, decode_seqs: int, context: int,
          serial: itertools.count) -> tuple[SchedulerOutput, list[Request]] | None:
    """A hand-built step and the requests holding its blocks (None: the cache is too small)."""
    kv = engine.scheduler.kv_cache_manager
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    requests, scheduled = [], []
    shapes = [(context, 1)] * decode_seqs + ([(0, prefill_tokens)] if prefill_tokens else [])
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


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def profile_engine(engine: Any, grid: dict[str, Sequence[int]] | None = None, *,
                   repeats: int = 3, log: Callable[[str], None] | None = None,
                   clock: str = "wall") -> tuple[list[StepShape], list[float]]:
    """(shapes, median seconds) for every grid point the engine's cache can hold, timed by
    `clock`: "wall", or "cpu" (this thread's CPU time: the work alone, without what other
    processes take on a shared machine; exact with --cpu-threads 1)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    now = CLOCKS[clock]
    grid = grid or QUICK_GRID
    runner = engine.runner
    kv = engine.scheduler.kv_cache_manager
    serial = itertools.count()
    shapes, times = [], []
    points = [(p, d, c) for p in grid["prefill_tokens"] for d in grid["decode_seqs"]
              for c in (grid["context"] if d else grid["context"][:1]) if p or d]
    for i, (p, d, c) in enumerate(points):
        built = _step(engine, p, d, c, serial)
        if built is None:
            if log:
                log(f"  skip prefill={p} decode={d}x{c}: the KV cache is too small")
            continue
        out, requests = built
        samples = []
        for rep in range(repeats + 1):
            start = now()
            runner.execute(out)
            if rep:  # the first run warms up
                samples.append(now() - start)
        ids = [r.request_id for r in requests]
        for r in requests:
            kv.free(r)
        runner.execute(SchedulerOutput(finished_request_ids=ids))
        shapes.append(StepShape.of(out))
        times.append(statistics.median(samples))
        if log:
            log(f"  [{i + 1}/{len(points)}] prefill={p} decode={d}x{c}: "
                f"{times[-1] * 1e3:.1f} ms")
    kv.check_invariants()
    return shapes, times


def profile_model(args: Any, grid: dict[str, Sequence[int]] | None = None, *,
                  repeats: int = 3, log: Callable[[str], None] | None = None,
                  clock: str = "wall") -> FittedLatency:
    """Build the engine for `args` (EngineArgs), time the grid, fit and return the model."""
    from pagedkv.engine.llm_engine import LLMEngine

    engine = LLMEngine(args)
    try:
        shapes, times = profile_engine(engine, grid, repeats=repeats, log=log, clock=clock)
    finally:
        engine.shutdown()
    meta = {"model": str(args.model), "block_size": args.block_size, "dtype": args.dtype,
            "machine": platform.machine(), "processor": platform.processor(),
            "profiled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "repeats": repeats, "clock": clock, "points": [
                {**s.__dict__, "seconds": t} for s, t in zip(shapes, times, strict=True)]}
    return FittedLatency.fit(shapes, times, meta)
