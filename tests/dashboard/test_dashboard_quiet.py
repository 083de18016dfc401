"""The dashboard when little is happening (issue 37), in headless Chromium from replayed logs:
an idle hint; the prefix hit rate over the whole run beside the windowed one (which says when
its window saw no admission); a unit on every chart and axes drawn; no tier panel or tier
chart without a tier; the grid sized to the blocks in use."""

from __future__ import annotations

import pytest

from tests.dashboard.static_page import open_page, pool, update
from tests.dashboard.test_browser import browser  # noqa: F401 (Chromium, or a skip)

pytestmark = pytest.mark.timeout(120)

NUM_BLOCKS = 10_000
TIERS = [{"name": "host", "num_blocks": 30, "used_bytes": 1 << 20, "hits": 5, "misses": 5}]


def idle_log(num_updates: int = 30) -> dict:
    """A server that served 100 prompt tokens (80 from the cache) and is now idle."""
    snapshot = {"t": 1000.0, "block_size": 16, "parents": {}, "model": "tiny",
                "pools": [pool(NUM_BLOCKS, used={5: 1}, cached={i: f"{i:016x}"
                                                             for i in range(6, 40)})]}
    stats = {"prefix_cache_queries": 100, "prefix_cache_hits": 80, "kv_cache_usage": 0.0001}
    return {"snapshot": snapshot,
            "updates": [update(1000.0 + i, **stats) for i in range(num_updates)]}


def busy_log() -> dict:
    """Requests running, a host swap pool and a store tier, admissions in every update."""
    snapshot = {"t": 1000.0, "block_size": 16, "parents": {},
                "pools": [pool(64, used={1: 1, 2: 2}), pool(16, used={3: 1})]}
    updates = [update(1000.0 + i, running=[("r1", 40, 32, 16)], prefix_cache_queries=50 * i,
                      prefix_cache_hits=10 * i, kv_store_tiers=TIERS) for i in range(30)]
    return {"snapshot": snapshot, "updates": updates}


def replayed(browser, log: dict):  # noqa: F811
    page = open_page(browser, lambda path: (404, {}))
    page.wait_for_function("window.dashboard !== undefined")
    page.evaluate("(log) => window.dashboard.replayLog(log)", log)
    page.wait_for_function("document.getElementById('cv0').textContent !== ''")
    return page


def chart_titles(page) -> list[str]:
    return page.evaluate("() => [...document.querySelectorAll('.chart:not([hidden]) b')]"
                         ".map(b => b.textContent)")


def test_an_idle_server_says_so_and_shows_only_what_exists(browser, tmp_path):  # noqa: F811
    page = replayed(browser, idle_log())
    assert page.is_visible("#idle")
    assert "no request running or waiting" in page.text_content("#idle")
    # No admission in the window: said in words, beside the whole run's 80%.
    hit_rate = page.text_content("#cv0")
    assert "no admissions in window" in hit_rate and "whole run: 80.0%" in hit_rate
    titles = chart_titles(page)
    assert len(titles) == 6 and all(t.endswith(")") and "(" in t for t in titles), titles
    assert not any(t.startswith("store tier") for t in titles)
    assert not page.is_visible("#tiers-panel")
    # Axes: each visible chart has ink in its left margin (the y axis and its labels).
    inked = page.evaluate("""() => [...document.querySelectorAll('.chart:not([hidden]) canvas')]
      .map(cv => { const d = cv.getContext('2d').getImageData(0, 0, 44, cv.height).data;
                   let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; })""")
    assert all(n > 50 for n in inked), inked
    # The grid: the blocks used so far and some room, not 10,000 grey cells.
    shown = page.evaluate("() => { const g = document.getElementById('grid');"
                          " return g.width * g.height; }")
    assert 256 <= shown < 1000
    assert f"of {NUM_BLOCKS} shown" in page.text_content("#gridnote")
    assert page.locator("#counts [data-count=usable] b").inner_text() == str(NUM_BLOCKS - 1)
    page.screenshot(path=str(tmp_path / "idle.png"), full_page=True)
    assert page.errors == []
    page.close()


def test_a_busy_server_shows_its_tiers_and_windowed_rate(browser, tmp_path):  # noqa: F811
    page = replayed(browser, busy_log())
    assert not page.is_visible("#idle")
    assert page.is_visible("#tiers-panel") and "store: host" in page.text_content("#tiers")
    assert "host swap pool" in page.text_content("#tiers")
    titles = chart_titles(page)
    assert "store tier hit rate (%)" in titles and len(titles) == 7
    hit_rate = page.text_content("#cv0")
    assert "window: 20.0%" in hit_rate and "whole run: 20.0%" in hit_rate, hit_rate
    assert page.text_content("#gridnote") == ""  # 64 blocks: all shown
    page.screenshot(path=str(tmp_path / "busy.png"), full_page=True)
    assert page.errors == []
    page.close()


def test_a_window_shorter_than_a_second_is_labelled_in_tenths(browser):  # noqa: F811
    """A chart's time axis over its first moments reads "−0.3 s", not "−0 s"."""
    log = idle_log(0)
    log["updates"] = [update(1000.0 + 0.05 * i, prefix_cache_queries=i) for i in range(17)]
    page = open_page(browser, lambda path: (404, {}))
    page.wait_for_function("window.dashboard !== undefined")
    page.evaluate("""() => { window.drawn = []; const fill = CanvasRenderingContext2D.prototype.fillText;
      CanvasRenderingContext2D.prototype.fillText = function (text, ...rest) {
        window.drawn.push(String(text)); return fill.call(this, text, ...rest); }; }""")
    page.evaluate("(log) => window.dashboard.replayLog(log)", log)
    page.wait_for_function("window.drawn.some(t => t.endsWith(' s'))")
    spans = {t for t in page.evaluate("() => window.drawn") if t.startswith("−")}
    assert spans == {"−0.3 s"}, spans
    assert page.errors == []
    page.close()
