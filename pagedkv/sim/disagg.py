"""Prefill/decode disaggregation in the simulator (`pagedkv simulate --prefill-instances P
--decode-instances D --kv-link-gbps G`): does splitting beat the same number of mixed
instances for this trace and SLO (the DistServe question)?

A request goes through the split as the router's PD mode and the servers' kv_transfer code
run it (pagedkv/router/pd.py, pagedkv/server/kv_transfer.py, pagedkv/store/transfer.py):

1. prefill: on one of P instances, placed by the routing policy (kv-aware by default: prefix
   hits against load), as a request with one output token (vLLM's PD proxy sends max_tokens
   1). A producer keeps every block it computes in a host staging tier of `buffer_bytes`
   (`kv_buffer_size`), written through by the store's saver as each step computes it: its
   steps carry those saves (`saved_blocks`), and a later prompt's lookup finds its blocks
   there as store hits;
2. handoff: the server asks the engine to start the handoff and then polls it; both are
   utility calls, which the engine loop runs only between steps. The prefill's last step
   hands its output over and the loop goes straight on with the next step when it has work,
   so the start runs at that step's end; the push (the prompt's KV, its blocks of
   `block_bytes`, over the instance's link at `link_gbps`; one instance's pushes go one after
   another on its transfer thread, so a burst of long prompts queues on the link) starts
   there, and the poll that finds it done runs at the end of the step in progress when it
   is done (at once on an idle engine). The answer leaves then;
3. decode: on one of D instances, placed by load and KV room (the router's decode-room policy,
   pagedkv/router/pd_decode.py). Its server first asks the engine whether the pushed blocks
   are held (a utility call: at the end of the step in progress), then submits the request
   (a command the loop takes before its next step: one more step when busy). The transferred
   blocks are offered to the decode instance's scheduler as store blocks (a per-instance
   "transfer" tier ahead of any store tier, `TransferConnector`): the request allocates them,
   waits for the load as the engine waits for a connector's load, and computes only the
   prompt's tail past its full blocks (what the consumer does), then decodes every output
   token; every block it fills is copied out to its store as the real consumer's connector
   does (`saved_blocks`).

Each side has its own step cost (`decode_latency`, default the prefill side's): the two are
separate engines, on other hardware if the operator chooses (Splitwise), and a latency model
fitted on one side's steps (prompt-sized prefill steps with their saves) does not time the
other's (decode batches). TTFT is therefore prefill queue + prefill + handoff (steps to its
start and end) + transfer + decode admission and first step. The prefill phase does not depend
on the decode phase (a prefill instance frees a request's blocks at its end), so it runs first
over the whole trace, then the decode phase over the arrivals the answers give. The frontend's
`admit` delay is paid on both hops; `output` and `finish` on the decode's. Not modelled: the
router's own hop, a handoff that finds some of its blocks gone from the staging tier (its
consumer computes them), transfers competing with store traffic.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.router.pd_decode import DecodeRoomPolicy
from pagedkv.router.policies import RouteRequest
from pagedkv.sim.config import SimConfig
from pagedkv.sim.frontend import FrontendDelays, frontend_of, observed
from pagedkv.sim.instance import SimInstance
from pagedkv.sim.latency.base import LatencyModel
from pagedkv.sim.records import RequestRecord
from pagedkv.sim.simulator import SimResult, _block_hashes, instance_candidate, simulate
from pagedkv.sim.store import DEFAULT_TIER_SPEEDS, SimStoreConnector, SimTier, TierSpec
from pagedkv.sim.traces import TraceRequest, prompt_token_ids
from pagedkv.store.transfer_config import DEFAULT_BUFFER_BYTES
from pagedkv.utils import cdiv

TRANSFER_TIER = "transfer"
STAGING_TIER = "staging"  # a producer's host staging tier (PagedKVPushConnector)
# The transfer tier's read speed: the link's time is paid before the request arrives.
_INSTANT = TierSpec(TRANSFER_TIER, None, bandwidth=1e30)


@dataclass(frozen=True)
class Split:
    """P prefill and D decode instances joined by links of `link_gbps` gigabits/s (inf: the
    transfer takes no time); each producer stages its blocks in `buffer_bytes` of host memory
    (`kv_buffer_size`)."""

    prefill_instances: int
    decode_instances: int
    link_gbps: float
    buffer_bytes: int = DEFAULT_BUFFER_BYTES

    def __post_init__(self) -> None:
        for name in ("prefill_instances", "decode_instances"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.link_gbps > 0:
            raise ValueError(f"link_gbps must be > 0 (inf for an instant link), "
                             f"got {self.link_gbps!r}")
        if isinstance(self.buffer_bytes, bool) or not isinstance(self.buffer_bytes, int) \
                or self.buffer_bytes < 1:
            raise ValueError(f"buffer_bytes must be an integer >= 1, got {self.buffer_bytes!r}")


def transfer_bytes(prompt_tokens: int, block_size: int, block_bytes: int) -> int:
    """The bytes of a prompt's KV: its blocks (the last one partial) of `block_bytes` each."""
    return cdiv(prompt_tokens, block_size) * block_bytes


def transfer_seconds(num_bytes: int, link_gbps: float) -> float:
    """Seconds for `num_bytes` over a link of `link_gbps` gigabits per second."""
    return 0.0 if math.isinf(link_gbps) else num_bytes * 8 / (link_gbps * 1e9)


class TransferConnector(SimStoreConnector):
    """A decode instance's store seam with the transferred KV as its first tier: blocks put
    there (`receive`) are loaded at once by the request that needs them; any store tiers of
    the config follow it, written through as usual. Every block a step fills counts as saved
    (the consumer's connector copies it out), but the transfer tier is never written."""

    def __init__(self, config: SimConfig, kv: Any, clock: Any,
                 shared: dict[str, SimTier]) -> None:
        transfer = dataclasses.replace(_INSTANT, capacity_blocks=4 * config.num_blocks)
        super().__init__((transfer, *config.store_tiers), kv, config.block_bytes or 1, clock,
                         shared)
        self.transfer = self.tiers[0]

    def receive(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self.transfer.put(h)

    def _put(self, block_hash: bytes) -> None:
        for tier in self.tiers[1:]:
            tier.put(block_hash)


def _decode_instance(config: SimConfig, latency: LatencyModel, index: int, wake: float,
                     shared: dict[str, SimTier], record_steps: bool) -> SimInstance:
    inst = SimInstance(dataclasses.replace(config, store_tiers=()), latency, index=index,
                       record_steps=record_steps, wake=wake)
    inst.store = TransferConnector(config, inst.kv, lambda: inst.clock, shared)
    inst.scheduler.kv_connector = inst.store
    return inst


def producer_config(config: SimConfig, split: Split) -> SimConfig:
    """A prefill instance's config: its host staging tier first, then the config's tiers."""
    bandwidth, latency = DEFAULT_TIER_SPEEDS["host"]
    staging = TierSpec(STAGING_TIER, max(1, split.buffer_bytes // config.block_bytes),
                       bandwidth=bandwidth, latency=latency)
    return dataclasses.replace(config, store_tiers=(staging, *config.store_tiers))


def simulate_split(trace: Sequence[TraceRequest], config: SimConfig, latency: LatencyModel,
                   split: Split, *, policy: str = "kv-aware", record_steps: bool = False,
                   frontend: FrontendDelays | None = None,
                   decode_latency: LatencyModel | None = None) -> SimResult:
    """Replay `trace` through `split` (see the module docstring). The result's instances are
    the prefill ones (indices 0..P-1) then the decode ones; its records are the client's
    view (first token and the rest from the decode instance, `first_scheduled` from the
    prefill one); `extra["split"]` holds the transfers' figures. `decode_latency`: the decode
    instances' step cost (default `latency`). ValueError without prefix caching or with a
    sliding window (the transferred blocks are found by their hashes) or without
    `config.block_bytes` (the transfer's size)."""
    if not config.enable_prefix_caching or config.sliding_window is not None:
        raise ValueError("the prefill/decode split needs prefix caching and no sliding window "
                         "(the decode instance finds the transferred blocks by their hashes)")
    if not config.block_bytes > 0:
        raise ValueError("the prefill/decode split needs the KV block's bytes "
                         f"(config.block_bytes), got {config.block_bytes!r}")
    started = time.perf_counter()
    delays = frontend if frontend is not None else frontend_of(latency)
    before = FrontendDelays(admit=delays.admit, wake=delays.wake)  # the prefill hop's
    spans: list[list[tuple[float, float]]] = []

    def watch(inst: SimInstance) -> None:
        inst.step_spans = []
        spans.append(inst.step_spans)

    prefill = simulate([dataclasses.replace(t, output_length=1) for t in trace],
                       producer_config(config, split), latency,
                       num_instances=split.prefill_instances, policy=policy,
                       record_steps=record_steps, frontend=before, on_instance=watch)
    records = [RequestRecord(index=i, arrival=t.arrival, prompt_tokens=t.input_length,
                             output_tokens=t.output_length) for i, t in enumerate(trace)]
    ready, transfers = _transfers(prefill.records, records, config, split, spans)
    shared: dict[str, SimTier] = {}
    decode = [_decode_instance(config, decode_latency or latency,
                               split.prefill_instances + j, delays.wake, shared, record_steps)
              for j in range(split.decode_instances)]
    policy_d = DecodeRoomPolicy()
    admitting: list[list[tuple[RequestRecord, TraceRequest]]] = [[] for _ in decode]
    for at, index in ready:
        for inst, waiting in zip(decode, admitting, strict=True):
            if at + delays.admit > inst.clock:
                _admit(inst, waiting)
            inst.run_until(at + delays.admit)
        j = _place_decode(policy_d, decode, trace[index], config)
        inst = decode[j]
        inst.store.receive(_block_hashes(inst, prompt_token_ids(trace[index],
                                                                config.vocab_size, index)))
        admitting[j].append((records[index], trace[index]))
    for inst, waiting in zip(decode, admitting, strict=True):
        _admit(inst, waiting)
        inst.run_until(math.inf)
    observed(records, dataclasses.replace(delays, admit=0.0, wake=0.0))
    result = SimResult(config=config, latency_name=prefill.latency_name,
                       instances=prefill.instances + decode, records=records, policy=policy,
                       wall_time=time.perf_counter() - started)
    result.extra["split"] = {"prefill_instances": split.prefill_instances,
                             "decode_instances": split.decode_instances,
                             "kv_link_gbps": split.link_gbps, **transfers}
    return result


def _admit(inst: SimInstance, waiting: list[tuple[RequestRecord, TraceRequest]]) -> None:
    """Submit the requests whose KV `inst`'s server found held: the check ran at the end of
    the step in progress when each arrived (the instance's clock: `run_until` stepped past the
    arrival and the instance has not moved since), and the requests it then submits join
    before the step after the next one when the loop went straight on (busy), at once on an
    idle engine. Requests that arrived during the same step are submitted together. Empties
    `waiting`."""
    if not waiting:
        return
    if inst.busy:
        inst.step(inst.clock)
    for record, treq in waiting:
        inst.add(record, treq)
    waiting.clear()


def command_time(spans: Sequence[tuple[float, float]], sent: float) -> float:
    """When an engine loop whose steps ran over `spans` (sorted (start, end)) runs a command
    sent at `sent`: at the end of the step in progress then (one that starts at `sent`
    counts: the loop went straight on), else at once."""
    i = bisect.bisect_right(spans, (sent, math.inf)) - 1
    return spans[i][1] if i >= 0 and spans[i][1] > sent else sent


def _transfers(prefilled: list[RequestRecord], records: list[RequestRecord],
               config: SimConfig, split: Split, spans: list[list[tuple[float, float]]]
               ) -> tuple[list[tuple[float, int]], dict]:
    """When each prefilled request's answer leaves its producer, its KV pushed (sorted; the
    module docstring's step 2), and the transfers' totals. Requests whose prefill did not end
    with a token keep its outcome (rejected, error) in `records`. Mutates `records`."""
    link_free = [0.0] * split.prefill_instances
    done = sorted((p.first_token, p.index) for p in prefilled if p.first_token is not None)
    for p in prefilled:
        if p.first_token is None:
            r = records[p.index]
            r.status, r.error, r.instance = p.status, p.error, p.instance
    ready = []
    seconds = []
    handoffs = []
    total_bytes = 0
    for prefilled_at, index in done:
        p = prefilled[index]
        steps = spans[p.instance]
        records[index].first_scheduled = p.first_scheduled
        num_bytes = transfer_bytes(p.prompt_tokens, config.block_size, config.block_bytes)
        begun = command_time(steps, prefilled_at)
        start = max(begun, link_free[p.instance])
        pushed = link_free[p.instance] = start + transfer_seconds(num_bytes, split.link_gbps)
        first_poll = command_time(steps, begun)
        answer = first_poll if first_poll >= pushed else command_time(steps, pushed)
        ready.append((answer, index))
        seconds.append(pushed - begun)
        handoffs.append(answer - prefilled_at)
        total_bytes += num_bytes
    ready.sort()
    mean = sum(seconds) / len(seconds) if seconds else 0.0
    return ready, {"transfers": len(seconds), "transfer_bytes": total_bytes,
                   "transfer_seconds_mean": mean,
                   "transfer_seconds_max": max(seconds, default=0.0),
                   "handoff_seconds_mean": sum(handoffs) / len(handoffs) if handoffs else 0.0,
                   "handoff_seconds_max": max(handoffs, default=0.0)}


def _place_decode(policy: DecodeRoomPolicy, instances: list[SimInstance],
                  treq: TraceRequest, config: SimConfig) -> int:
    candidates = [instance_candidate(inst, config) for inst in instances]
    return policy.choose(RouteRequest(prompt_tokens=treq.input_length, session=treq.session),
                         candidates)


def split_search(trace: Sequence[TraceRequest], config: SimConfig, latency: LatencyModel,
                 slo: Any, *, link_gbps: float, target: float = 0.99, max_instances: int = 16,
                 policy: str = "kv-aware", log: Callable[[str], None] | None = None,
                 decode_latency: LatencyModel | None = None) -> dict[str, Any]:
    """The smallest split fleet meeting `slo` for `target` of the requests: for N = 2, 3, ...
    up to `max_instances` in all, every P + D = N is run, and the first N where one meets it
    answers (the one with the most requests meeting it, then the lowest TTFT p99). Returns
    {"value": (P, D) or None, "summary", "tried": {"P:D": summary}}. `slo` is a
    `pagedkv.sim.results.SLO`."""
    from pagedkv.sim.results import summarize
    from pagedkv.sim.search import meets

    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    if max_instances < 2:
        raise ValueError(f"max_instances must be >= 2 (a prefill and a decode instance), "
                         f"got {max_instances!r}")
    tried: dict[str, dict[str, Any]] = {}
    for total in range(2, max_instances + 1):
        met = []
        for p in range(1, total):
            result = simulate_split(trace, config, latency, Split(p, total - p, link_gbps),
                                    policy=policy, decode_latency=decode_latency)
            summary = tried[f"{p}:{total - p}"] = summarize(result, slo)
            summary["split"] = result.extra["split"]
            if log is not None:
                log(f"  {p} prefill + {total - p} decode: "
                    f"{summary['goodput']['fraction']:.1%} meet the SLO")
            if meets(summary, target):
                met.append(((-summary["goodput"]["fraction"],
                             summary["latency"]["ttft"]["p99"]), (p, total - p)))
        if met:
            best = min(met)[1]
            return {"value": best, "summary": tried[f"{best[0]}:{best[1]}"], "tried": tried}
    last = f"1:{max_instances - 1}"
    return {"value": None, "summary": tried[last], "tried": tried}
