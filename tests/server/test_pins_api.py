"""POST /v1/pin and /v1/unpin on a real `pagedkv serve --eviction-policy arc` with a small KV
cache: a pinned prefix survives a flood of one-off prompts (its later request reports the
cached tokens), the pinned-blocks gauge follows, and bad bodies are 400s (404 for an unknown
model or an unpin of what is not pinned)."""

from __future__ import annotations

import httpx
import pytest

from pagedkv.model.tokenizer import Tokenizer
from tests.server.helpers import ServerProcess, engine_flags, scrape, serving

BLOCK = 4
FLAGS = engine_flags(dtype="float32", block_size=BLOCK, max_model_len=256,
                     num_gpu_blocks_override=65, seed=0, eviction_policy="arc",
                     max_pinned_fraction=0.25)  # 64 usable blocks, at most 16 pinned
PINNED = [10 + i for i in range(24)]  # 6 full blocks


@pytest.fixture(scope="module")
def pin_server(tiny_llama):
    with serving(ServerProcess(tiny_llama, *FLAGS)) as proc:
        yield proc


def _complete(url: str, prompt: list[int]) -> dict:
    resp = httpx.post(url + "/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_pin_survives_a_flood_then_unpin(pin_server):
    url = pin_server.url
    resp = httpx.post(url + "/v1/pin", json={"model": "tiny", "prompt": PINNED}, timeout=120)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert (body["num_blocks"], body["num_tokens"], body["num_prompt_blocks"]) == (6, 24, 6)
    assert scrape(url)["pagedkv:kv_pinned_blocks"] == 6
    for i in range(16):  # one-off prompts of 10 blocks: 160 blocks, 2.5x the cache
        _complete(url, [(i * 53 + j * 7) % 390 + 5 for j in range(40)])
    usage = _complete(url, PINNED + [3, 4, 5])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 24
    resp = httpx.post(url + "/v1/unpin", json={"prompt": PINNED}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["num_blocks"] == 0 and resp.json()["total_pinned_blocks"] == 0
    assert scrape(url)["pagedkv:kv_pinned_blocks"] == 0
    resp = httpx.post(url + "/v1/unpin", json={"prompt": PINNED}, timeout=30)
    assert resp.status_code == 404 and "not pinned" in resp.json()["error"]["message"]


def test_pin_text_prompt_with_salt(pin_server, tiny_llama):
    url = pin_server.url
    text = "the quick brown fox jumps over the lazy dog " * 2
    ids = Tokenizer.from_dir(tiny_llama).encode(text)
    resp = httpx.post(url + "/v1/pin", json={"prompt": text, "cache_salt": "t1"}, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["num_prompt_blocks"] == len(ids) // BLOCK
    assert resp.json()["num_blocks"] == len(ids) // BLOCK
    # The same text unsalted is another prefix: it is not pinned.
    assert httpx.post(url + "/v1/unpin", json={"prompt": text}).status_code == 404
    resp = httpx.post(url + "/v1/unpin", json={"prompt": text, "cache_salt": "t1"})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [1, 2, 3, 4], "cache_salt": ""}, 400, "cache_salt"),
    ({"prompt": [1, 2, 3, 4], "temperature": 0}, 400, "temperature"),
    ({"prompt": [1, 2, 3, 4, 10**6]}, 400, "vocabulary"),
    ({"prompt": [1, 2, 3]}, 400, "no full block"),
    ({"prompt": list(range(5, 5 + 17 * BLOCK))}, 400, "max_pinned_fraction"),
    ({"prompt": [1, 2, 3, 4], "model": "other"}, 404, "other"),
])
def test_bad_pin_bodies(pin_server, body, status, needle):
    for route in ("/v1/pin", "/v1/unpin"):
        resp = httpx.post(pin_server.url + route, json=body, timeout=60)
        if route == "/v1/unpin" and needle == "max_pinned_fraction":
            assert resp.status_code == 404  # nothing was pinned
            continue
        assert resp.status_code == status, (route, resp.text)
        assert needle in resp.text
        assert resp.json()["error"]["message"]
    assert scrape(pin_server.url)["pagedkv:kv_pinned_blocks"] == 0
