"""The namespace harness itself: hosts reach each other on their own addresses, nothing
listens in the machine's namespace; faults (partition, link down, added delay) take effect and
undo; nothing is left behind, and a killed run's namespaces are swept."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest

from pagedkv.testing import netns
from tests.net.conftest import make_cluster

pytestmark = pytest.mark.timeout(60)


def connect(addr: str, port: int) -> str:
    try:
        with socket.create_connection((addr, port), timeout=1.0) as s:
            return s.recv(16).decode()
    except OSError as exc:
        return type(exc).__name__


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_hosts_talk_over_the_bridge_and_faults_apply():
    cluster = make_cluster(2)
    with cluster:
        a, b = cluster.hosts
        cluster.popen(b, ["python3", "-c", f"""
import socket
s = socket.create_server(("{b.addr}", 7000))
while True:
    c, _ = s.accept(); c.sendall(b"hi"); c.close()
"""])
        assert cluster.call(a, _wait_connect, b.addr, 7000) == "hi"
        assert cluster.listeners(b) == [f"{b.addr}:7000"]
        root = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout
        assert not [a for a in netns.listening_addresses(root) if a.startswith(netns.SUBNET)]
        cluster.partition(a, b)
        assert cluster.call(a, connect, b.addr, 7000) == "TimeoutError"
        cluster.heal(a, b)
        cluster.link_down(b)
        assert cluster.call(a, connect, b.addr, 7000) == "TimeoutError"
        cluster.link_up(b)
        assert cluster.call(a, _wait_connect, b.addr, 7000) == "hi"
        cluster.netem(a, delay_ms=50)
        assert min(cluster.call(a, connect_ms, b.addr, 7000) for _ in range(3)) >= 45
        cluster.clear_netem(a)
        made = {h.ns for h in cluster.hosts} | {cluster.switch}
        assert made <= namespaces()
    assert not made & namespaces()


def connect_ms(addr: str, port: int) -> float:
    start = time.perf_counter()
    assert connect(addr, port) == "hi"
    return 1e3 * (time.perf_counter() - start)


def _wait_connect(addr: str, port: int) -> str:
    for _ in range(50):
        got = connect(addr, port)
        if got == "hi":
            return got
        time.sleep(0.1)
    return got


def test_the_janitor_removes_a_dead_runs_namespaces():
    if netns.unavailable_reason() is not None:
        pytest.skip(netns.unavailable_reason())
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid no process has now
    name = f"{netns.PREFIX}{dead.pid}-000000-h0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netns.janitor()
        assert name not in namespaces()
    finally:
        netns.remove_namespace(name)
