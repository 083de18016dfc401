"""Fixtures of the multi-host tests: a NetnsCluster per module (skipped, with the reason, where
network namespaces cannot be made) and `pagedkv` processes started inside its hosts."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from pagedkv.testing.netns import Host, NetnsCluster, NetnsUnavailable

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0
PORT = 8000  # every host has its own addresses: one port number fits all

# The engine flags of every server here (small cache, no C++ kernel build to wait for). The
# engine core runs in its own process, as deployed (the rest of the suite runs it in-process
# for speed): these tests are about the layout across hosts.
ENGINE_FLAGS = ["--dtype", "float32", "--block-size", "4", "--max-model-len", "512",
                "--num-gpu-blocks-override", "256", "--seed", "0", "--cpu-kernels", "off",
                "--served-model-name", "tiny", "--log-level", "warning",
                "--engine-core", "process"]


def make_cluster(n_hosts: int) -> NetnsCluster:
    """A cluster of `n_hosts`, or a skip saying why none can be made here."""
    try:
        return NetnsCluster(n_hosts)
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")


def url(host: Host, port: int = PORT) -> str:
    return f"http://{host.addr}:{port}"


class HostProcess:
    """A command running inside a host, its output in a log file."""

    def __init__(self, cluster: NetnsCluster, host: Host, cmd: Sequence[str]) -> None:
        self.cluster, self.host = cluster, host
        self.log = Path(tempfile.mkstemp(prefix="pagedkv-net-", suffix=".log")[1])
        with open(self.log, "wb") as out:
            self.proc = cluster.popen(host, list(cmd), cwd=REPO_ROOT, stdout=out,
                                      stderr=out, env={"PYTHONUNBUFFERED": "1"})

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_healthy(self, base_url: str, timeout_s: float = STARTUP_TIMEOUT_S) -> float:
        """Seconds until `base_url`/health answered 200 (from inside the host itself)."""
        start = time.monotonic()

        def poll() -> bool:
            try:
                return httpx.get(base_url + "/health", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False

        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.host.ns} exited {self.proc.returncode}:\n"
                                   f"{self.output()}")
            if self.cluster.call(self.host, poll, timeout=10):
                return time.monotonic() - start
            time.sleep(0.3)
        raise RuntimeError(f"{base_url} not healthy after {timeout_s} s:\n{self.output()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.log.unlink(missing_ok=True)


def router_sees_up(router_url: str, backend_urls: Sequence[str]) -> bool:
    """Whether the router at `router_url` counts every one of `backend_urls` up (its
    `pagedkv_router:backend_up` gauge)."""
    try:
        text = httpx.get(router_url + "/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return False
    up = {line.split('backend="', 1)[1].split('"', 1)[0] for line in text.splitlines()
          if line.startswith("pagedkv_router:backend_up{") and line.endswith(" 1.0")}
    return set(backend_urls) <= up


def wait_routable(cluster: NetnsCluster, host: Host, router_url: str,
                  backend_urls: Sequence[str], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Wait (from `host`) until the router counts every backend up. The router answers /health
    once one backend is (in PD mode, one decode instance): a request sent before its next
    health round saw the others would be routed without them."""
    deadline = time.monotonic() + timeout_s
    while not cluster.call(host, router_sees_up, router_url, list(backend_urls), timeout=10):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{router_url} did not see {list(backend_urls)} up within "
                               f"{timeout_s} s")
        time.sleep(0.2)


def serve_cmd(model: Path, host: Host, *flags: str) -> list[str]:
    return [sys.executable, "-m", "pagedkv.cli", "serve", str(model), "--host", host.addr,
            "--port", str(PORT), *ENGINE_FLAGS, *flags]


def router_cmd(model: Path, host: Host, backends: Sequence[Host], *flags: str) -> list[str]:
    return [sys.executable, "-m", "pagedkv.cli", "router",
            *[f for b in backends for f in ("--backend", url(b))], "--model", str(model),
            "--host", host.addr, "--port", str(PORT), "--log-level", "warning", *flags]


@pytest.fixture
def processes() -> Iterator[list[HostProcess]]:
    """Processes a test starts; killed when it ends (their cluster kills them too)."""
    started: list[HostProcess] = []
    yield started
    for p in started:
        p.stop()


def read_json_line(stream) -> dict | None:
    """The next line of `stream` that is a JSON object (others print there too: Ray's
    raylet messages), or None at its end."""
    for line in stream:
        if line.startswith("{"):
            return json.loads(line)
    return None
