"""`pagedkv serve --data-parallel-size 2`: one API server over two engine cores. Completions
give transformers' greedy tokens, the requests spread over both cores (vLLM's per-engine
`engine="0"`/`"1"` series count them), a prefix goes back to the core holding it, a client
that leaves frees its blocks on its core, /kv_cache_info and the dashboard list each core,
the banner says the data-parallel size, and a core that dies ends the server (exit 1) with an
error naming it."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.conftest import hf_greedy, make_prompts
from tests.server.helpers import ServerProcess, engine_flags, wait_for_idle_pool

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def dp_server(tiny_llama):
    proc = ServerProcess(tiny_llama, *engine_flags(
        dtype="float32", block_size=4, max_model_len=256, num_gpu_blocks_override=256, seed=0,
        data_parallel_size=2, cpu_kernels="off"), "--engine-core", "process",
        "--log-level", "info").start()
    yield proc
    proc.stop()


def _per_engine(url: str, name: str) -> dict[str, float]:
    """`name`'s vllm: samples by their `engine` label."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[sample.labels["engine"]] = found.get(sample.labels["engine"], 0.0) \
                    + sample.value
    return found


def _complete(url: str, prompt: list[int], max_tokens: int = 6) -> list[int]:
    body = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                ignore_eos=True, return_token_ids=True)
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_completions_are_greedy_and_spread_over_both_cores(dp_server, tiny_llama):
    url = dp_server.url
    prompts = make_prompts(seed=4, vocab=400, num=6, shared_prefix=0, lengths=(6, 14))
    before = _per_engine(url, "vllm:prompt_tokens_total")
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        tokens = list(pool.map(lambda p: _complete(url, p), prompts))
    assert tokens == [hf_greedy(tiny_llama, p, 6) for p in prompts]
    after = _per_engine(url, "vllm:prompt_tokens_total")
    assert set(after) == {"0", "1"}
    grown = {e: after[e] - before.get(e, 0.0) for e in after}
    assert grown["0"] > 0 and grown["1"] > 0, grown  # both cores prefilled some
    assert sum(grown.values()) == sum(len(p) for p in prompts)
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info", "vllm:iteration_tokens_total_count"):
        assert set(_per_engine(url, name)) == {"0", "1"}, name
    metrics = wait_for_idle_pool(url)  # the pagedkv: twins: the sum over both cores
    assert metrics["pagedkv:prompt_tokens_total"] == sum(after.values())


def test_a_shared_prefix_goes_to_the_core_that_has_it(dp_server):
    url = dp_server.url
    prefix = list(range(100, 148))  # 12 full blocks of 4
    _complete(url, prefix + [7], max_tokens=1)
    before = _per_engine(url, "vllm:prefix_cache_hits_total")
    for i in range(3):
        _complete(url, prefix + [9, 10 + i], max_tokens=1)
    after = _per_engine(url, "vllm:prefix_cache_hits_total")
    hits = sorted(after[e] - before[e] for e in after)
    assert hits == [0.0, 3 * 48.0], (before, after)  # every hit on one core, none on the other


def test_a_client_that_leaves_frees_its_blocks(dp_server):
    url = dp_server.url
    body = dict(model="tiny", prompt=[5, 6, 7, 8, 9], max_tokens=200, ignore_eos=True,
                stream=True)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                break  # leave after the first token
    assert wait_for_idle_pool(url)["pagedkv:kv_cache_usage_perc"] == 0


def test_kv_cache_info_dashboard_and_banner_list_each_core(dp_server):
    url = dp_server.url
    info = httpx.get(url + "/kv_cache_info", timeout=10).json()
    assert info["data_parallel_size"] == 2
    assert [c["data_parallel_rank"] for c in info["engine_cores"]] == [0, 1]
    assert all(c["num_gpu_blocks"] == 256 and c["pid"] for c in info["engine_cores"])
    assert "data parallel: 2 engine cores" in dp_server.output()
    assert "CPU thread" in dp_server.output()
    with httpx.stream("GET", url + "/dashboard/events", timeout=30) as stream:
        events = {}
        name = None
        for line in stream.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events[name] = json.loads(line.removeprefix("data: "))
                if name == "update":
                    break
    assert events["snapshot"]["data_parallel_size"] == 2
    cores = events["update"]["cores"]
    assert [c["core"] for c in cores] == [0, 1] and all(c["num_blocks"] > 0 for c in cores)


def _stream_after_kill(url: str, prompt: list[int], ready: concurrent.futures.Future,
                      go: concurrent.futures.Future) -> str | None:
    """Stream a long completion; say when its first token came, wait for `go`, then read on.
    The finish reason it ended with (None: it ended without one: an error)."""
    body = dict(model="tiny", prompt=prompt, max_tokens=240, ignore_eos=True, stream=True)
    reason = None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data: {"):
                    continue
                if not ready.done():
                    ready.set_result(True)
                    go.result(timeout=60)
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    return None
                reason = event["choices"][0].get("finish_reason") or reason
    except httpx.HTTPError:
        return None
    return reason


def test_a_dead_core_ends_the_server_naming_it(dp_server):
    """(Last: it ends the module's server.)"""
    url = dp_server.url
    pids = [c["pid"] for c in httpx.get(url + "/kv_cache_info", timeout=10)
            .json()["engine_cores"]]
    ready = [concurrent.futures.Future() for _ in range(2)]
    go: concurrent.futures.Future = concurrent.futures.Future()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ends = [pool.submit(_stream_after_kill, url, [5, 6, 7 + i], ready[i], go)
                for i in range(2)]
        concurrent.futures.wait(ready, timeout=60)
        os.kill(pids[1], signal.SIGKILL)
        go.set_result(True)
        reasons = [end.result(timeout=60) for end in ends]
    assert None in reasons, reasons  # the request on the dead core ended with an error
    deadline = time.monotonic() + 30
    while dp_server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert dp_server.proc.returncode == 1, dp_server.output()
    assert "data-parallel engine core 1 of 2" in dp_server.output()


def test_bad_data_parallel_flags_are_one_line(tiny_llama):
    from tests.server.test_startup_errors import _one_line, _serve

    line = _one_line(_serve(tiny_llama, "--data-parallel-size", "2", "--engine-core", "inproc"))
    assert "--engine-core inproc" in line
    line = _one_line(_serve(tiny_llama, "--data-parallel-size", "2", "--data-parallel-rank",
                            "2"))
    assert "data_parallel_rank" in line
