"""/metrics has vLLM 0.32's families with its names, types, labels (engine="0" on every vllm:
series besides model_name) and buckets, and their values follow the requests served."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.router.backend import LOAD_QUERY, parse_load
from tests.server.helpers import ENGINE_KWARGS, wait_for_idle_pool

LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
       20.0, 40.0, 80.0]
TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]  # vLLM's 1-2-5 up to max_model_len 1024
# (family name, prometheus type, extra labels, buckets) as vllm/v1/metrics/loggers.py declares
FAMILIES = [
    ("vllm:iteration_tokens_total", "histogram", [],
     [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]),
    ("vllm:request_prefill_time_seconds", "histogram", [], LATENCY),
    ("vllm:request_decode_time_seconds", "histogram", [], LATENCY),
    ("vllm:request_inference_time_seconds", "histogram", [], LATENCY),
    ("vllm:request_time_per_output_token_seconds", "histogram", [], ITL),
    ("vllm:request_max_num_generation_tokens", "histogram", [], TOKENS),
    ("vllm:request_params_n", "histogram", [], [1, 2, 5, 10, 20]),
    ("vllm:request_params_max_tokens", "histogram", [], TOKENS),
    ("vllm:request_num_preemptions", "histogram", [], [1, 2, 3, 4, 5, 10, 20]),
    ("vllm:request_prefill_kv_computed_tokens", "histogram", [], TOKENS),
    ("vllm:prompt_tokens_cached", "counter", [], None),
    ("vllm:prompt_tokens_by_source", "counter", ["source"], None),
    ("vllm:prompt_tokens_cached_by_source", "counter", ["source"], None),
    ("vllm:external_prefix_cache_queries", "counter", [], None),
    ("vllm:external_prefix_cache_hits", "counter", [], None),
    ("vllm:cache_config_info", "gauge", None, None),
    ("vllm:num_requests_waiting_by_reason", "gauge", ["reason"], None),
    ("vllm:time_to_first_token_seconds", "histogram", [],
     [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
      20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]),
    ("vllm:request_success", "counter", ["finished_reason"], None),
    ("vllm:num_requests_running", "gauge", [], None),
    ("vllm:engine_sleep_state", "gauge", ["sleep_state"], None),
    ("vllm:mm_cache_queries", "counter", [], None),
    ("vllm:mm_cache_hits", "counter", [], None),
]


def scrape(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, suffix: str = "", **labels: str) -> float:
    family = families[name]
    return sum(s.value for s in family.samples if s.name == name + suffix
               and all(s.labels.get(k) == v for k, v in labels.items()))


def test_families_names_types_labels_and_buckets(server):
    families = scrape(server.url)
    for name, kind, extra, buckets in FAMILIES:
        family = families.get(name)
        assert family is not None, name
        assert family.type == kind, (name, family.type)
        for sample in family.samples:
            assert sample.labels["engine"] == "0", sample
            assert sample.labels.get("model_name") == "tiny", sample
            if extra is not None:
                assert set(sample.labels) - {"le"} == {"model_name", "engine", *extra}, sample
        if buckets is not None:
            bounds = [float(s.labels["le"]) for s in family.samples if s.name == name + "_bucket"]
            assert bounds == [*map(float, buckets), float("inf")], name
    # admission_rejections has model_name, engine and reason (as vLLM's), both reasons present
    rejections = families["vllm:admission_rejections"]
    assert rejections.type == "counter"
    assert {s.labels["reason"] for s in rejections.samples if s.name.endswith("_total")} == \
        {"max_num_queued_reqs", "max_num_queued_tokens"}
    assert all(set(s.labels) == {"model_name", "engine", "reason"} for s in rejections.samples)
    info = families["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == str(ENGINE_KWARGS["block_size"])
    assert {s.labels["source"] for s in families["vllm:prompt_tokens_cached_by_source"].samples} \
        == {"device", "host", "p2p", "disk", "external_unspecified"}
    # the pagedkv: twins keep model_name only
    assert set(families["pagedkv:num_requests_running"].samples[0].labels) == {"model_name"}


def test_exposition_text_as_vllms(server):
    """What the parser hides: bucket bounds written as vLLM writes them ("1.0", not "1"), a
    `_created` sample for every vllm: counter and histogram (prometheus_client's, as vLLM
    exports them), and the sleep state (awake)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="tiny"}' in text \
        or 'vllm:iteration_tokens_total_bucket{model_name="tiny",engine="0",le="1.0"}' in text
    assert 'le="1"' not in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, family in families.items():
        if name.startswith("vllm:") and family.type in ("counter", "histogram"):
            assert f"\n{name}_created{{" in text, name
    states = {s.labels["sleep_state"]: s.value
              for s in families["vllm:engine_sleep_state"].samples}
    assert states == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}  # every one from 0


def test_values_follow_the_requests(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    wait_for_idle_pool(server.url)
    before = scrape(server.url)
    prompt = "Count the tokens of this prompt please " * 3
    for n in (1, 2):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=4, n=n,
                                  temperature=1.0, extra_body={"ignore_eos": True, "top_k": 1})
    wait_for_idle_pool(server.url)
    after = scrape(server.url)

    def delta(name: str, suffix: str = "", **labels: str) -> float:
        return value(after, name, suffix, **labels) - value(before, name, suffix, **labels)
    assert delta("vllm:request_params_n", "_count") == 2
    assert delta("vllm:request_params_n", "_sum") == 3
    assert delta("vllm:request_params_max_tokens", "_sum") == 8
    assert delta("vllm:request_max_num_generation_tokens", "_sum") == 8
    assert delta("vllm:request_num_preemptions", "_sum") == 0
    assert delta("vllm:request_num_preemptions", "_count") == 2
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_time_per_output_token_seconds"):
        assert delta(f"vllm:{name}", "_count") == 2, name
    assert delta("vllm:request_inference_time_seconds", "_sum") >= \
        delta("vllm:request_decode_time_seconds", "_sum")
    computed = delta("vllm:request_prefill_kv_computed_tokens", "_sum")
    cached = delta("vllm:prompt_tokens_cached", "_total")
    assert computed + cached == delta("vllm:prompt_tokens", "_total")  # two prompts, in full
    assert cached > 0  # the second request reuses the first one's prompt blocks
    assert delta("vllm:prompt_tokens_by_source", "_total", source="local_cache_hit") == cached
    assert delta("vllm:prompt_tokens_cached_by_source", "_total", source="device") == cached
    # every step's tokens: the prompts' computed tokens, then one per decode step per sequence
    # (4 tokens: the prefill samples the first, 3 decode steps the rest; n=2 decodes 2 rows)
    assert delta("vllm:iteration_tokens_total", "_sum") == computed + 3 * 1 + 3 * 2
    assert delta("vllm:iteration_tokens_total", "_count") >= 4
    assert value(after, "vllm:num_requests_waiting_by_reason", reason="capacity") == 0


def test_name_filter_renders_only_the_named_samples(server):
    """`?name[]=...` (prometheus_client's filter, as vLLM's /metrics): only those samples, as
    a router's load scrape asks for them (pagedkv.router.backend.LOAD_QUERY)."""
    resp = httpx.get(server.url + "/metrics", params=LOAD_QUERY, timeout=10)
    assert resp.status_code == 200
    names = {s.name for f in text_string_to_metric_families(resp.text) for s in f.samples}
    assert names == {"vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc", "pagedkv:num_requests_running",
                     "pagedkv:num_requests_waiting", "pagedkv:kv_cache_usage_perc"}
    whole = httpx.get(server.url + "/metrics", timeout=10).text
    assert len(resp.text) * 20 < len(whole)
    assert parse_load(resp.text) == parse_load(whole)
