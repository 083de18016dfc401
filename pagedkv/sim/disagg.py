"""Prefill/decode disaggregation in the simulator (`pagedkv simulate --prefill-instances P
--decode-instances D --kv-link-gbps G`): does splitting beat the same number of mixed
instances for this trace and SLO (the DistServe question)?

A request goes through the split as the router's PD mode sends it (pagedkv/router/pd.py):

1. prefill: on one of P instances, placed by the routing policy (kv-aware by default: prefix
   hits against load), as a request with one output token (vLLM's PD proxy sends max_tokens
   1). Its prefill ends at that token;
2. transfer: the prompt's KV (its blocks, each `block_bytes` of the model's KV format) crosses
   the prefill instance's link at `link_gbps`; one instance's transfers go one after another
   (a NIC serializes them), so a burst of long prompts queues on the link;
3. decode: on one of D instances, placed by load and KV room (the router's decode-room policy,
   pagedkv/router/pd_decode.py), from the moment its KV has arrived. The transferred blocks
   are offered to the decode instance's scheduler as store blocks it loads at once (a
   per-instance "transfer" tier ahead of any store tier, `TransferConnector`): the request
   allocates them, waits for the load as the engine waits for a connector's load, and computes
   only the prompt's last token (what vLLM's consumer does), then decodes every output token.

TTFT is therefore prefill queue + prefill + link queue + transfer + decode admission and first
step. The prefill phase does not depend on the decode phase (a prefill instance frees a
request's blocks at its end), so it runs first over the whole trace, then the decode phase over
the arrivals the transfers give. The frontend's `admit` delay is paid on both hops; `output` and
`finish` on the decode's. Not modelled: the router's own hop, the producer holding the blocks
until the consumer has read them, transfers competing with store traffic.
"""

from __future__ import annotations

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
from pagedkv.sim.store import SimStoreConnector, SimTier, TierSpec
from pagedkv.sim.traces import TraceRequest, prompt_token_ids
from pagedkv.utils import cdiv

TRANSFER_TIER = "transfer"
# The transfer tier's read speed: the link's time is paid before the request arrives.
_INSTANT = TierSpec(TRANSFER_TIER, None, bandwidth=1e30)


@dataclass(frozen=True)
class Split:
    """P prefill and D decode instances joined by links of `link_gbps` gigabits/s (inf: the
    transfer takes no time)."""

    prefill_instances: int
    decode_instances: int
    link_gbps: float

    def __post_init__(self) -> None:
        for name in ("prefill_instances", "decode_instances"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.link_gbps > 0:
            raise ValueError(f"link_gbps must be > 0 (inf for an instant link), "
                             f"got {self.link_gbps!r}")


def transfer_bytes(prompt_tokens: int, block_size: int, block_bytes: int) -> int:
    """The bytes of a prompt's KV: its blocks (the last one partial) of `block_bytes` each."""
    return cdiv(prompt_tokens, block_size) * block_bytes


def transfer_seconds(num_bytes: int, link_gbps: float) -> float:
    """Seconds for `num_bytes` over a link of `link_gbps` gigabits per second."""
    return 0.0 if math.isinf(link_gbps) else num_bytes * 8 / (link_gbps * 1e9)


class TransferConnector(SimStoreConnector):
    """A decode instance's store seam with the transferred KV as its first tier: blocks put
    there (`receive`) are loaded at once by the request that needs them; any store tiers of
    the config follow it, written through as usual (the transfer tier is never written)."""

    def __init__(self, config: SimConfig, kv: Any, clock: Any,
                 shared: dict[str, SimTier]) -> None:
        transfer = dataclasses.replace(_INSTANT, capacity_blocks=4 * config.num_blocks)
        super().__init__((transfer, *config.store_tiers), kv, config.block_bytes or 1, clock,
                         shared)
        self.transfer = self.tiers[0]

    def receive(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self.transfer.put(h)

    def _save(self, out: Any, requests: dict) -> int:
        return super()._save(out, requests) if len(self.tiers) > 1 else 0

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


def simulate_split(trace: Sequence[TraceRequest], config: SimConfig, latency: LatencyModel,
                   split: Split, *, policy: str = "kv-aware", record_steps: bool = False,
                   frontend: FrontendDelays | None = None) -> SimResult:
    """Replay `trace` through `split` (see the module docstring). The result's instances are
    the prefill ones (indices 0..P-1) then the decode ones; its records are the client's
    view (first token and the rest from the decode instance, `first_scheduled` from the
    prefill one); `extra["split"]` holds the transfers' figures. ValueError without prefix
    caching or with a sliding window (the transferred blocks are found by their hashes) or
    without `config.block_bytes` (the transfer's size)."""
    if not config.enable_prefix_caching or config.sliding_window is not None:
        raise ValueError("the prefill/decode split needs prefix caching and no sliding window "
                         "(the decode instance finds the transferred blocks by their hashes)")
    if not config.block_bytes > 0:
        raise ValueError("the prefill/decode split needs the KV block's bytes "
                         f"(config.block_bytes), got {config.block_bytes!r}")
    started = time.perf_counter()
    delays = frontend if frontend is not None else frontend_of(latency)
    before = FrontendDelays(admit=delays.admit, wake=delays.wake)  # the prefill hop's
    prefill = simulate([dataclasses.replace(t, output_length=1) for t in trace], config,
                       latency, num_instances=split.prefill_instances, policy=policy,
                       record_steps=record_steps, frontend=before)
    records = [RequestRecord(index=i, arrival=t.arrival, prompt_tokens=t.input_length,
                             output_tokens=t.output_length) for i, t in enumerate(trace)]
    ready, transfers = _transfers(prefill.records, records, config, split)
    shared: dict[str, SimTier] = {}
    decode = [_decode_instance(config, latency, split.prefill_instances + j, delays.wake,
                               shared, record_steps) for j in range(split.decode_instances)]
    policy_d = DecodeRoomPolicy()
    for at, index in ready:
        for inst in decode:
            inst.run_until(at + delays.admit)
        inst = decode[_place_decode(policy_d, decode, trace[index], config)]
        inst.store.receive(_block_hashes(inst, prompt_token_ids(trace[index],
                                                                config.vocab_size, index)))
        inst.add(records[index], trace[index])
    for inst in decode:
        inst.run_until(math.inf)
    observed(records, dataclasses.replace(delays, admit=0.0, wake=0.0))
    result = SimResult(config=config, latency_name=prefill.latency_name,
                       instances=prefill.instances + decode, records=records, policy=policy,
                       wall_time=time.perf_counter() - started)
    result.extra["split"] = {"prefill_instances": split.prefill_instances,
                             "decode_instances": split.decode_instances,
                             "kv_link_gbps": split.link_gbps, **transfers}
    return result


def _transfers(prefilled: list[RequestRecord], records: list[RequestRecord],
               config: SimConfig, split: Split) -> tuple[list[tuple[float, int]], dict]:
    """When each prefilled request's KV is on the far side of its instance's link (sorted),
    and the transfers' totals. Requests whose prefill did not end with a token keep its
    outcome (rejected, error) in `records`. Mutates `records`."""
    link_free = [0.0] * split.prefill_instances
    done = sorted((p.first_token, p.index) for p in prefilled if p.first_token is not None)
    for p in prefilled:
        if p.first_token is None:
            r = records[p.index]
            r.status, r.error, r.instance = p.status, p.error, p.instance
    ready = []
    seconds = []
    total_bytes = 0
    for prefilled_at, index in done:
        p = prefilled[index]
        records[index].first_scheduled = p.first_scheduled
        num_bytes = transfer_bytes(p.prompt_tokens, config.block_size, config.block_bytes)
        start = max(prefilled_at, link_free[p.instance])
        link_free[p.instance] = start + transfer_seconds(num_bytes, split.link_gbps)
        ready.append((link_free[p.instance], index))
        seconds.append(link_free[p.instance] - prefilled_at)
        total_bytes += num_bytes
    ready.sort()
    mean = sum(seconds) / len(seconds) if seconds else 0.0
    return ready, {"transfers": len(seconds), "transfer_bytes": total_bytes,
                   "transfer_seconds_mean": mean,
                   "transfer_seconds_max": max(seconds, default=0.0)}


def _place_decode(policy: DecodeRoomPolicy, instances: list[SimInstance],
                  treq: TraceRequest, config: SimConfig) -> int:
    candidates = [instance_candidate(inst, config) for inst in instances]
    return policy.choose(RouteRequest(prompt_tokens=treq.input_length, session=treq.session),
                         candidates)


def split_search(trace: Sequence[TraceRequest], config: SimConfig, latency: LatencyModel,
                 slo: Any, *, link_gbps: float, target: float = 0.99, max_instances: int = 16,
                 policy: str = "kv-aware",
                 log: Callable[[str], None] | None = None) -> dict[str, Any]:
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
                                    policy=policy)
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
