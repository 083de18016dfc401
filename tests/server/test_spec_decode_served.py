"""`pagedkv serve --speculative-config`: completions equal to the offline engine's without
speculation, and vLLM's spec_decode_* counters on /metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from pagedkv import LLM, SamplingParams
from tests.server.helpers import ENGINE_KWARGS, ServerProcess, engine_flags, wait_for_idle_pool

pytestmark = pytest.mark.timeout(240)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
PROMPT = "one two three four one two three four one two three four one two"


def test_served_greedy_completion_equals_no_speculation_and_counts(tiny_llama):
    offline = LLM(str(tiny_llama), **ENGINE_KWARGS)
    try:
        expected = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24,
                                                           ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0].text
    finally:
        offline.shutdown()
    proc = ServerProcess(tiny_llama, *engine_flags(**ENGINE_KWARGS),
                         "--speculative-config", json.dumps(SPEC)).start()
    try:
        answer = httpx.post(proc.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0.0,
            "ignore_eos": True}).json()
        assert answer["choices"][0]["text"] == expected
        wait_for_idle_pool(proc.url)
        text = httpx.get(proc.url + "/metrics", timeout=10).text
        drafts = [line for line in text.splitlines()
                  if line.startswith("vllm:spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0
        assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in text
    finally:
        assert proc.stop()
