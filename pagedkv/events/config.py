"""KVEventsConfig: vLLM's `kv_events_config` (publish the KV cache's events to a router).

Given as a dict or a JSON string (`--kv-events-config '{"enable_kv_cache_events": true,
"endpoint": "tcp://*:5557", "topic": "kv"}'`), with vLLM's keys: `enable_kv_cache_events`,
`publisher` ("zmq", or "null" for none), `endpoint` (where the PUB socket binds; a port of `*`
binds a free one, see `ZmqEventPublisher.endpoint`), `topic` (first frame of each message).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
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
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_events_config is not valid JSON: {value!r} ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"kv_events_config must be a JSON object or dict, got {value!r}")
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
    if config.enabled and not config.endpoint:
        raise ValueError("kv_events_config.endpoint must be set to publish events")
    return config
