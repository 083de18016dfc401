"""Two `pagedkv serve` backends behind `pagedkv router --policy kv-aware`, on this machine.

    python examples/router_two_servers.py                  # the bundled SmolLM2 model
    python examples/router_two_servers.py --model random   # a tiny random-weight model

Each backend publishes its KV events; the router reads them and sends each prompt where its
prefix is cached. Two tenants' prompts, each with its own long system prompt, alternate: after
the first of each, a tenant's requests keep going to the backend that holds its prefix (the
`X-PagedKV-Backend` header) and report cached tokens. Everything is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

import httpx
from common import resolve_model

TENANTS = {
    "weather": "You are a weather assistant for sailors. Use knots, nautical miles and the "
               "Beaufort scale; never give advice about anything but weather. " * 3,
    "cooking": "You are a cooking assistant for a small bakery. Use grams and degrees Celsius; "
               "suggest only recipes that need an oven and flour. " * 3,
}
QUESTIONS = ["What should I expect today?", "Anything to watch for tonight?",
             "Give me one tip.", "What about tomorrow?"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagedkv.cli", *args])


def wait_healthy(url: str, procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise SystemExit("a process exited during start-up (see its log above)")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not healthy after {timeout_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="path, .gguf, HF id, or 'random'")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    args = parser.parse_args()
    model = resolve_model(args.model)

    backends, events, procs = [], [], []
    try:
        for _ in range(2):
            port, event_port = free_port(), free_port()
            backends.append(f"http://127.0.0.1:{port}")
            events.append(f"tcp://127.0.0.1:{event_port}")
            config = json.dumps({"enable_kv_cache_events": True,
                                 "endpoint": f"tcp://*:{event_port}"})
            procs.append(start(["serve", model, "--port", str(port), "--served-model-name",
                                "demo", "--kv-cache-memory-bytes", "256MiB",
                                "--kv-events-config", config, "--log-level", "warning"]))
        for url in backends:
            wait_healthy(url, procs, args.startup_timeout)
        router_port = free_port()
        router_args = ["router", "--port", str(router_port), "--policy", "kv-aware",
                       "--log-level", "warning"]
        for url, endpoint in zip(backends, events, strict=True):
            router_args += ["--backend", url, "--kv-events", endpoint]
        procs.append(start(router_args))
        router = f"http://127.0.0.1:{router_port}"
        wait_healthy(router, procs, 60.0)

        for question in QUESTIONS:
            for tenant, system in TENANTS.items():
                reply = httpx.post(f"{router}/v1/chat/completions", timeout=120.0, json={
                    "model": "demo", "max_tokens": 16, "temperature": 0,
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": question}]})
                reply.raise_for_status()
                usage = reply.json()["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                print(f"{tenant:8} -> {reply.headers['x-pagedkv-backend']}: "
                      f"{cached} of {usage['prompt_tokens']} prompt tokens cached")
                time.sleep(0.2)  # let the backend's KV events reach the router
    finally:  # the router first (it would warn of backends going away), then the backends
        stop(procs[len(backends):])
        stop(procs[:len(backends)])


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each (a graceful drain), then wait; kill what is still there after 30 s."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
