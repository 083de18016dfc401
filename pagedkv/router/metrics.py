"""The router's own Prometheus metrics (`pagedkv_router:` prefix), in a per-router registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class RouterMetrics:
    """Counters and gauges labelled by backend URL. Nothing in the global registry."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, policy: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pagedkv_router:requests", "Requests answered, by backend and HTTP status "
            "(backend 'none' when no backend could take it).", ["backend", "status"], registry=r)
        self.routed = Counter(
            "pagedkv_router:routing_decisions", "Times the policy picked each backend "
            "(retries included).", ["backend", "policy"], registry=r)
        self.predicted_hit_blocks = Counter(
            "pagedkv_router:predicted_prefix_hit_blocks", "Prompt blocks the router predicted "
            "cached on the backend it picked (device hits).", ["backend"], registry=r)
        self.prompt_blocks = Counter(
            "pagedkv_router:prompt_blocks", "Full prompt blocks of routed requests.",
            ["backend"], registry=r)
        self.retries = Counter(
            "pagedkv_router:retries", "Requests tried again on another backend, by reason.",
            ["backend", "reason"], registry=r)
        self.stream_errors = Counter(
            "pagedkv_router:stream_errors", "Streams cut by their backend after the first byte "
            "(ended with an error event).", ["backend"], registry=r)
        self.ejections = Counter(
            "pagedkv_router:backend_ejections", "Times a backend was taken out of rotation "
            "for a while after failing a request (no first byte in time, a garbled answer).",
            ["backend"], registry=r)
        self.backend_up = Gauge(
            "pagedkv_router:backend_up", "1 when the backend is healthy, else 0.", ["backend"],
            registry=r)
        self.in_flight = Gauge(
            "pagedkv_router:in_flight_requests", "Requests the router has in flight to the "
            "backend.", ["backend"], registry=r)
        self.kv_events = Counter(
            "pagedkv_router:kv_events", "KV events applied to the prefix index.", ["backend"],
            registry=r)
        self.kv_event_gaps = Counter(
            "pagedkv_router:kv_event_gaps", "Gaps in a backend's KV-event sequence numbers.",
            ["backend"], registry=r)
        self.kv_events_dropped = Counter(
            "pagedkv_router:kv_events_dropped", "KV-event messages dropped unread for their "
            "size.", ["backend"], registry=r)
        self.kv_event_disconnects = Counter(
            "pagedkv_router:kv_event_disconnects", "Lost connections to a backend's KV-event "
            "publisher (it went away, or sent a message over the size limit).", ["backend"],
            registry=r)
        self.policy = policy

    def render(self) -> bytes:
        return generate_latest(self.registry)
