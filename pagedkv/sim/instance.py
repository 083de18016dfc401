"""One simulated engine: pagedkv's real `Scheduler` and `KVCacheManager` on a virtual clock.

Each step is the engine's own loop (`LLMEngine.step`): `schedule()`, then instead of the model
runner a latency model gives the step's duration and every sampling request gets one token,
then `update()`. Requests carry `max_tokens` = the trace's output length with `ignore_eos`, so
they finish where the trace says.

Quiet stretches are jumped (`jump=True`): when every running request is decoding, none can
finish, the KV cache has the blocks all of them need, nothing is swapped or loading, the
waiting queue's head is refused (or not looked at) and no arrival falls inside, the next k
steps can only append one token to each running request, so they are applied at once (blocks
allocated, tokens appended, full blocks cached) with the same per-step durations.
`tests/sim/test_jump.py` checks it equals stepping one by one.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

from pagedkv.kv.manager import AllocStatus, KVCacheManager
from pagedkv.sched.output import ModelRunnerOutput
from pagedkv.sched.request import Request, RequestStatus
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.sched.scheduler import Scheduler, SchedulerConfig
from pagedkv.sim.latency.base import LatencyModel, StepShape
from pagedkv.utils import cdiv


@dataclass
class SimConfig:
    """The simulated engine's settings, with `EngineArgs`' names where they exist.
    `num_blocks` counts the null block, as `num_gpu_blocks_override` does."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: str = "recompute"
    num_host_blocks: int = 0
    scheduling_policy: str = "fcfs"
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    eviction_policy: str = "lru"
    sliding_window: int | None = None
    vocab_size: int = 32000
    jump: bool = True

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens,
                               max_model_len=self.max_model_len,
                               preemption_mode=self.preemption_mode,
                               policy=self.scheduling_policy)


@dataclass
class RequestRecord:
    """What the simulator measured for one trace request (times in virtual seconds)."""

    index: int
    arrival: float
    prompt_tokens: int
    output_tokens: int  # the trace's (the request's max_tokens)
    instance: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finish: float | None = None
    num_tokens: int = 0  # tokens produced so far
    cached_tokens: int = 0
    num_preemptions: int = 0
    status: str = "waiting"  # then running | stop | length | error | rejected
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.last_token is None or self.num_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.num_tokens - 1)


@dataclass
class StepRecord:
    """One step as the scheduler decided it (kept only with `record_steps`): per scheduled
    request (id, first position, tokens), and the scheduler's preemption counters after it."""

    scheduled: tuple[tuple[str, int, int], ...]
    num_preemptions: int
    num_swaps: int


@dataclass
class InstanceStats:
    num_steps: int = 0
    num_jumped_steps: int = 0
    num_jumps: int = 0
    busy_time: float = 0.0
    usage_times: array = field(default_factory=lambda: array("d"))
    usage_values: array = field(default_factory=lambda: array("d"))
    itl_values: array = field(default_factory=lambda: array("d"))
    itl_weights: array = field(default_factory=lambda: array("d"))


class _SimKVCacheManager(KVCacheManager):
    """The real manager; only the block-id list the scheduler copies into each scheduled
    request for the model runner is left empty: no runner reads it here, and building it
    costs O(blocks) per request per step."""

    def get_block_ids(self, request_id: str) -> list[int]:
        return []


class SimInstance:
    """One engine under simulation. Not thread-safe. `clock` only moves forward."""

    def __init__(self, config: SimConfig, latency: LatencyModel, *, index: int = 0,
                 record_steps: bool = False) -> None:
        self.config = config
        self.latency = latency
        self.index = index
        self.kv = _SimKVCacheManager(
            num_blocks=config.num_blocks, block_size=config.block_size,
            num_host_blocks=config.num_host_blocks, enable_caching=config.enable_prefix_caching,
            sliding_window=config.sliding_window, watermark=config.watermark,
            hash_algo=config.prefix_caching_hash_algo, eviction_policy=config.eviction_policy)
        self.scheduler = Scheduler(config.scheduler_config(), self.kv)
        self.clock = 0.0
        self.live: dict[str, RequestRecord] = {}
        self.finished: list[RequestRecord] = []
        self.stats = InstanceStats()
        self.steps: list[StepRecord] | None = [] if record_steps else None
        self._tokens: dict[str, int] = {}  # the token each request "samples"

    # ---- requests -----------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def add(self, record: RequestRecord, prompt_token_ids: list[int]) -> Request | None:
        """Queue a trace request now (its arrival is `record.arrival`). Refused, as the engine
        refuses it, when the prompt leaves no room for a token or can never fit the cache:
        then the record is finished as 'rejected' and None is returned."""
        cfg = self.config
        n = len(prompt_token_ids)
        record.instance = self.index
        kv = self.kv
        if n == 0 or n >= cfg.max_model_len or \
                cdiv(n + 1, cfg.block_size) > kv.num_usable_blocks - kv.watermark_blocks:
            record.status, record.error = "rejected", f"prompt of {n} tokens does not fit"
            record.finish = None
            self.finished.append(record)
            return None
        max_tokens = min(record.output_tokens, cfg.max_model_len - n)
        request = Request(request_id=str(record.index), prompt_token_ids=prompt_token_ids,
                          sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          arrival_time=record.arrival)
        self.scheduler.add_request(request)
        self.live[request.request_id] = record
        self._tokens[request.request_id] = (record.index * 7919 + 13) % cfg.vocab_size
        return request

    # ---- time ---------------------------------------------------------------------------

    def run_until(self, horizon: float) -> None:
        """Step until the clock reaches `horizon` (a step that starts before it may end after
        it) or nothing is left to run; an idle instance's clock moves to `horizon`."""
        while self.clock < horizon:
            if not self.busy or not self.step(horizon):
                if math.isinf(horizon):
                    self._fail_stuck()
                    return
                self.clock = horizon
                return

    def step(self, horizon: float = math.inf) -> bool:
        """One engine step (or a jump over a quiet stretch ending before `horizon`). Returns
        False when nothing could run (only arrivals can change that)."""
        sched = self.scheduler
        start = self.clock
        out = sched.schedule()
        if not out.scheduled:
            changed = sched.update(out, ModelRunnerOutput())
            self._finish_changed(changed)
            return bool(changed) or bool(out.blocks_to_swap_out or out.blocks_to_swap_in)
        dt = self.latency.step_time(StepShape.of(out))
        self.clock = now = start + dt
        stats = self.stats
        stats.num_steps += 1
        stats.busy_time += dt
        sampled = {}
        live = self.live
        tokens = self._tokens
        for s in out.scheduled:
            rid = s.request_id
            record = live[rid]
            if record.first_scheduled is None:
                record.first_scheduled = start
                record.status = "running"
            if s.num_samples:
                sampled[rid] = [tokens[rid]]
        changed = sched.update(out, ModelRunnerOutput(sampled_token_ids=sampled))
        itl_values = stats.itl_values
        for rid in sampled:
            record = live[rid]
            if record.first_token is None:
                record.first_token = now
                request = sched.requests.get(rid)
                record.cached_tokens = max(request.num_cached_tokens, 0) if request else 0
            else:
                itl_values.append(now - record.last_token)
                stats.itl_weights.append(1.0)
            record.last_token = now
            record.num_tokens += 1
        self._finish_changed(changed)
        if self.steps is not None:
            self.steps.append(StepRecord(
                tuple((s.request_id, s.start_pos, len(s.token_ids)) for s in out.scheduled),
                sched.num_preemptions, sched.num_swaps))
        stats.usage_times.append(now)
        stats.usage_values.append(self.kv.usage)
        if self.config.jump:
            self._jump(horizon)
        return True

    def _finish_changed(self, changed: list[Request]) -> None:
        for request in changed:
            if not request.is_finished:
                continue
            record = self.live.pop(request.request_id, None)
            if record is None:
                continue
            del self._tokens[request.request_id]
            record.finish = self.clock
            record.num_preemptions = request.num_preemptions
            record.status = request.status.value
            record.error = request.error
            if request.first_scheduled_time is not None and record.first_token is None:
                record.cached_tokens = max(request.num_cached_tokens, 0)
            self.finished.append(record)

    def _fail_stuck(self) -> None:
        """Nothing can ever run again (no arrival will come): end what is left as errors."""
        ids = list(self.scheduler.requests)
        ended = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR,
                                               "the simulated engine could not run it")
        self._finish_changed(ended)

    # ---- quiet stretches ----------------------------------------------------------------

    def _quiet_limit(self) -> int:
        """The most steps that can be jumped now by the rules in the module docstring, ignoring
        arrivals and time (0: the next step must be a real one)."""
        sched = self.scheduler
        cfg = self.config
        running = sched.running
        if (not running or sched.swapped or sched.loading or cfg.sliding_window is not None
                or len(running) > cfg.max_num_batched_tokens):
            return 0
        limit = math.inf
        max_len = cfg.max_model_len
        for r in running:
            if r.num_computed_tokens != r.num_tokens - 1 or not r.output_token_ids:
                return 0
            remaining = min(r.sampling_params.max_tokens - len(r.output_token_ids),
                            max_len - r.num_tokens)
            if remaining - 1 < limit:
                limit = remaining - 1
                if limit <= 0:
                    return 0
        if sched.waiting and len(running) < cfg.max_num_seqs and not self._head_refused():
            return 0
        return int(limit)

    def _head_refused(self) -> bool:
        """Whether the waiting queue's head would get LATER now (and so, as blocks only get
        scarcer in a quiet stretch, in each of its steps), computed without side effects."""
        head = self.scheduler.waiting[0]
        kv = self.kv
        if head.wants_prompt_logprobs or self.scheduler.kv_connector is not None:
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

    def _jump(self, horizon: float) -> None:
        limit = self._quiet_limit()
        if limit <= 0:
            return
        sched = self.scheduler
        kv = self.kv
        running = list(sched.running)
        bs = kv.block_size
        free = kv.num_free_blocks
        held = [len(kv.get_blocks(r.request_id)) for r in running]
        computed = [r.num_computed_tokens for r in running]
        # Steps j = 0..k-1: each must start before `horizon` and find its new blocks free.
        num_seqs = len(running)
        context = sum(computed) + num_seqs  # decode context of the first step
        durations = []
        clock = self.clock
        k = 0
        while k < limit and clock < horizon:
            need = 0
            for c, h in zip(computed, held, strict=True):
                extra = -(-(c + k + 1) // bs) - h
                if extra > 0:
                    need += extra
            if need > free:
                break
            dt = self.latency.step_time(StepShape(decode_seqs=num_seqs,
                                                  decode_context=context + k * num_seqs))
            durations.append(dt)
            clock += dt
            k += 1
        if k == 0:
            return
        self._apply_quiet_steps(running, computed, held, k)
        stats = self.stats
        first_end = self.clock + durations[0]
        for r in running:
            record = self.live[r.request_id]
            stats.itl_values.append(first_end - record.last_token)
            stats.itl_weights.append(1.0)
            record.last_token = clock
            record.num_tokens += k
        for dt in durations[1:]:
            stats.itl_values.append(dt)
            stats.itl_weights.append(float(num_seqs))
        self.clock = clock
        stats.num_steps += k
        stats.num_jumped_steps += k
        stats.num_jumps += 1
        stats.busy_time += clock - (first_end - durations[0])
        stats.usage_times.append(clock)
        stats.usage_values.append(kv.usage)

    def _apply_quiet_steps(self, running: list[Request], computed: list[int], held: list[int],
                           k: int) -> None:
        """Apply k decode steps to `running` in the order the real steps would: per step, the
        new blocks (running order), the waiting head's prefix lookup, then the blocks that
        became full are cached. Only steps where something happens are visited."""
        kv = self.kv
        bs = kv.block_size
        allocs: dict[int, list[Request]] = {}
        caches: dict[int, list[Request]] = {}
        for r, c, h in zip(running, computed, held, strict=True):
            token = self._tokens[r.request_id]
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
        sched = self.scheduler
        head = (sched.waiting[0] if sched.waiting and len(running) < self.config.max_num_seqs
                else None)
        steps = range(k) if head is not None else sorted({*allocs, *caches})
        base = dict(zip((r.request_id for r in running), computed, strict=True))
        for j in steps:
            for r in allocs.get(j, ()):
                r.num_computed_tokens = base[r.request_id] + j
                kv.allocate_slots(r, 1, delay_cache_blocks=True)
            if head is not None:
                kv.get_computed_blocks(head)
            for r in caches.get(j, ()):
                kv.cache_blocks(r, base[r.request_id] + j + 1)
        for r in running:
            r.num_computed_tokens = base[r.request_id] + k
