"""POST /v1/cache/explain: a completion or chat body, nothing generated; behind the API key;
bad bodies are 400s. GET /dashboard/api/explain/{id} explains a finished request (issue 23).
The explanation test runs with the engine core in-process and in its own process (the `engine`
fixture), and checks that a bad utility call is a ValueError in both."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.dashboard.conftest import fresh_snapshot, serving
from tests.server.helpers import scrape

pytestmark = pytest.mark.timeout(120)


def test_explain_a_completion_and_a_chat_prompt(engine):
    prompt = list(range(300, 322))  # 5 full blocks of 4 and a partial one of 2
    with serving(engine) as url:
        before = httpx.post(url + "/v1/cache/explain", json={"model": "tiny", "prompt": prompt})
        assert before.status_code == 200, before.text
        body = before.json()
        assert [b["reason"] for b in body["blocks"]] == ["never_computed"] * 5
        assert body["partial_block"]["tokens"] == [20, 22]
        assert body["kv_cache_dtype"] == "auto" and body["model"] == "tiny"
        assert scrape(url)["pagedkv:generation_tokens_total"] == 0  # nothing was generated
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                       timeout=60)
        assert r.status_code == 200
        rid = r.json()["id"]
        after = httpx.post(url + "/v1/cache/explain", json={"prompt": prompt}).json()
        assert [b["reason"] for b in after["blocks"]] == ["hit"] * 5
        assert after["num_device_hit_tokens"] == 20
        salted = httpx.post(url + "/v1/cache/explain",
                            json={"prompt": prompt, "cache_salt": "other"}).json()
        # Another salt sees nothing of the unsalted request (nor its id).
        assert [b["reason"] for b in salted["blocks"]] == ["never_computed"] * 5
        assert rid not in str(salted) and salted["recent_prompts"] == 0
        # The dashboard's explanation of the finished request itself (its engine-side id, as
        # the feed lists the latest finished requests).
        finished = fresh_snapshot(url)["first_update"]["finished"]
        assert len(finished) == 1, (rid, finished)
        if engine.core is not None:
            kv = engine.scheduler.kv_cache_manager
            assert finished == [p.request_id for p in kv.recent_prompts]
        mine = httpx.get(f"{url}/dashboard/api/explain/{finished[-1]}").json()
        assert mine["num_tokens"] == len(prompt) + 1  # prompt + the generated token
        assert mine["blocks"][0]["reason"] == "hit"
        assert httpx.get(url + "/dashboard/api/explain/nope").status_code == 404
        chat = httpx.post(url + "/v1/cache/explain", json={
            "messages": [{"role": "user", "content": "hello there"}]})
        if chat.status_code == 400:  # the tiny model may have no chat template
            assert "template" in chat.json()["error"]["message"]
        else:
            assert chat.status_code == 200 and chat.json()["num_tokens"] > 0
    engine.check_invariants()
    # The utility calls are a closed set, and their errors cross the process by type.
    with pytest.raises(ValueError, match="unknown utility method 'scheduler'"):
        engine.call_utility("scheduler")
    with pytest.raises(ValueError, match="unknown dashboard subscriber 12345"):
        engine.call_utility("dashboard.drain", 12345)


def test_explain_is_behind_the_api_key_and_rejects_bad_bodies(inproc_engine):
    with serving(inproc_engine, api_key="sekrit") as url:
        body = {"prompt": [1, 2, 3, 4, 5]}
        assert httpx.post(url + "/v1/cache/explain", json=body).status_code == 401
        auth = {"Authorization": "Bearer sekrit"}
        ok = httpx.post(url + "/v1/cache/explain", json=body, headers=auth)
        assert ok.status_code == 200 and len(ok.json()["blocks"]) == 1
        bad = httpx.post(url + "/v1/cache/explain", json={"prompt": 5}, headers=auth)
        assert bad.status_code == 400 and "error" in bad.json()
        many = httpx.post(url + "/v1/cache/explain", json={"prompt": ["a", "b"]}, headers=auth)
        assert many.status_code == 400 and "one prompt" in many.json()["error"]["message"]
        wrong = httpx.post(url + "/v1/cache/explain", json={**body, "model": "other"},
                           headers=auth)
        assert wrong.status_code == 404


def test_explain_refuses_what_a_completion_refuses_before_the_core(inproc_engine, monkeypatch):
    calls: list[str] = []
    start_utility = inproc_engine.start_utility

    def spy(method, *args):
        calls.append(method)
        return start_utility(method, *args)

    monkeypatch.setattr(inproc_engine, "start_utility", spy)
    max_len, vocab = inproc_engine.max_model_len, inproc_engine.vocab_size
    with serving(inproc_engine) as url:
        for prompt in ([7] * 600_000, [7] * max_len, [7, vocab + 3]):
            started = time.monotonic()
            resp = httpx.post(url + "/v1/cache/explain", json={"prompt": prompt}, timeout=30)
            assert resp.status_code == 400, resp.text[:300]
            assert resp.json()["error"]["param"] == "prompt"
            assert len(resp.content) < 2000 and time.monotonic() - started < 10
        completion = httpx.post(url + "/v1/completions", json={"prompt": [7] * max_len},
                                timeout=30)
        assert completion.status_code == 400  # the same refusal as a completion's
        assert "dashboard.explain" not in calls, calls
        ok = httpx.post(url + "/v1/cache/explain", json={"prompt": [7] * (max_len - 1)})
        assert ok.status_code == 200 and ok.json()["num_tokens"] == max_len - 1
        assert "dashboard.explain" in calls
