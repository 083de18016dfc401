"""KVTransferConfig: vLLM's `kv_transfer_config` (prefill/decode disaggregation).

A producer (`kv_role: kv_producer`) runs a request's prefill and hands its full prompt blocks to
a consumer (`kv_consumer`), which loads them instead of prefilling; `kv_both` is either. Two
connectors move the blocks:
- `PagedKVStoreConnector`: through the KV store's shared tier (`kv_offloading_disk_path` on a
  shared disk, or `kv_offloading_remote_url`): the producer writes its blocks through before it
  answers, the consumer finds them by chained hash like any store hit;
- `PagedKVPushConnector`: pushed over ZMQ. A consumer listens on `kv_ip:kv_port` and holds the
  blocks it receives (at most `kv_buffer_size` bytes, each for `hold_s` seconds) until their
  decode request arrives; a producer keeps its computed blocks in a host staging tier of
  `kv_buffer_size` bytes and pushes a request's blocks to the consumer its request names
  (`remote_host`/`remote_port`), else to every address in `kv_connector_extra_config.consumers`.
  With tensor parallelism every rank does this for its own KV heads: rank r of a consumer
  listens on `kv_port + r`, and rank r of a producer pushes to the named port + r (all ranks of
  a push engine on one machine).

Keys of `kv_connector_extra_config`: `consumers` (["host:port", ...]), `transfer_timeout_s`
(the most a producer's handoff takes, its saves and its push together, so its answer comes
within this and a small margin of the prefill's end; and the most a consumer waits for pushed
blocks to arrive; what did not make it is recomputed), `hold_s`, `layer_groups` (how many
chunks a block's bytes are pushed in, in layer order).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pagedkv.config.json_option import json_object

ROLES = ("kv_producer", "kv_consumer", "kv_both")
STORE_CONNECTOR = "PagedKVStoreConnector"
PUSH_CONNECTOR = "PagedKVPushConnector"
CONNECTORS = (STORE_CONNECTOR, PUSH_CONNECTOR)
DEFAULT_KV_PORT = 14579  # vLLM's default kv_port
DEFAULT_BUFFER_BYTES = 256 * 2**20
EXTRA_DEFAULTS: dict[str, Any] = {"consumers": [], "transfer_timeout_s": 5.0, "hold_s": 60.0,
                                  "layer_groups": 4}


@dataclass(frozen=True)
class KVTransferConfig:
    """A validated `kv_transfer_config` (module docstring); build it with
    `parse_kv_transfer_config`."""

    kv_role: str
    kv_connector: str
    kv_ip: str = "127.0.0.1"
    kv_port: int = DEFAULT_KV_PORT
    kv_buffer_size: int = DEFAULT_BUFFER_BYTES
    engine_id: str | None = None
    kv_connector_extra_config: dict = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def is_push(self) -> bool:
        return self.kv_connector == PUSH_CONNECTOR

    def extra(self, name: str) -> Any:
        """A `kv_connector_extra_config` value, or its default."""
        return self.kv_connector_extra_config.get(name, EXTRA_DEFAULTS[name])

    @property
    def consumers(self) -> tuple[tuple[str, int], ...]:
        return tuple(split_address(a) for a in self.extra("consumers"))

    @property
    def transfer_timeout_s(self) -> float:
        return float(self.extra("transfer_timeout_s"))


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port"; ValueError naming a bad one."""
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"kv_transfer_config: consumer address must be 'host:port', "
                         f"got {address!r}")
    return host, int(port)


def _check_type(name: str, value: Any, kind: type | tuple[type, ...]) -> None:
    """ValueError naming `name` unless `value` is a `kind` (never a bool)."""
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"kv_transfer_config.{name} has the wrong type: {value!r}")


def _check_extra(extra: dict) -> None:
    unknown = sorted(set(extra) - set(EXTRA_DEFAULTS))
    if unknown:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config has unknown keys "
                         f"{unknown}; known: {sorted(EXTRA_DEFAULTS)}")
    if not isinstance(extra.get("consumers", []), list):
        raise ValueError(f"kv_transfer_config: consumers must be a list of 'host:port', got "
                         f"{extra['consumers']!r}")
    for address in extra.get("consumers", []):
        split_address(address)
    for name in ("transfer_timeout_s", "hold_s"):
        value = extra.get(name, EXTRA_DEFAULTS[name])
        _check_type(name, value, (int, float))
        if value <= 0:
            raise ValueError(f"kv_transfer_config.{name} must be > 0, got {value!r}")
    groups = extra.get("layer_groups", EXTRA_DEFAULTS["layer_groups"])
    _check_type("layer_groups", groups, int)
    if groups < 1:
        raise ValueError(f"kv_transfer_config.layer_groups must be >= 1, got {groups!r}")


def parse_kv_transfer_config(value: str | dict | KVTransferConfig | None
                             ) -> KVTransferConfig | None:
    """The config from a JSON string, a dict or a config (None: no disaggregation). ValueError
    naming the bad key or value."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    value = json_object("kv_transfer_config", value)
    known = {f.name for f in fields(KVTransferConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"kv_transfer_config has unknown keys {unknown}; known: {sorted(known)}")
    for name in ("kv_role", "kv_connector"):
        if name not in value:
            raise ValueError(f"kv_transfer_config needs {name!r}")
    if value["kv_role"] not in ROLES:
        raise ValueError(f"kv_transfer_config.kv_role must be one of {ROLES}, got "
                         f"{value['kv_role']!r}")
    if value["kv_connector"] not in CONNECTORS:
        raise ValueError(f"kv_transfer_config.kv_connector must be one of {CONNECTORS}, got "
                         f"{value['kv_connector']!r}")
    config = KVTransferConfig(**value)
    _check_type("kv_ip", config.kv_ip, str)
    _check_type("kv_port", config.kv_port, int)
    if not 0 < config.kv_port < 65536:
        raise ValueError(f"kv_transfer_config.kv_port must be a TCP port, got {config.kv_port!r}")
    _check_type("kv_buffer_size", config.kv_buffer_size, (int, float))
    if config.kv_buffer_size <= 0:
        raise ValueError(f"kv_transfer_config.kv_buffer_size must be > 0 bytes, got "
                         f"{config.kv_buffer_size!r}")
    if config.engine_id is not None:
        _check_type("engine_id", config.engine_id, str)
    _check_type("kv_connector_extra_config", config.kv_connector_extra_config, dict)
    _check_extra(config.kv_connector_extra_config)
    return config
