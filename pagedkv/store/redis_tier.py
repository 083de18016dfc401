"""RedisTier: KV blocks in a Redis server (`kv_offloading_remote_url`), shared by instances.

Each block is one Redis string under `pagedkv:kv:` + key, whose value is
`codec.encode_block(key, payload)`: header and bytes go in one SET, which Redis applies
atomically, so a reader sees the whole block or nothing (and verifies the checksum anyway).
Lookups and reads of a request's blocks are one round trip each (a pipeline of EXISTS, one
MGET). The server bounds the tier: run it with `maxmemory` and `maxmemory-policy allkeys-lru`
(a GET refreshes a key's LRU clock: promotion on read). Every call has a short socket timeout,
and a circuit breaker stops calling a server that failed `failure_threshold` times in a row for
`cooldown_s`: a down or slow Redis costs hits, never a request.

Credentials are checked once at start (one PING): a server that refuses them (a wrong or
missing password, `NOAUTH` / `WRONGPASS`) gets one clear warning and the tier is marked down
(`down_reason`): every later call is a miss without a network round trip or another warning,
until the engine restarts with the right URL. The same happens if the server starts refusing
them mid-run. A server that is merely unreachable at start is left to the circuit breaker (it
may come up later).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import redis

from pagedkv.events.wire import MEDIUM_REDIS
from pagedkv.store.codec import CorruptBlockError, decode_block, encode_block
from pagedkv.store.payload import Payload, payload_buffer
from pagedkv.store.tier import KVTier
from pagedkv.store.warn_limit import RateLimitedWarning

logger = logging.getLogger(__name__)

KEY_PREFIX = b"pagedkv:kv:"


class CircuitBreaker:
    """Closed until `failure_threshold` consecutive failures; then open for `cooldown_s`,
    after which one call is let through (half open) and its outcome decides."""

    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 5.0,
                 clock=time.monotonic) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._failures = 0
        self._open_until = 0.0
        self._lock = threading.Lock()
        self.num_opened = 0  # times the breaker opened

    def allow(self) -> bool:
        with self._lock:
            return self._failures < self.failure_threshold or self._clock() >= self._open_until

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._failures >= self.failure_threshold:
                self._open_until = self._clock() + self.cooldown_s
                self.num_opened += 1

    @property
    def is_open(self) -> bool:
        return not self.allow()


class RedisTier(KVTier):
    """Blocks in Redis at `url`; calls time out after `timeout_s`."""

    name = "redis"
    medium = MEDIUM_REDIS

    def __init__(self, url: str, timeout_s: float = 0.5, failure_threshold: int = 3,
                 cooldown_s: float = 5.0) -> None:
        super().__init__()
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                               socket_connect_timeout=timeout_s)
        except ValueError as e:
            raise ValueError(f"kv_offloading_remote_url {url!r} is not a Redis URL: {e}") from None
        self.url = url
        self.breaker = CircuitBreaker(failure_threshold, cooldown_s)
        self.num_errors = 0
        self.num_corrupt = 0
        self._corrupt_warning = RateLimitedWarning(logger, "corrupt block(s) dropped")
        self.down_reason: str | None = None  # set when the server refused our credentials
        self._call("PING", self.client.ping)

    @property
    def is_down(self) -> bool:
        """True once the server refused this tier's credentials (see the module docstring)."""
        return self.down_reason is not None

    def _where(self) -> str:
        kwargs = self.client.connection_pool.connection_kwargs
        if "path" in kwargs:
            return f"unix:{kwargs['path']}"
        return f"{kwargs.get('host')}:{kwargs.get('port')}/{kwargs.get('db', 0)}"

    def _mark_down(self, error: redis.RedisError) -> None:
        self.down_reason = (f"the Redis server at {self._where()} refused the password of "
                            "kv_offloading_remote_url (wrong, or missing where the server "
                            f"requires one: {error})")
        logger.warning("redis tier: %s. The Redis tier is down: prefixes are not shared "
                       "through Redis until the engine restarts with the right URL.",
                       self.down_reason)

    def _call(self, what: str, fn):
        """fn() through the breaker; None when the tier is down, the breaker is open or the
        call failed."""
        if self.down_reason is not None or not self.breaker.allow():
            return None
        try:
            result = fn()
        except redis.AuthenticationError as e:  # before ConnectionError: it is a subclass
            self.num_errors += 1
            self._mark_down(e)
            return None
        except redis.ResponseError as e:
            self.num_errors += 1
            if str(e).startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
                self._mark_down(e)
            else:
                self.breaker.record_failure()
                logger.warning("redis tier: %s failed (%s)", what, e)
            return None
        except redis.RedisError as e:  # ConnectionError and TimeoutError included
            self.num_errors += 1
            self.breaker.record_failure()
            logger.warning("redis tier: %s failed (%s)", what, e)
            return None
        self.breaker.record_success()
        return result

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def exists():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(KEY_PREFIX + key)
            return pipe.execute()

        found = self._call("EXISTS", exists)
        return [False] * len(keys) if found is None else [bool(n) for n in found]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        values = self._call("MGET", lambda: self.client.mget([KEY_PREFIX + k for k in keys]))
        if values is None:
            return [None] * len(keys)
        out: list[bytes | None] = []
        for key, value in zip(keys, values, strict=True):
            if value is None:
                out.append(None)
                continue
            try:
                out.append(decode_block(key, value))
            except CorruptBlockError as e:
                self._corrupt_warning.note("redis tier: dropping a corrupt block (%s)", e)
                self.num_corrupt += 1
                self._call("DEL", lambda k=key: self.client.delete(KEY_PREFIX + k))
                out.append(None)
        return out

    def put_many(self, items: Sequence[tuple[bytes, Payload]]) -> list[bytes]:
        if not items:
            return []

        def set_all():
            pipe = self.client.pipeline(transaction=False)
            for key, payload in items:
                pipe.set(KEY_PREFIX + key, encode_block(key, payload_buffer(payload)), nx=True)
            return pipe.execute()

        done = self._call("SET", set_all)
        if done is None:
            return []
        return [key for (key, _), ok in zip(items, done, strict=True) if ok]

    @property
    def used_bytes(self) -> int:
        return 0

    @property
    def num_blocks(self) -> int:
        return 0

    def close(self) -> None:
        self.client.close()
