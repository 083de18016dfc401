"""The router's prefill/decode metrics (`pagedkv_router:pd_` prefix), in the router's registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class PDMetrics:
    """Prefill hops by backend and outcome, decode hops by backend and whether they carry a
    transfer, fallbacks by reason, and the prefill hop's latency."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.prefills = Counter(
            "pagedkv_router:pd_prefill_requests", "Prefill hops sent to a prefill instance, by "
            "outcome (ok: it answered kv_transfer_params; else the fallback's reason).",
            ["backend", "outcome"], registry=r)
        self.decodes = Counter(
            "pagedkv_router:pd_decode_requests", "Decode hops sent to a decode instance "
            "(retries included), by whether they carry the producer's kv_transfer_params.",
            ["backend", "transfer"], registry=r)
        self.fallbacks = Counter(
            "pagedkv_router:pd_fallbacks", "Requests sent to a decode instance as normal "
            "requests (no KV transfer), by reason.", ["reason"], registry=r)
        self.prefill_seconds = Histogram(
            "pagedkv_router:pd_prefill_seconds", "Seconds of the prefill hop (sent until its "
            "answer was read, or it failed).", ["backend"], buckets=PREFILL_BUCKETS,
            registry=r)
