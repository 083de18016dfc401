"""Quiet stretches: k decode steps applied at once, exactly as k real steps would apply them.

A stretch qualifies when every running request is decoding (one token per step, at least one
output already), none can finish within it, nothing is swapped or loading, the scheduler would
not look at the waiting queue (sequence-bound) or its head gets LATER (it keeps getting LATER:
blocks only get scarcer), the KV cache has the new blocks all of them need, no sliding window
frees blocks, and no arrival falls before a step starts (unless arrivals cannot matter: FCFS
with a refused head or sequence-bound, on a single instance). Then the k steps only append one
token per request and per step: they are applied in the real order (per step: new blocks in
running order, the waiting head's prefix lookup, the blocks that became full written to the KV
store and cached), visiting only the steps where something happens. `tests/sim/test_jump.py` checks it equals stepping one by one.
"""

from __future__ import annotations

import math
from typing import Protocol

from pagedkv.kv.manager import AllocStatus, KVCacheManager
from pagedkv.sched.request import Request
from pagedkv.sched.scheduler import Scheduler
from pagedkv.sim.config import SimConfig
from pagedkv.sim.latency.base import LatencyModel, StepShape
from pagedkv.sim.records import InstanceStats, RequestRecord
from pagedkv.sim.store import SimStoreConnector


class QuietInstance(Protocol):
    """What a jump reads and writes of a simulated instance (`SimInstance`)."""

    config: SimConfig
    scheduler: Scheduler
    kv: KVCacheManager
    store: SimStoreConnector | None
    latency: LatencyModel
    stats: InstanceStats
    live: dict[str, RequestRecord]  # request id -> its record, while it runs
    sampled_tokens: dict[str, int]  # request id -> the token it "samples" at every step
    clock: float
    cross_arrivals: bool


def quiet_limit(instance: QuietInstance) -> tuple[int, bool]:
    """The most steps that can be jumped now by the rules in the module docstring, ignoring
    arrivals and time (0: the next step must be a real one), and whether arrivals during the
    stretch would change nothing in it: under FCFS a new request joins the waiting queue's
    tail, and the scheduler does not look past a head it refuses, nor at the queue at all
    with `max_num_seqs` running."""
    sched = instance.scheduler
    cfg = instance.config
    running = sched.running
    if (not running or sched.swapped or sched.loading or cfg.sliding_window is not None
            or len(running) > cfg.max_num_batched_tokens):
        return 0, False
    limit = math.inf
    max_len = cfg.max_model_len
    for r in running:
        if r.num_computed_tokens != r.num_tokens - 1 or not r.output_token_ids:
            return 0, False
        remaining = min(r.sampling_params.max_tokens - len(r.output_token_ids),
                        max_len - r.num_tokens)
        if remaining - 1 < limit:
            limit = remaining - 1
            if limit <= 0:
                return 0, False
    seq_bound = len(running) >= cfg.max_num_seqs
    if sched.waiting and not seq_bound:
        if not _head_refused(instance):
            return 0, False
        head_refused = True
    else:
        head_refused = False
    return int(limit), cfg.scheduling_policy == "fcfs" and (seq_bound or head_refused)

def _head_refused(instance: QuietInstance) -> bool:
    """Whether the waiting queue's head would get LATER now (and so, as blocks only get
    scarcer in a quiet stretch, in each of its steps), computed without side effects."""
    head = instance.scheduler.waiting[0]
    kv = instance.kv
    if head.wants_prompt_logprobs or instance.scheduler.kv_connector is not None:
        return False
    hits = []
    if kv.enable_caching:
        hashes = kv.update_block_hashes(head)
        get = kv.pool.cached_block_hash_to_block.get
        for block_hash in hashes[:(head.num_tokens - 1) // kv.block_size]:
            block = get(block_hash)
            if block is None:
                break
            hits.append(block)
    return kv.can_allocate(head, computed_blocks=hits) == AllocStatus.LATER

def jump(instance: QuietInstance, horizon: float) -> None:
    """Apply the longest quiet stretch whose steps all start before `horizon`, the next
    arrival (none when the next step must be a real one). With `instance.cross_arrivals`,
    a stretch that arrivals cannot change runs past `horizon`: those arrivals join the
    waiting queue after it, where they would have waited anyway. Mutates the instance like
    that many `step()` calls."""
    limit, arrivals_wait = quiet_limit(instance)
    if limit <= 0:
        return
    if arrivals_wait and instance.cross_arrivals:
        horizon = math.inf
    sched = instance.scheduler
    kv = instance.kv
    running = list(sched.running)
    bs = kv.block_size
    free = kv.num_free_blocks
    held = [len(kv.get_blocks(r.request_id)) for r in running]
    computed = [r.num_computed_tokens for r in running]
    # Steps j = 0..k-1: each must start before `horizon` and find its new blocks free.
    num_seqs = len(running)
    context = sum(computed) + num_seqs  # decode context of the first step
    durations = []
    clock = instance.clock
    k = 0
    while k < limit and clock < horizon:
        need = 0
        for c, h in zip(computed, held, strict=True):
            extra = -(-(c + k + 1) // bs) - h
            if extra > 0:
                need += extra
        if need > free:
            break
        saved = 0 if instance.store is None else sum(
            1 for c in computed if (c + k + 1) % bs == 0)  # blocks this step fills and saves
        dt = instance.latency.step_time(StepShape(decode_seqs=num_seqs,
                                                  decode_context=context + k * num_seqs,
                                                  saved_blocks=saved))
        durations.append(dt)
        clock += dt
        k += 1
    if k == 0:
        return
    _apply_quiet_steps(instance, running, computed, held, k)
    stats = instance.stats
    first_end = instance.clock + durations[0]
    for r in running:
        record = instance.live[r.request_id]
        stats.itl_values.append(first_end - record.last_token)
        stats.itl_weights.append(1.0)
        record.last_token = clock
        record.num_tokens += k
    for dt in durations[1:]:
        stats.itl_values.append(dt)
        stats.itl_weights.append(float(num_seqs))
    instance.clock = clock
    stats.num_steps += k
    stats.num_jumped_steps += k
    stats.num_jumps += 1
    stats.busy_time += clock - (first_end - durations[0])
    stats.record_usage(clock, kv.usage, instance.scheduler)

def _apply_quiet_steps(instance: QuietInstance, running: list[Request], computed: list[int], held: list[int],
                       k: int) -> None:
    """Apply k decode steps to `running` in the order the real steps would: per step, the
    new blocks (running order), the waiting head's prefix lookup, the blocks that became full
    written to the KV store (when there is one), then cached. Only steps where something
    happens are visited."""
    kv = instance.kv
    bs = kv.block_size
    allocs: dict[int, list[Request]] = {}
    caches: dict[int, list[Request]] = {}
    for r, c, h in zip(running, computed, held, strict=True):
        token = instance.sampled_tokens[r.request_id]
        extra = [token] * k
        r.output_token_ids.extend(extra)
        r.all_token_ids.extend(extra)
        p = max(c, h * bs)  # positions c .. c+k-1 are written; p needs a new block
        while p < c + k:
            allocs.setdefault(p - c, []).append(r)
            p += bs
        j = (-(c + 1)) % bs  # step whose token fills a block: (c + j + 1) % bs == 0
        while j < k:
            caches.setdefault(j, []).append(r)
            j += bs
    sched = instance.scheduler
    head = (sched.waiting[0] if sched.waiting and len(running) < instance.config.max_num_seqs
            else None)
    steps = range(k) if head is not None else sorted({*allocs, *caches})
    base = dict(zip((r.request_id for r in running), computed, strict=True))
    store = instance.store
    for j in steps:
        for r in allocs.get(j, ()):
            r.num_computed_tokens = base[r.request_id] + j
            kv.allocate_slots(r, 1, delay_cache_blocks=True)
        if head is not None:
            kv.get_computed_blocks(head)
        filled = caches.get(j, ())
        if store is not None:
            for r in filled:
                store.save_block(r, (base[r.request_id] + j) // bs)
        for r in filled:
            kv.cache_blocks(r, base[r.request_id] + j + 1)
    for r in running:
        r.num_computed_tokens = base[r.request_id] + k
