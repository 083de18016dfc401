"""KVEventsConfig: vLLM's `kv_events_config` (publish the KV cache's events to a router).

Given as a dict or a JSON string (`--kv-events-config '{"enable_kv_cache_events": true,
"endpoint": "tcp://*:5557", "topic": "kv"}'`), with vLLM 0.32's keys: `enable_kv_cache_events`,
`publisher` ("zmq", or "null" for none), `endpoint` (the PUB socket's address: bound when it has
a wildcard `*` or `::`, or is ipc:// or inproc://; connected to otherwise, so an indexer that
binds `tcp://host:port` receives from many engines; a port of `*` binds a free one, see
`ZmqEventPublisher.endpoint`), `replay_endpoint` (a ROUTER socket, always bound, answering an
8-byte start sequence number with the buffered batches since; None: no replay), `buffer_steps`
(batches kept for replay), `hwm` (the PUB socket's send high-water mark), `max_queue_size`
(batches queued for the publisher thread; beyond it a batch is dropped, never blocking a
step), `topic` (first frame of each message).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pagedkv.config.json_option import json_object

PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        """Whether events are collected and published at all."""
        return self.enable_kv_cache_events and self.publisher != "null"


def parse_kv_events_config(value: str | dict | KVEventsConfig | None) -> KVEventsConfig:
    """The config from a JSON string, a dict or a config (None: disabled). ValueError when bad."""
    if value is None:
        return KVEventsConfig()
    if isinstance(value, KVEventsConfig):
        return value
    value = json_object("kv_events_config", value)
    if "publisher" in value and value["publisher"] is None:  # vLLM's default: zmq when enabled
        value = {k: v for k, v in value.items() if k != "publisher"}
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"kv_events_config has unknown keys {unknown}; known: {sorted(known)}")
    config = KVEventsConfig(**value)
    if not isinstance(config.enable_kv_cache_events, bool):
        raise ValueError("kv_events_config.enable_kv_cache_events must be a bool, got "
                         f"{config.enable_kv_cache_events!r}")
    if config.publisher not in PUBLISHERS:
        raise ValueError(f"kv_events_config.publisher must be one of {PUBLISHERS}, got "
                         f"{config.publisher!r}")
    for name in ("endpoint", "topic"):
        if not isinstance(getattr(config, name), str):
            raise ValueError(f"kv_events_config.{name} must be a string, got "
                             f"{getattr(config, name)!r}")
    if config.replay_endpoint is not None and not isinstance(config.replay_endpoint, str):
        raise ValueError("kv_events_config.replay_endpoint must be a string or null, got "
                         f"{config.replay_endpoint!r}")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < (name == "max_queue_size"):
            raise ValueError(f"kv_events_config.{name} must be a non-negative integer"
                             f"{' (at least 1)' if name == 'max_queue_size' else ''}, got {value!r}")
    if config.enabled and not config.endpoint:
        raise ValueError("kv_events_config.endpoint must be set to publish events")
    return config
