"""The dashboards' static pages in headless Chromium with every request answered by the test
(Playwright's routing): no server, no engine. `answer(path)` gives each API answer."""

from __future__ import annotations

import json
import mimetypes
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from pagedkv.server.dashboard.routes import STATIC_DIR

BASE = "http://dashboard.test"
Answer = tuple[int, object]  # (status, JSON body)


def open_page(browser, answer: Callable[[str], Answer], path: str = "/dashboard?offline",
              page_file: str = "index.html", viewport: dict | None = None):
    """A new page at BASE + `path`: the page file and /dashboard/static/* from the package,
    any other request answered by `answer(decoded path)`."""
    page = browser.new_page(viewport=viewport or {"width": 1400, "height": 1000})
    page.set_default_timeout(10_000)
    page.errors = []
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))

    def handle(route) -> None:
        url_path = unquote(urlsplit(route.request.url).path)
        if url_path == "/dashboard":
            route.fulfill(status=200, content_type="text/html",
                          body=(STATIC_DIR / page_file).read_text(encoding="utf-8"))
        elif url_path.startswith("/dashboard/static/"):
            file = STATIC_DIR / Path(url_path).name
            route.fulfill(status=200, body=file.read_bytes(),
                          content_type=mimetypes.guess_type(file.name)[0] or "text/plain")
        else:
            status, body = answer(url_path)
            route.fulfill(status=status, content_type="application/json", body=json.dumps(body))

    page.route("**/*", handle)
    page.goto(BASE + path)
    return page


def pool(num_blocks: int, used: dict[int, int] | None = None,
         cached: dict[int, str] | None = None) -> dict:
    """A pool snapshot: `used` block -> ref count, `cached` free block -> hash."""
    refs = [0] * num_blocks
    hashes: list[str | None] = [None] * num_blocks
    for block, ref in (used or {}).items():
        refs[block] = ref
    for block, block_hash in (cached or {}).items():
        hashes[block] = block_hash
    return {"refs": refs, "hashes": hashes, "free_order": sorted(cached or {}), "pins": {}}


def update(t: float, running=(), waiting=(), finished=(), **stats) -> dict:
    """One dashboard-log update with no block ops: its queues and stats."""
    return {"t": t, "ops": [], "finished": list(finished), "stats": dict(stats),
            "queues": {"running": [list(r) for r in running],
                       "waiting": [list(r) for r in waiting], "swapped": []}}
