"""The simulator: a trace's arrivals over one or more `SimInstance`s, placed by the router's
own policy objects (`pagedkv.router.policies`) when there are several.

Time is virtual. A request arriving at t reaches the engines `admit` seconds later (an idle
engine starts its first step `wake` after that), and the server sees its tokens `output`
seconds after the engine made them (`frontend.py`: the serving frontend's delays; none unless
given or carried by the latency model). Before a request is
placed, every instance steps until its clock reaches its admission (the engine adds what
arrived while a step ran before its next step); then the policy sees each instance as the
router would (requests in flight, queued prefill blocks, running / waiting, KV usage, and the
prompt's leading blocks in its device prefix cache) and the request joins the chosen instance.
At the end every instance runs until it is idle.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedkv.router.policies import Candidate, RouteRequest, make_policy
from pagedkv.router.prefix_index import PrefixMatch
from pagedkv.sim.config import SimConfig
from pagedkv.sim.data_parallel import SimDPFrontend
from pagedkv.sim.frontend import FrontendDelays, frontend_of, observed
from pagedkv.sim.instance import SimInstance
from pagedkv.sim.latency.base import LatencyModel
from pagedkv.sim.records import RequestRecord
from pagedkv.sim.traces import TraceRequest, prompt_token_ids


@dataclass
class SimResult:
    """Everything a run measured. `records` are in trace order."""

    config: SimConfig
    latency_name: str
    instances: list[SimInstance]
    records: list[RequestRecord]
    policy: str | None = None
    wall_time: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        """Virtual seconds from the first arrival to the last finish."""
        ends = [r.finish for r in self.records if r.finish is not None]
        return max(ends, default=0.0) - min((r.arrival for r in self.records), default=0.0)


def _block_hashes(instance: SimInstance, ids: list[int]) -> tuple[bytes, ...]:
    class _Prompt:
        all_token_ids = ids
        cache_salt = None
        lora_name = None

    return tuple(instance.kv.hasher(_Prompt, []))


def _device_match(instance: SimInstance, hashes: Sequence[bytes]) -> int:
    get = instance.kv.pool.cached_block_hash_to_block.get
    n = 0
    for h in hashes:
        if get(h) is None:
            break
        n += 1
    return n


def simulate(trace: Sequence[TraceRequest], config: SimConfig, latency: LatencyModel, *,
             num_instances: int = 1, policy: str = "round-robin", record_steps: bool = False,
             progress: Callable[[int, int], None] | None = None,
             cross_arrivals: bool | None = None,
             on_instance: Callable[[SimInstance], None] | None = None,
             frontend: FrontendDelays | None = None,
             data_parallel: bool = False) -> SimResult:
    """Replay `trace` (sorted by arrival) through `num_instances` simulated engines.
    `frontend`: the serving frontend's delays (default: the latency model's, else none);
    records' times are then the server's (`frontend.observed`).
    `cross_arrivals` (default: with one instance) lets quiet-stretch jumps run past arrivals
    that cannot change them (`SimInstance`). `on_instance` is called with each instance before
    it runs (e.g. event_log.py's hook). `data_parallel`: the instances are the engine cores of
    one `--data-parallel-size` server, placed by its front end (`data_parallel.py`; `policy` is
    then kv-aware)."""
    if cross_arrivals is None:
        cross_arrivals = num_instances == 1
    if num_instances < 1:
        raise ValueError(f"num_instances must be >= 1, got {num_instances}")
    started = time.perf_counter()
    delays = frontend if frontend is not None else frontend_of(latency)
    shared_tiers: dict = {}  # the KV store tiers every instance reads and writes (Redis)
    instances = [SimInstance(config, latency, index=i, record_steps=record_steps,
                             cross_arrivals=cross_arrivals, shared_tiers=shared_tiers,
                             wake=delays.wake)
                 for i in range(num_instances)]
    if on_instance is not None:
        for inst in instances:
            on_instance(inst)
    router = make_policy(policy) if num_instances > 1 and not data_parallel else None
    cores = SimDPFrontend(instances, instances[0].kv.num_usable_blocks) \
        if num_instances > 1 and data_parallel else None
    records: list[RequestRecord] = []
    for index, treq in enumerate(trace):
        for inst in instances:
            inst.run_until(treq.arrival + delays.admit)
        record = RequestRecord(index=index, arrival=treq.arrival,
                               prompt_tokens=treq.input_length,
                               output_tokens=treq.output_length)
        records.append(record)
        chosen = 0
        if router is not None:
            chosen = _route(router, instances, index, treq, config)
        elif cores is not None:
            chosen = cores.place(record, _prompt_hashes(instances[0], index, treq, config))
        instances[chosen].add(record, treq)
        if progress is not None and index % 1000 == 0:
            progress(index, len(trace))
    for inst in instances:
        inst.run_until(math.inf)
    observed(records, delays)
    return SimResult(config=config, latency_name=getattr(latency, "name", "?"),
                     instances=instances, records=records,
                     policy=policy if router is not None else
                     "data-parallel" if cores is not None else None,
                     wall_time=time.perf_counter() - started)


def _prompt_hashes(instance: SimInstance, index: int, treq: TraceRequest,
                   config: SimConfig) -> tuple[bytes, ...]:
    """The prompt's block hashes; none without prefix caching, or for a prompt the instances
    will refuse (it is sized only: no token is made for it)."""
    if not config.enable_prefix_caching or not instance.fits(treq.input_length):
        return ()
    return _block_hashes(instance, prompt_token_ids(treq, config.vocab_size, index))


def _route(router, instances: list[SimInstance], index: int,
           treq: TraceRequest, config: SimConfig) -> int:
    hashes = _prompt_hashes(instances[0], index, treq, config) if router.needs_prefix else ()
    candidates = [instance_candidate(inst, config, _device_match(inst, hashes) if hashes else 0)
                  for inst in instances]
    request = RouteRequest(prompt_tokens=treq.input_length, block_hashes=hashes, session=treq.session)
    return router.choose(request, candidates)


def instance_candidate(inst: SimInstance, config: SimConfig, device_blocks: int = 0) -> Candidate:
    """`inst` as the router sees a backend (`device_blocks`: the prompt's prefix it holds)."""
    sched = inst.scheduler
    queued = sum(max(0.0, (r.prompt_tokens - r.cached_tokens) / config.block_size)
                 for r in inst.live.values() if r.first_token is None)
    return Candidate(name=str(inst.index), in_flight=len(inst.live), queued_blocks=queued,
                     running=len(sched.running), waiting=len(sched.waiting) + len(sched.loading),
                     kv_usage=inst.kv.usage, match=PrefixMatch(device_blocks=device_blocks))
