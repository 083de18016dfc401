"""A real `pagedkv router --prefill URL --decode URL` in front of two real `pagedkv serve`
processes: the decoded tokens equal one instance's (greedy), streaming and not; the prefill
instance ran exactly one token per request (the hop's max_tokens 1 reached a real server);
both pools end empty. With servers in producer/consumer roles (`ROLE_FLAGS`) the producer
answers kv_transfer_params and every request decodes with a transfer; without roles each
request falls back (counted as no_params) and must still give the same tokens.
"""

from __future__ import annotations

import json
import socket
import sys

import httpx
import pytest

from pagedkv import LLM, SamplingParams
from tests.router.helpers import RouterProcess, router_metric
from tests.server.helpers import (
    ENGINE_KWARGS,
    ServerProcess,
    engine_flags,
    scrape,
    wait_for_idle_pool,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, method="thread")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


KV_PORT = _free_port()
# Extra `pagedkv serve` flags per role: a producer pushing its blocks to the consumer's port.
ROLE_FLAGS: dict[str, list[str]] = {
    "prefill": ["--kv-transfer-config", json.dumps({
        "kv_role": "kv_producer", "kv_connector": "PagedKVPushConnector",
        "kv_connector_extra_config": {"consumers": [f"127.0.0.1:{KV_PORT}"]}})],
    "decode": ["--kv-transfer-config", json.dumps({
        "kv_role": "kv_consumer", "kv_connector": "PagedKVPushConnector",
        "kv_ip": "127.0.0.1", "kv_port": KV_PORT})],
}
PROMPTS = ("the first prompt of the split fleet, several blocks long",
           "another prompt entirely", "the first prompt of the split fleet, then more")
MAX_TOKENS = 6


class PDRouterProcess(RouterProcess):
    """`pagedkv router --prefill P --decode D --model MODEL_DIR`."""

    def __init__(self, model_dir, prefill: str, decode: str, *args: str) -> None:
        super().__init__(model_dir, [prefill, decode], *args)

    def command(self) -> list[str]:
        prefill, decode = self.backends
        return [sys.executable, "-m", "pagedkv.cli", "router", "--prefill", prefill,
                "--decode", decode, "--model", str(self.model_dir), "--port", str(self.port),
                "--log-level", "warning", *self.args]


@pytest.fixture(scope="module")
def fleet(tiny_llama):
    servers = {role: ServerProcess(tiny_llama, *engine_flags(**ENGINE_KWARGS), *flags)
               for role, flags in ROLE_FLAGS.items()}
    router = PDRouterProcess(tiny_llama, servers["prefill"].url, servers["decode"].url,
                             "--health-interval", "0.3", "--pd-prefill-timeout", "30")
    try:
        for server in servers.values():
            server.start()
        router.start()
        yield servers, router
        for server in servers.values():
            assert wait_for_idle_pool(server.url)["pagedkv:kv_cache_usage_perc"] == 0.0
    finally:
        router.stop()
        for server in servers.values():
            server.stop()


def greedy_texts(model_dir) -> list[str]:
    llm = LLM(str(model_dir), **ENGINE_KWARGS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(list(PROMPTS), params, use_tqdm=False)]


def complete(url: str, prompt: str, stream: bool) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    if not stream:
        return resp.json()["choices"][0]["text"]
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def test_split_requests_decode_one_instances_tokens(fleet, tiny_llama):
    servers, router = fleet
    expected = greedy_texts(tiny_llama)
    before = {role: scrape(s.url) for role, s in servers.items()}
    got = [complete(router.url, p, stream) for stream in (False, True) for p in PROMPTS]
    assert got == expected * 2
    after = {role: scrape(s.url) for role, s in servers.items()}

    def delta(role: str, name: str) -> float:
        return after[role].get(name, 0.0) - before[role].get(name, 0.0)

    requests = 2 * len(PROMPTS)
    assert delta("prefill", "pagedkv:generation_tokens_total") == requests  # one token each
    assert delta("decode", "pagedkv:generation_tokens_total") == requests * MAX_TOKENS
    ok = router_metric(router.url, "pagedkv_router:pd_prefill_requests_total",
                       backend=servers["prefill"].url, outcome="ok")
    no_params = router_metric(router.url, "pagedkv_router:pd_fallbacks_total",
                              reason="no_params")
    assert ok + no_params == requests
    transfers = router_metric(router.url, "pagedkv_router:pd_decode_requests_total",
                              backend=servers["decode"].url, transfer="yes")
    assert transfers == ok
    # Every request went through a transfer: the producer answered kv_transfer_params.
    assert (ok, no_params) == (requests, 0)
    # The consumer loaded the transferred blocks from its KV store (the pushed tier).
    loaded = [float(line.rsplit(" ", 1)[1]) for line in
              httpx.get(servers["decode"].url + "/metrics", timeout=10).text.splitlines()
              if line.startswith("vllm:external_prefix_cache_hits_total")]
    assert loaded and loaded[0] > 0
