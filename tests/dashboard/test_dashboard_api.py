"""/dashboard on a real server: the page and its assets, the SSE feed (a snapshot, then at most
10 coalesced updates a second, that rebuild the engine's own block state), a live request's
block table, and no recording once the last client is gone (issue 23). The tests that read the
engine core run with it in-process and in its own process (the `engine` fixture)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pagedkv.kv.observer import pool_snapshot
from pagedkv.server.dashboard.state import PageState
from tests.dashboard.conftest import (
    CORE_MODES,
    fresh_snapshot,
    serving,
    sse_events,
    wait_until_unwatched,
)

pytestmark = pytest.mark.timeout(120)


def _completions(url: str, prompts: list[list[int]], max_tokens: int = 12) -> None:
    with httpx.Client(timeout=60) as client:
        for prompt in prompts:
            r = client.post(url + "/v1/completions", json={
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text


def test_page_and_assets_are_served_from_the_package(inproc_engine):
    with serving(inproc_engine) as url:
        page = httpx.get(url + "/dashboard")
        assert page.status_code == 200 and 'id="grid"' in page.text and 'id="legend"' in page.text
        assert "http://" not in page.text and "https://" not in page.text  # no CDN
        for name, kind in (("app.js", "javascript"), ("state.js", "javascript"),
                           ("style.css", "css")):
            r = httpx.get(f"{url}/dashboard/static/{name}")
            assert r.status_code == 200 and kind in r.headers["content-type"] and r.text
        assert httpx.get(url + "/dashboard/static/..%2Froutes.py").status_code == 404
        assert httpx.get(url + "/dashboard/static/nope.js").status_code == 404


def test_feed_rebuilds_the_engine_state_at_most_10_updates_a_second(engine):
    kv = engine.scheduler.kv_cache_manager if engine.core is not None else None
    system = list(range(100, 140))  # a shared 10-block system prompt
    prompts = [system + [i, i + 1, i + 2] for i in range(6)]
    with serving(engine) as url:
        _completions(url, prompts[:2])  # cached blocks before the client connects
        if kv is not None:
            assert kv.pool.observer is None
        with httpx.stream("GET", url + "/dashboard/events", timeout=60) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = sse_events(resp)
            name, snap = next(events)
            assert name == "snapshot" and snap["block_size"] == 4
            state = PageState(snap["pools"])
            assert len(state.forest) > 0
            traffic = threading.Thread(target=_completions, args=(url, prompts[2:]))
            traffic.start()
            times = []
            while traffic.is_alive() or len(times) < 12:
                name, update = next(events)
                assert name == "update"
                state.apply(update["ops"], update["t"])
                times.append(time.monotonic())
                if not traffic.is_alive() and update["stats"]["num_running"] == 0 and \
                        len(times) >= 12:
                    break
            traffic.join()
            # Drain until the idle engine's state has reached us.
            for _ in range(5):
                name, update = next(events)
                state.apply(update["ops"], update["t"])
            assert update["stats"]["num_running"] == 0
            assert update["stats"]["prefix_cache_hits"] > 0
            # The page's state equals the core's own (a newly connected page's snapshot; and
            # the manager's, where the core is in this process).
            want = fresh_snapshot(url)["pools"][0]
            if kv is not None:
                assert want == pool_snapshot(kv.pool, kv.pins.pin_counts())
            got = state.pools[0].snapshot()
            assert got["refs"] == want["refs"] and got["hashes"] == want["hashes"]
            assert got["free_order"] == want["free_order"]
            assert got["pins"] == {int(k): v for k, v in want["pins"].items()}
            # The shared system prompt is one chain in the forest with several children.
            children: dict = {}
            for node in state.forest.values():
                children.setdefault(node.parent, []).append(node)
            assert max(len(c) for p, c in children.items() if p is not None) >= 2
            assert max(n.hits for n in state.forest.values()) >= 4
            # Coalesced: never more than 10 updates in any one-second window (+1 for jitter).
            for i in range(len(times)):
                assert sum(1 for t in times[i:] if t - times[i] < 1.0) <= 11
        wait_until_unwatched(url)  # the stream is closed: the last subscriber is gone
    if kv is not None:  # and the recorders came off
        assert kv.pool.observer is None
    engine.check_invariants()


def test_block_table_of_a_live_request_marks_shared_blocks(engine):
    system = list(range(200, 232))  # 8 blocks
    with serving(engine) as url:
        _completions(url, [system + [1]], max_tokens=2)
        done = threading.Event()

        def client(k: int) -> None:  # long requests back to back until the table is read
            while not done.is_set():
                _completions(url, [system + [k, 3]], max_tokens=200)

        traffic = [threading.Thread(target=client, args=(k,)) for k in (2, 4)]
        for thread in traffic:
            thread.start()
        table = None
        try:
            with httpx.stream("GET", url + "/dashboard/events", timeout=60) as resp:
                for name, update in sse_events(resp):
                    if name != "update" or len(update["queues"]["running"]) != 2:
                        continue
                    rid = update["queues"]["running"][0][0]
                    answer = httpx.get(f"{url}/dashboard/api/request/{rid}")
                    if answer.status_code == 200:  # else it finished meanwhile: try again
                        table = answer.json()
                        if all(b["ref_cnt"] == 2 for b in table["blocks"][:8]):
                            break
        finally:
            done.set()
            for thread in traffic:
                thread.join()
        assert table is not None and table["tier"] == "device" and table["block_size"] == 4
        assert [b["logical"] for b in table["blocks"]] == list(range(len(table["blocks"])))
        # The system prompt's blocks are cached and held by both running requests: shared.
        assert all(b["hash"] and b["shared"] for b in table["blocks"][:8])
        assert not any(b["shared"] for b in table["blocks"][9:])
        assert httpx.get(url + "/dashboard/api/request/nope").status_code == 404


@pytest.mark.parametrize("core", CORE_MODES)
def test_an_open_dashboard_does_not_hold_up_a_graceful_shutdown(tiny_llama, core):
    from tests.server.helpers import ENGINE_KWARGS, ServerProcess, engine_flags

    proc = ServerProcess(tiny_llama, *engine_flags(**ENGINE_KWARGS), "--engine-core",
                         core).start()
    ended = threading.Event()

    def watch() -> None:
        with httpx.stream("GET", proc.url + "/dashboard/events", timeout=60) as resp:
            for _ in resp.iter_lines():
                pass
        ended.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(1.0)  # a few updates flow
    started = time.monotonic()
    assert proc.stop(), "SIGTERM with a dashboard open did not stop the server cleanly"
    assert time.monotonic() - started < 15
    assert ended.wait(10), "the dashboard stream did not end"
