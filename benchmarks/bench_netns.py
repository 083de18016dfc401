"""Multi-host figures over a namespace network (hosts as Linux network namespaces on a bridge,
pagedkv.testing.netns; needs root and iproute2):

    PYTHONPATH=. python benchmarks/bench_netns.py [--rounds 100] [--timeout-s 5]

1. The router's added latency across hosts vs on loopback: one `pagedkv serve` (a tiny random
   model, max_tokens 1) on host 1, a router on host 0 (in front of it over the bridge) and one
   on host 1's loopback. Each round sends one request straight to the server and one through
   the router, from host 2 (across the network) and from host 1 itself (loopback), in turn;
   printed: median latency of each and the router's added median (paired: through - direct).
2. A two-host tensor-parallel engine (rank 0 on one host, rank 1 on another, gloo over the
   veth): seconds to come up (engine built and a first request answered) and, once the
   worker's host link is cut, seconds until the engine fails (`--timeout-s`, the
   distributed timeout).

Timings come from a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pagedkv.testing import build_random_model_dir  # noqa: E402
from pagedkv.testing.netns import NetnsCluster  # noqa: E402
from tests.net.conftest import HostProcess, router_cmd, serve_cmd, url  # noqa: E402

LOOPBACK_ROUTER = "http://127.0.0.1:8001"


def timed_requests(targets: list[str], rounds: int) -> dict[str, list[float]]:
    """Seconds of each request to each target, `rounds` rounds, the targets in turn."""
    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 1,
            "temperature": 0}
    times: dict[str, list[float]] = {t: [] for t in targets}
    with httpx.Client(timeout=30) as client:
        for target in targets:  # warm: connections, first-request paths
            client.post(target + "/v1/completions", json=body).raise_for_status()
        for i in range(rounds):
            for target in targets[i % 2:] + targets[:i % 2]:
                start = time.perf_counter()
                client.post(target + "/v1/completions", json=body).raise_for_status()
                times[target].append(time.perf_counter() - start)
    return times


def added_ms(times: dict[str, list[float]], direct: str, routed: str) -> tuple[float, ...]:
    """Medians (ms) of direct, routed, and routed - direct per round."""
    pairs = [r - d for d, r in zip(times[direct], times[routed], strict=True)]
    return (1e3 * statistics.median(times[direct]), 1e3 * statistics.median(times[routed]),
            1e3 * statistics.median(pairs))


def router_latency(model: Path, rounds: int) -> None:
    with NetnsCluster(3) as cluster:
        router, server, client = cluster.hosts
        procs = [HostProcess(cluster, server, serve_cmd(model, server)),
                 HostProcess(cluster, router, router_cmd(model, router, [server]))]
        lo = router_cmd(model, server, [server])
        lo[lo.index("--host") + 1: lo.index("--host") + 4] = ["127.0.0.1", "--port", "8001"]
        procs.append(HostProcess(cluster, server, lo))
        try:
            procs[0].wait_healthy(url(server))
            procs[1].wait_healthy(url(router))
            procs[2].wait_healthy(LOOPBACK_ROUTER)
            net = cluster.call(client, timed_requests, [url(server), url(router)], rounds,
                               timeout=600)
            loop = cluster.call(server, timed_requests, [url(server), LOOPBACK_ROUTER],
                                rounds, timeout=600)
        finally:
            for p in procs:
                p.stop()
    for name, times, routed in (("namespace network", net, url(router)),
                                ("loopback", loop, LOOPBACK_ROUTER)):
        direct, through, added = added_ms(times, url(server), routed)
        print(f"{name:18s} direct {direct:6.2f} ms  through the router {through:6.2f} ms  "
              f"added {added:6.2f} ms (median of {rounds} paired rounds)")


def tp_up_and_fail(model: Path, timeout_s: float) -> None:
    with NetnsCluster(2) as cluster:
        node0, node1 = cluster.hosts
        flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", node0.addr,
                 "--master-port", "29511", "--cpu-kernels", "off", "--block-size", "4",
                 "--dtype", "float32", "--distributed-timeout-s", str(timeout_s)]
        cluster.popen(node1, [sys.executable, "-m", "pagedkv.cli", "serve", str(model),
                              "--node-rank", "1", *flags], cwd=REPO,
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        engine = cluster.popen(node0, [sys.executable, "-m", "tests.net.tp_engine", str(model),
                                       node0.addr, "29511", str(timeout_s),
                                       json.dumps(list(range(5, 40))), "8"],
                               cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
        up = json.loads(engine.stdout.readline())
        cluster.link_down(node1)
        engine.stdin.write("go\n")
        engine.stdin.flush()
        failed = json.loads(engine.stdout.readline())
        engine.wait(timeout=60)
    print(f"2-host TP engine: up (model loaded on both hosts, first request answered) in "
          f"{up['up_s']:.2f} s; worker host's link cut -> engine failed in "
          f"{failed['fail_s']:.2f} s (distributed timeout {timeout_s} s): {failed['error']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_random_model_dir(Path(tmp) / "model")
        router_latency(model, args.rounds)
        tp_up_and_fail(model, args.timeout_s)


if __name__ == "__main__":
    main()
