"""One simulated engine: pagedkv's real `Scheduler` and `KVCacheManager` on a virtual clock.

Each step is the engine's own loop (`LLMEngine.step`): `schedule()`, then instead of the model
runner a latency model gives the step's duration and every sampling request gets one token,
then `update()`. Requests carry `max_tokens` = the trace's output length with `ignore_eos`, so
they finish where the trace says.

Quiet stretches (only token counts change) are jumped when `jump=True`: see `quiet.py`.
"""

from __future__ import annotations

import math

from pagedkv.kv.block_table import BlockIdTable
from pagedkv.kv.manager import KVCacheManager
from pagedkv.sched.output import ModelRunnerOutput
from pagedkv.sched.request import Request, RequestStatus
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.sched.scheduler import Scheduler
from pagedkv.sim.config import SimConfig
from pagedkv.sim.latency.base import LatencyModel, StepShape
from pagedkv.sim.lazy_request import LazyPromptRequest
from pagedkv.sim.quiet import jump
from pagedkv.sim.records import InstanceStats, RequestRecord, StepRecord
from pagedkv.sim.store import SimStoreConnector, SimTier
from pagedkv.sim.traces import TraceRequest
from pagedkv.utils import cdiv


class _SimKVCacheManager(KVCacheManager):
    """The real manager; only the block ids the scheduler hands each scheduled request for
    the model runner are left empty (no runner reads them here), and the pool keeps no eviction log (it serves the
    server's /v1/cache/explain; here its record per evicted block was 14% of a run's time
    under cProfile on the Mooncake trace)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.pool.eviction_log = None

    def get_block_ids(self, request_id: str) -> list[int]:
        return []

    def sync_block_ids(self, request_id: str, table: BlockIdTable) -> list[int]:
        return []


class SimInstance:
    """One engine under simulation. Not thread-safe. `clock` only moves forward."""

    def __init__(self, config: SimConfig, latency: LatencyModel, *, index: int = 0,
                 record_steps: bool = False, cross_arrivals: bool = False,
                 shared_tiers: dict[str, SimTier] | None = None, wake: float = 0.0) -> None:
        """`cross_arrivals`: quiet stretches may run past arrivals that cannot change them
        (see `quiet.jump`); only when nothing reads this instance's state at each arrival
        (a router does). `shared_tiers`: the KV store tiers all instances share (Redis).
        `wake`: seconds from a request reaching the idle engine to its first step
        (`FrontendDelays.wake`); requests added meanwhile join that step."""
        self.config = config
        self.wake = wake
        self._asleep = True  # idle, waiting for a request: the next one wakes the loop
        self.cross_arrivals = cross_arrivals
        self.latency = latency
        self.index = index
        self.kv = _SimKVCacheManager(
            num_blocks=config.num_blocks, block_size=config.block_size,
            num_host_blocks=config.num_host_blocks if config.preemption_mode == "swap" else 0,
            enable_caching=config.enable_prefix_caching,
            sliding_window=config.sliding_window, watermark=config.watermark,
            hash_algo=config.prefix_caching_hash_algo, eviction_policy=config.eviction_policy)
        self.store: SimStoreConnector | None = None
        if config.store_tiers:
            self.store = SimStoreConnector(config.store_tiers, self.kv, config.block_bytes,
                                           lambda: self.clock, shared_tiers)
        self.scheduler = Scheduler(config.scheduler_config(), self.kv, kv_connector=self.store)
        self.clock = 0.0
        self.live: dict[str, RequestRecord] = {}
        self.finished: list[RequestRecord] = []
        self.stats = InstanceStats()
        self.steps: list[StepRecord] | None = [] if record_steps else None
        self.sampled_tokens: dict[str, int] = {}  # the token each request "samples"
        # (start, end) of every step when a caller asks for them (set it to []): when the
        # engine loop is between steps (a frontend's command runs only there). Jumped quiet
        # stretches are one span.
        self.step_spans: list[tuple[float, float]] | None = None

    # ---- requests -----------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def fits(self, prompt_tokens: int) -> bool:
        """Whether the engine would take a prompt of this many tokens: it leaves room for a
        token within max_model_len and can fit the cache. Decided from the length alone, before
        any token of it is made."""
        cfg, kv = self.config, self.kv
        return 0 < prompt_tokens < cfg.max_model_len and \
            cdiv(prompt_tokens + 1, cfg.block_size) <= kv.num_usable_blocks - kv.watermark_blocks

    def add(self, record: RequestRecord, trace_request: TraceRequest) -> Request | None:
        """Queue a trace request now (its arrival is `record.arrival`; its prompt tokens are
        made when the scheduler first reads them, `lazy_request.py`). Refused, as the engine
        refuses it, when the prompt leaves no room for a token or can never fit the cache:
        then the record is finished as 'rejected' and None is returned."""
        cfg = self.config
        n = trace_request.input_length
        record.instance = self.index
        if not self.fits(n):
            record.status, record.error = "rejected", f"prompt of {n} tokens does not fit"
            record.finish = None
            self.finished.append(record)
            return None
        if self._asleep:
            self._asleep = False
            self.clock += self.wake
        max_tokens = min(record.output_tokens, cfg.max_model_len - n)
        request = LazyPromptRequest(
            str(record.index), trace_request, cfg.vocab_size, record.index,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=record.arrival)
        self.scheduler.add_request(request)
        self.live[request.request_id] = record
        self.sampled_tokens[request.request_id] = (record.index * 7919 + 13) % cfg.vocab_size
        return request

    # ---- time ---------------------------------------------------------------------------

    def run_until(self, horizon: float) -> None:
        """Step until the clock reaches `horizon` (a step that starts before it may end after
        it) or nothing is left to run; an idle instance's clock moves to `horizon`, where it
        waits for a request (the next `add` wakes it)."""
        while self.clock < horizon:
            if not self.busy or not self.step(horizon):
                if math.isinf(horizon):
                    self._fail_stuck()
                    return
                self.clock = horizon
                self._asleep = not self.busy
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
            if self.store is not None and self.store.num_pending_loads:
                self.clock += self.store.idle_wait()  # the worker waits for a load
                return True
            return bool(changed) or bool(out.blocks_to_swap_out or out.blocks_to_swap_in)
        dt = self.latency.step_time(StepShape.of(out))
        self.clock = now = start + dt
        stats = self.stats
        stats.num_steps += 1
        stats.busy_time += dt
        sampled = {}
        live = self.live
        tokens = self.sampled_tokens
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
        stats.record_usage(now, self.kv.usage, sched)
        if self.config.jump:
            jump(self, horizon)
        if self.step_spans is not None:
            self.step_spans.append((start, self.clock))
        return True

    def _finish_changed(self, changed: list[Request]) -> None:
        for request in changed:
            if not request.is_finished:
                continue
            record = self.live.pop(request.request_id, None)
            if record is None:
                continue
            del self.sampled_tokens[request.request_id]
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
