"""The trace simulator: pagedkv's real scheduler and KV manager on a virtual clock.

`traces` reads Mooncake / Azure / request-log traces, `latency` holds the step-time models,
`instance` is one simulated engine, `simulator` replays a trace over one or more instances
(with the router's policies), `disagg` replays it over a prefill/decode split (the KV sent
over a link), `results` summarizes a run, `search` sweeps a setting and finds
the smallest one that meets an SLO. No torch anywhere here (`pagedkv profile`, which times the
real runner, lives in `pagedkv.sim.profiling` and imports it lazily).
"""

from pagedkv.sim.config import SimConfig
from pagedkv.sim.instance import SimInstance
from pagedkv.sim.records import RequestRecord
from pagedkv.sim.simulator import SimResult, simulate
from pagedkv.sim.traces import TraceRequest, load_trace

__all__ = ["RequestRecord", "SimConfig", "SimInstance", "SimResult", "TraceRequest",
           "load_trace", "simulate"]
