"""The dashboards never parse data as HTML (issue 43): request ids, model and tier names, API
error messages and explain fields holding markup are shown as text, in headless Chromium, from a
replayed dashboard log, the explain box and the router's fleet view; and a loaded log's last
frame shows at once, without a scrub."""

from __future__ import annotations

import json

import pytest

from tests.dashboard.static_page import open_page, pool, update
from tests.dashboard.test_browser import browser  # noqa: F401 (Chromium, or a skip)

pytestmark = pytest.mark.timeout(120)

XSS = '<img src=x onerror="window.__pwned=(window.__pwned||0)+1">'
XSS2 = '"><svg onload="window.__pwned=1"><script>window.__pwned=1</script>'
WAIT_MS = 10_000
INJECTED = "() => document.querySelectorAll('img, svg, iframe').length + " \
           "document.querySelectorAll('script').length"


def hostile_log() -> dict:
    snapshot = {"t": 1000.0, "block_size": 4, "model": XSS, "parents": {},
                "pools": [pool(64, used={1: 1, 2: 2}, cached={3: XSS2})]}
    tiers = [{"name": XSS, "num_blocks": 3, "used_bytes": 4096, "hits": 1, "misses": 2}]
    updates = [update(1000.0 + 0.1 * i, running=[(XSS, 12, 8, 4)], waiting=[(XSS2, 4, 0, 0)],
                      finished=[XSS2] if i == 14 else [], prefix_cache_queries=10 * i,
                      prefix_cache_hits=8 * i, kv_store_tiers=tiers)
               for i in range(15)]
    return {"snapshot": snapshot, "updates": updates}


def explain_answer(path: str):
    """A 404 naming the id (as the server's), or for id "ok" an answer with markup in it."""
    prefix = "/dashboard/api/explain/"
    if path.startswith(prefix):
        rid = path[len(prefix):]
        if rid == "ok":
            return 200, {"num_tokens": 8, "num_device_hit_tokens": 4, "blocks": [
                {"index": 0, "tokens": [0, 4], "where": XSS, "reason": XSS2, "detail": XSS}],
                "partial_block": {"tokens": [4, 8], "detail": XSS2}}
        return 404, {"error": {"message": f"no finished request {rid!r}", "type": "not_found"}}
    if path.startswith("/dashboard/api/request/"):
        return 404, {"error": {"message": "finished"}}
    return 404, {"error": {"message": "not here"}}


def assert_clean(page) -> None:
    """No element made from data, no script run, no page error."""
    page.wait_for_timeout(200)  # an onerror handler runs once the bad image fails
    assert page.evaluate("() => window.__pwned") is None
    assert page.evaluate(INJECTED) == 3, page.content()[:2000]  # dom.js, state.js, app.js
    assert page.errors == []


def test_a_replayed_log_and_explain_answers_with_markup_are_text(browser, tmp_path):  # noqa: F811
    path = tmp_path / "hostile-log.json"
    path.write_text(json.dumps(hostile_log()))
    page = open_page(browser, explain_answer)
    page.wait_for_function("window.dashboard !== undefined")
    page.set_input_files("#load", str(path))
    # The last frame's panels show at once: no scrub.
    page.wait_for_function("document.querySelectorAll('#requests tr.req').length === 2",
                           timeout=WAIT_MS)
    rows = page.locator("#requests tr.req")
    assert rows.nth(0).get_attribute("data-id") == XSS
    assert rows.nth(0).locator("td").first.inner_text() == XSS
    assert rows.nth(1).locator("td").first.inner_text() == XSS2
    assert page.inner_text("#model").startswith(XSS)
    assert XSS in page.inner_text("#tiers")
    assert page.locator("#finished a[data-explain]").first.inner_text() == XSS2
    assert page.locator("#counts [data-count=in_use] b").inner_text() == "2"
    assert_clean(page)
    # A clicked request that has finished: its title names it, as text, with the explain link.
    rows.nth(0).click()
    page.wait_for_function("document.querySelector('#bt-title a') !== null", timeout=WAIT_MS)
    assert page.text_content("#bt-title").startswith(f"{XSS} finished")
    page.click("#bt-title a")
    page.wait_for_function("document.querySelector('#explain').textContent.includes('no finished')",
                           timeout=WAIT_MS)
    assert repr(XSS) in page.inner_text("#explain")
    # An id typed in the explain box comes back in the 404's message: text.
    page.fill("#explain-id", XSS2)
    page.click("#explain-go")
    page.wait_for_function("document.querySelector('#explain').textContent.includes('svg')",
                           timeout=WAIT_MS)
    assert repr(XSS2) in page.inner_text("#explain")
    # An explanation whose fields hold markup.
    page.fill("#explain-id", "ok")
    page.click("#explain-go")
    page.wait_for_function("document.querySelectorAll('#explain td').length > 0", timeout=WAIT_MS)
    cells = page.locator("#explain tr").nth(1).locator("td")
    assert [cells.nth(i).inner_text() for i in (2, 3, 4)] == [XSS, XSS2, XSS]
    assert_clean(page)
    page.close()


def test_the_router_fleet_view_shows_markup_as_text(browser):  # noqa: F811
    fleet = {"policy": XSS, "decisions_total": 1, "prefixes": {XSS: {XSS2: 1}},
             "sessions": {XSS2: {XSS: 2}},
             "backends": [{"name": XSS, "up": True, "in_flight": 0, "queued_blocks": 0.0,
                           "running": 0, "waiting": 0, "kv_usage": 0.5,
                           "num_gpu_blocks": None, "kv_cache_dtype": XSS2,
                           "kv_problem": f"/kv_cache_info has block_size={XSS!r}",
                           "indexed_blocks": {"GPU": 1, "CPU": 0, "DISK": 0},
                           "last_error": XSS}],
             "decisions": [{"time": 1000.0, "prefix": XSS, "prompt_blocks": 3, "chosen": XSS,
                            "session": XSS2, "candidates": [{"name": XSS2, "device_blocks": 1,
                                                             "tier_blocks": 0, "in_flight": 0,
                                                             "score": 1.5}]}]}

    def answer(path: str):
        return (200, fleet) if path == "/dashboard/fleet" else (404, {})

    page = open_page(browser, answer, path="/dashboard", page_file="fleet.html")
    page.wait_for_function("document.querySelector('#backend-table') !== null",
                           timeout=WAIT_MS)
    assert page.inner_text("#policy") == XSS
    row = page.locator("#backend-table tr[data-backend]")
    assert row.get_attribute("data-backend") == XSS
    assert "no prefix credit" in row.inner_text() and XSS2 in row.inner_text()
    assert XSS in page.inner_text("#decisions") and XSS2 in page.inner_text("#sessions")
    page.wait_for_timeout(200)
    assert page.evaluate("() => window.__pwned") is None
    assert page.evaluate(INJECTED) == 2  # dom.js, fleet.js
    assert page.errors == []
    page.close()
