"""A router's own per-request latency: the same requests sent straight to an instant fake
backend and through each router, alternating, so the machine's other load hits every target
alike.

    PYTHONPATH=. python benchmarks/bench_router_overhead.py [--rounds 200] \\
        [--baseline DIR] [--vllm-router /tmp/vllm-router-venv/bin/vllm-router] \\
        [--profile OUT.prof] [--json]

Backends: two `fake_openai_backend.py` ports in one process (answers written at once, so a
request's time is the client, the network stack and the router). Targets: `direct` (the first
fake backend), `pagedkv kv-aware` and `pagedkv round-robin` (this checkout, `--model` a tiny
random model's tokenizer, block size from the fakes' /kv_cache_info), with `--baseline DIR`
also `pagedkv kv-aware @baseline` (another checkout of pagedkv, e.g. `git archive` of an
older commit: before/after in one run), and `vllm-router cache_aware` when its executable
exists. Each round sends one request to every target, in a rotating order: streamed
completions (the TTFT is the first data event) and every `--plain-every`-th round a
non-streaming one; prompts are `--prompt-tokens` token ids, rounds sharing eight prefixes.
Printed per target: TTFT and E2E mean / p50 / p99, the latency added over `direct`
(paired per round: target - direct) with its ratio to vllm-router's, and each router process's
CPU: per request (user + system CPU over the rounds, its health rounds included, over the
requests it served), at start-up (imports, its first health rounds) and per second idle (its
health rounds). `--profile` runs our kv-aware router under cProfile and writes its stats there.
Timings come from a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from router_vs_vllm_router import VllmRouterProcess, process_cpu_seconds  # noqa: E402

from pagedkv.bench.machine import cpu_name  # noqa: E402
from pagedkv.testing import build_random_model_dir  # noqa: E402
from tests.router.helpers import RouterProcess  # noqa: E402
from tests.server.helpers import free_port  # noqa: E402

PREFIXES = 8
DIRECT = "direct"
IDLE_S = 3.0  # seconds every router sits idle before the rounds (its health checks' CPU)


class CheckoutRouterProcess(RouterProcess):
    """`pagedkv router` imported from another checkout (`root`), or under cProfile."""

    def __init__(self, *args, root: Path | None = None, profile: str | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.root = root
        self.profile = profile

    def command(self) -> list[str]:
        cmd = super().command()
        if self.root is not None:
            boot = (f"import sys; sys.path.insert(0, {str(self.root)!r}); "
                    "from pagedkv.cli import main; sys.argv[0] = 'pagedkv'; sys.exit(main())")
            return [cmd[0], "-c", boot, *cmd[3:]]
        if self.profile is not None:
            return [cmd[0], "-m", "cProfile", "-o", self.profile, *cmd[1:]]
        return cmd


def start_fakes(ports: list[int]) -> subprocess.Popen:
    flags = [f for port in ports for f in ("--port", str(port))]
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "fake_openai_backend.py"),
                             *flags])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if all(httpx.get(f"http://127.0.0.1:{p}/health").status_code == 200 for p in ports):
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the fake backends did not start")


def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    shared = args.prompt_tokens * 3 // 4
    heads = [[rng.randrange(10, vocab) for _ in range(shared)] for _ in range(PREFIXES)]
    return [heads[i % PREFIXES] + [rng.randrange(10, vocab)
                                   for _ in range(args.prompt_tokens - shared)]
            for i in range(args.rounds)]


async def one_request(client: httpx.AsyncClient, prompt: list[int],
                      stream: bool) -> tuple[float, float]:
    """(TTFT, E2E) in seconds; a non-streaming request's TTFT is its E2E."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": 3, "stream": stream}
    start = time.perf_counter()
    ttft = 0.0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{client.base_url}: HTTP {resp.status_code}: "
                               f"{(await resp.aread())[:200]!r}")
        async for chunk in resp.aiter_bytes():
            if not ttft and (b"data:" in chunk or not stream):
                ttft = time.perf_counter() - start
    e2e = time.perf_counter() - start
    return ttft or e2e, e2e


async def run_rounds(urls: dict[str, str], work: list[list[int]], args: argparse.Namespace,
                     pids: dict[str, int]) -> dict[str, dict[str, list[float]]]:
    """Every target, every round, in rotating order; per target its TTFT / E2E lists, and for
    the targets in `pids` (name -> router process id) the CPU seconds it used over the rounds
    (`cpu_s`)."""
    names = list(urls)
    out = {n: {"ttft": [], "e2e": [], "plain_e2e": []} for n in names}
    clients = {n: httpx.AsyncClient(base_url=u, timeout=30) for n, u in urls.items()}
    try:
        for warm in range(3):  # connections, first-request paths
            for n in names:
                await one_request(clients[n], work[warm % len(work)], True)
        cpu_start = {n: process_cpu_seconds(pid) for n, pid in pids.items()}
        for i, prompt in enumerate(work):
            plain = args.plain_every > 0 and i % args.plain_every == args.plain_every - 1
            order = names[i % len(names):] + names[:i % len(names)]
            for n in order:
                ttft, e2e = await one_request(clients[n], prompt, not plain)
                if plain:
                    out[n]["plain_e2e"].append(e2e)
                else:
                    out[n]["ttft"].append(ttft)
                    out[n]["e2e"].append(e2e)
        for n, pid in pids.items():
            out[n]["cpu_s"] = [process_cpu_seconds(pid) - cpu_start[n]]
    finally:
        for client in clients.values():
            await client.aclose()
    return out


def stats(values: list[float]) -> dict[str, float]:
    xs = sorted(values)
    if not xs:
        return {"mean_ms": 0.0, "p50_ms": 0.0, "p99_ms": 0.0}

    def pct(q: float) -> float:
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] * 1e3

    return {"mean_ms": sum(xs) / len(xs) * 1e3, "p50_ms": pct(0.5), "p99_ms": pct(0.99)}


def summarize(raw: dict[str, dict[str, list[float]]], work: list) -> dict[str, dict]:
    base = raw[DIRECT]
    rows = {}
    for name, r in raw.items():
        added = {key: [a - b for a, b in zip(r[key], base[key], strict=True)]
                 for key in ("ttft", "e2e", "plain_e2e")}
        cpu = r.get("cpu_s")
        rows[name] = {"cpu_ms_per_request": cpu[0] / len(work) * 1e3 if cpu else None,
                      "ttft": stats(r["ttft"]), "e2e": stats(r["e2e"]),
                      "plain_e2e": stats(r["plain_e2e"]),
                      "added_ttft": stats(added["ttft"]),
                      "added_plain_e2e": stats(added["plain_e2e"])}
    return rows


def start_targets(args: argparse.Namespace, model_dir: Path, backends: list[str],
                  stack: list, pids: dict[str, int]) -> dict[str, str]:
    """Start every router target; returns name -> URL. Mutates `stack` (the processes, to
    stop) and `pids` (name -> process id of each router)."""
    urls = {DIRECT: backends[0]}
    ours = [("pagedkv kv-aware", "kv-aware", None, args.profile),
            ("pagedkv round-robin", "round-robin", None, None)]
    if args.baseline:
        ours.append(("pagedkv kv-aware @baseline", "kv-aware", Path(args.baseline), None))
    for name, policy, root, profile in ours:
        proc = CheckoutRouterProcess(model_dir, backends, "--policy", policy, root=root,
                                     profile=profile)
        stack.append(proc)
        urls[name] = proc.start().url
        pids[name] = proc.proc.pid
    if args.vllm_router and Path(args.vllm_router).is_file():
        os.environ["VLLM_ROUTER_TOKENIZER"] = str(model_dir)
        proc = VllmRouterProcess(args.vllm_router, backends, "--policy", "cache_aware")
        stack.append(proc)
        urls["vllm-router cache_aware"] = proc.start().url
        pids["vllm-router cache_aware"] = proc.proc.pid
    return urls


def report(rows: dict[str, dict], args: argparse.Namespace) -> None:
    plain = args.plain_every > 0
    print(f"{args.rounds} rounds (one request per target each, rotating order), prompts of "
          f"{args.prompt_tokens} token ids, instant fake backends; CPU: {cpu_name()} "
          f"(load {os.getloadavg()[0]:.1f}: shared machine, compare within this run)")
    print(f"{'target':<28} {'TTFT mean':>9} {'p50':>6} {'p99':>6} | added TTFT mean "
          f"{'p50':>6} {'p99':>6}" + (" | added non-stream E2E mean p99" if plain else ""))
    for name, r in rows.items():
        a, t = r["added_ttft"], r["ttft"]
        line = (f"{name:<28} {t['mean_ms']:>7.2f}ms {t['p50_ms']:>6.2f} {t['p99_ms']:>6.2f} | "
                f"{a['mean_ms']:>13.2f}ms {a['p50_ms']:>6.2f} {a['p99_ms']:>6.2f}")
        if plain:
            e = r["added_plain_e2e"]
            line += f" | {e['mean_ms']:>8.2f}ms {e['p99_ms']:>6.2f}"
        if r["cpu_ms_per_request"] is not None:
            line += f" | CPU {r['cpu_ms_per_request']:.2f} ms/request"
        print(line)
    for ref in ("vllm-router cache_aware", "pagedkv kv-aware @baseline"):
        if ref not in rows:
            continue
        for name in rows:
            if name.startswith("pagedkv") and name != ref:
                mine, theirs = rows[name]["added_ttft"], rows[ref]["added_ttft"]
                print(f"added TTFT {name} / {ref}: mean x{ratio(mine, theirs, 'mean_ms')}, "
                      f"p50 x{ratio(mine, theirs, 'p50_ms')}, p99 x{ratio(mine, theirs, 'p99_ms')}"
                      f"; CPU per request x{ratio(rows[name], rows[ref], 'cpu_ms_per_request')}")


def ratio(a: dict, b: dict, key: str) -> str:
    if a[key] is None or b[key] is None or b[key] <= 0:
        return "n/a"
    return f"{a[key] / b[key]:.2f}"


def stage_costs(model_dir: Path, work: list[list[int]], backends: list[str]) -> dict[str, float]:
    """Microseconds per request of each step of our router's request path, in this process
    (no network): the JSON read of the body, tokenizing (pydantic validation, the server's
    tokenize function), chained block hashing, routing (prefix lookup on every backend,
    scoring, the decision record) and `begin` (books and the router's own prefix record); and
    the same tokenize + hash for a chat request of as many characters' worth of text."""
    from pagedkv.http.protocol import ModelCard
    from pagedkv.model.tokenizer import Tokenizer
    from pagedkv.router.backend import Backend
    from pagedkv.router.policies import RouteRequest, make_policy
    from pagedkv.router.proxy import _body_fields
    from pagedkv.router.router import Router

    router = Router([Backend(u) for u in backends], make_policy("kv-aware"),
                    tokenizer=Tokenizer.from_dir(model_dir), hash_settings=(32, "sha256"))
    for backend in router.backends:
        backend.up, backend.model_cards = True, [ModelCard(id="bench")]
    hasher = router.hasher
    bodies = [json.dumps({"model": "bench", "prompt": p, "max_tokens": 3,
                          "stream": True}).encode() for p in work]
    chats = [json.dumps({"model": "bench", "max_tokens": 3, "messages": [
        {"role": "user", "content": " ".join(f"w{t}" for t in p)}]}).encode() for p in work]
    totals: dict[str, float] = {}

    def timed(name: str, fn, *args):
        start = time.perf_counter_ns()
        out = fn(*args)
        totals[name] = totals.get(name, 0.0) + (time.perf_counter_ns() - start) / 1e3
        return out

    for body, chat in zip(bodies, chats, strict=True):
        timed("json body fields", _body_fields, body)
        ids, salt = timed("tokenize (completion)", hasher.token_ids, "/v1/completions", body)
        hashes = timed("block hashes", hasher.block_hashes, ids, salt)
        request = RouteRequest(prompt_tokens=len(ids), block_hashes=tuple(hashes), model="bench")
        backend, candidate = timed("route (match + score + record)", router.route, request)
        ticket = timed("begin (books + own record)", router.begin, backend, request, candidate)
        ticket.end()
        chat_ids, _ = timed("tokenize (chat, text)", hasher.token_ids, "/v1/chat/completions",
                            chat)
        timed("block hashes (chat)", hasher.block_hashes, chat_ids, None)
    return {name: total / len(work) for name, total in totals.items()}


def scrape_cost(model_dir: Path, repeats: int) -> dict[str, float]:
    """What our router's health round costs a real `pagedkv serve` (tiny model, a few requests
    served so every histogram has samples): ms per GET of each route it asks (alternating), the
    whole /metrics beside the load gauges alone (`LOAD_QUERY`) with their sizes, and the
    router's parse (`parse_load`) of the whole text beside a full Prometheus parse of it."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagedkv.router.backend import LOAD_QUERY, parse_load
    from tests.server.helpers import ServerProcess

    routes = {"/health": ("/health", None), "/kv_cache_info": ("/kv_cache_info", None),
              "/v1/models": ("/v1/models", None), "/metrics whole": ("/metrics", None),
              "/metrics load gauges": ("/metrics", LOAD_QUERY)}
    times = dict.fromkeys(routes, 0.0)
    sizes: dict[str, int] = {}
    server = ServerProcess(model_dir, "--max-model-len", "256", model_name="bench").start()
    try:
        for i in range(4):
            httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "bench", "prompt": [5 + i] * 40, "max_tokens": 4})
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for _ in range(repeats):
                for name, (path, params) in routes.items():
                    start = time.perf_counter()
                    text = client.get(path, params=params).text
                    times[name] += time.perf_counter() - start
                    sizes[name] = len(text)
        whole = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
    out = {f"GET {name} ms": t / repeats * 1e3 for name, t in times.items()}
    out |= {"whole bytes": sizes["/metrics whole"],
            "load gauges bytes": sizes["/metrics load gauges"]}
    for name, fn in (("parse_load of whole ms", parse_load),
                     ("full prometheus parse ms",
                      lambda text: list(text_string_to_metric_families(text)))):
        start = time.perf_counter()
        for _ in range(repeats):
            fn(whole)
        out[name] = (time.perf_counter() - start) / repeats * 1e3
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=900)
    p.add_argument("--plain-every", type=int, default=4,
                   help="every Nth round is non-streaming (0: none)")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="another pagedkv checkout: its router runs too (before/after)")
    p.add_argument("--vllm-router", default="/tmp/vllm-router-venv/bin/vllm-router")
    p.add_argument("--profile", default=None, metavar="OUT.prof",
                   help="run our kv-aware router under cProfile, its stats written here")
    p.add_argument("--scrape-cost", type=int, default=0, metavar="N",
                   help="also time N load scrapes of a real `pagedkv serve` (whole /metrics "
                   "against the load gauges alone) and their parse")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.rounds < 1 or args.prompt_tokens < 1:
        raise ValueError(f"--rounds and --prompt-tokens must be positive, got {args.rounds} "
                         f"and {args.prompt_tokens}")
    ports = [free_port(), free_port()]
    fakes = start_fakes(ports)
    stack: list = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-router-overhead-") as tmp:
            model_dir = build_random_model_dir(Path(tmp) / "model", hidden_size=32,
                                               intermediate_size=64, num_layers=1,
                                               num_heads=2, num_kv_heads=1)
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            pids: dict[str, int] = {}
            urls = start_targets(args, model_dir, [f"http://127.0.0.1:{p}" for p in ports],
                                 stack, pids)
            startup = {n: process_cpu_seconds(pid) for n, pid in pids.items()}
            time.sleep(IDLE_S)  # a first health round everywhere; the idle cost of the rest
            idle = {n: (process_cpu_seconds(pid) - startup[n]) / IDLE_S * 1e3
                    for n, pid in pids.items()}
            work = prompts(args, vocab)
            raw = asyncio.run(run_rounds(urls, work, args, pids))
            stages = stage_costs(model_dir, work, [f"http://127.0.0.1:{p}" for p in ports])
            scrape = scrape_cost(model_dir, args.scrape_cost) if args.scrape_cost else {}
    finally:
        for proc in reversed(stack):
            proc.stop()
        fakes.send_signal(signal.SIGTERM)
        fakes.wait(timeout=10)
    rows = summarize(raw, work)
    for name in pids:
        rows[name] |= {"startup_cpu_s": startup[name], "idle_cpu_ms_per_s": idle[name]}
    if args.json:
        print(json.dumps({"args": vars(args), "cpu": cpu_name(), "results": rows,
                          "stages_us": stages, "scrape": scrape}, indent=2))
    else:
        report(rows, args)
        print("router CPU outside requests: " + "; ".join(
            f"{name}: start-up {startup[name]:.2f} s, idle {idle[name]:.1f} ms per s "
            f"({len(ports)} backends' health rounds)" for name in pids))
        print("our request path in-process, us per request: " + ", ".join(
            f"{name} {us:.0f}" for name, us in stages.items()))
        if scrape:
            print("load scrape of a real pagedkv serve: " + ", ".join(
                f"{name} {value:.3g}" for name, value in scrape.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
