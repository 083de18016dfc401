"""A live run to look at: an app served by uvicorn in a background thread on a free loopback
port, and client traffic (completions sharing a system prompt) to feed it. Used by `make demo`
(which prints the dashboard URL) and benchmarks/bench_dashboard.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx


@contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve `app` until the block exits; yields the base URL. Port 0: a free one."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])),
                              name="live-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the live server did not start")
            time.sleep(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def run_traffic(url: str, prompts: list[str | list[int]], *, concurrency: int,
                max_tokens: int, model: str | None = None) -> dict[str, float]:
    """Send every prompt as one completion, `concurrency` at a time; returns the wall time and
    the generated tokens (raises RuntimeError on a failed request)."""
    lock = threading.Lock()
    queue = list(reversed(prompts))
    totals = {"generated_tokens": 0.0}
    failures: list[str] = []

    def client() -> None:
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    if not queue or failures:
                        return
                    prompt = queue.pop()
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                        "ignore_eos": True, **({"model": model} if model else {})}
                r = http.post(url + "/v1/completions", json=body)
                if r.status_code != 200:
                    failures.append(r.text)
                    return
                with lock:
                    totals["generated_tokens"] += r.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError(f"a request failed: {failures[0][:500]}")
    totals["seconds"] = time.perf_counter() - start
    return totals


class DashboardClient:
    """A connected dashboard in its own process (as a browser is): reads /dashboard/events and
    parses every update (as the page does) until `close()`, which returns how many updates and
    ops it read."""

    def __init__(self, url: str) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-m", "pagedkv.server.dashboard.live", url],
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # "connected" once the snapshot arrived
        if not line.startswith("connected"):
            self.proc.kill()
            raise RuntimeError(f"the dashboard client did not connect: {line!r}")

    def close(self) -> tuple[int, int]:
        import signal

        self.proc.send_signal(signal.SIGINT)
        out, _ = self.proc.communicate(timeout=30)
        updates, ops = (int(x) for x in out.split()[-2:])
        return updates, ops


def _client_main(url: str) -> None:
    """The client process: print "connected", read until SIGINT, print "UPDATES OPS".

    SIGINT prints the counts and exits at once, wherever the reader is (a KeyboardInterrupt
    raised inside httpx's stream could leave it closing the connection, waiting on the server)."""
    import os
    import signal

    counts = [0, 0]  # updates, ops

    def finish(*_: object) -> None:
        print(*counts, flush=True)
        os._exit(0)

    signal.signal(signal.SIGINT, finish)
    with httpx.stream("GET", url + "/dashboard/events", timeout=None) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = json.loads(line[6:])
                if "ops" in data:
                    counts[0] += 1
                    counts[1] += len(data["ops"])
                else:
                    print("connected", flush=True)
    finish()


if __name__ == "__main__":
    import sys

    _client_main(sys.argv[1])
