"""The router's dashboard (issue 23): `GET /dashboard` (the fleet page, shipped with the server's
dashboard assets) and `GET /dashboard/fleet` (its JSON: each backend's health, load and KV usage,
the prefix blocks the router believes it holds per medium, which shared prefixes (first block
hash) and sessions went where, and the recent routing decisions with every candidate's score).
The page polls the JSON once a second; nothing is computed while no one asks. With an API key,
/dashboard/fleet needs the key or a dashboard session cookie, as the server's dashboard data
(pagedkv/http/dashboard_access.py; `/dashboard/session` here too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse

from pagedkv.events.wire import MEDIUM_DEVICE, MEDIUM_DISK, MEDIUM_HOST
from pagedkv.http.auth import invalid_api_key
from pagedkv.http.dashboard_access import DashboardAccess, make_session_router
from pagedkv.http.errors import APIError
from pagedkv.router.router import Router

STATIC_DIR = Path(__file__).resolve().parents[1] / "server" / "dashboard" / "static"
SCRIPTS = ("dom", "fleet")  # the fleet page's scripts in STATIC_DIR


def fleet_state(router: Router, max_decisions: int = 100) -> dict[str, Any]:
    """The JSON of GET /dashboard/fleet (a new dict)."""
    decisions = list(router.decisions.records)
    placements: dict[str, dict[str, int]] = {}
    sessions: dict[str, dict[str, int]] = {}
    for d in decisions:
        if d["prefix"]:
            where = placements.setdefault(d["prefix"], {})
            where[d["chosen"]] = where.get(d["chosen"], 0) + 1
        if d["session"]:
            where = sessions.setdefault(d["session"], {})
            where[d["chosen"]] = where.get(d["chosen"], 0) + 1
    media = (MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK)
    backends = [{
        "name": b.name, "role": b.role, "up": b.up, "in_flight": b.in_flight, "queued_blocks": b.queued_blocks,
        "running": b.load.running, "waiting": b.load.waiting, "kv_usage": b.load.kv_usage,
        "num_gpu_blocks": (b.kv_info or {}).get("num_gpu_blocks"),
        "kv_cache_dtype": (b.kv_info or {}).get("kv_cache_dtype"),
        "indexed_blocks": {m: router.index.num_blocks(b.name, m) for m in media},
        "kv_problem": b.kv_problem, "last_error": b.last_error} for b in router.backends]
    return {"policy": router.policy.name, "backends": backends,
            "decisions_total": router.decisions.total,
            "decisions": decisions[-max_decisions:], "prefixes": placements,
            "sessions": sessions}


def make_router_dashboard(router: Router, access: DashboardAccess | None = None) -> APIRouter:
    """The routes above over `router`; `access` (None: open) guards /dashboard/fleet."""
    routes = APIRouter()
    access = access or DashboardAccess(None)
    routes.include_router(make_session_router(access))

    @routes.get("/dashboard", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse((STATIC_DIR / "fleet.html").read_text(encoding="utf-8"))

    @routes.get("/dashboard/static/{name}.js", include_in_schema=False)
    async def script(name: str) -> HTMLResponse:
        if name not in SCRIPTS:
            raise APIError(f"no dashboard asset {name!r}", status_code=404, type="not_found")
        return HTMLResponse((STATIC_DIR / f"{name}.js").read_text(encoding="utf-8"),
                            media_type="text/javascript")

    @routes.get("/dashboard/static/style.css", include_in_schema=False)
    async def style() -> HTMLResponse:
        return HTMLResponse((STATIC_DIR / "style.css").read_text(encoding="utf-8"),
                            media_type="text/css")

    @routes.get("/dashboard/fleet", include_in_schema=False)
    async def fleet(request: Request) -> JSONResponse:
        if not access.allows(request.headers.get("authorization"),
                             request.headers.get("cookie")):
            raise invalid_api_key()
        return JSONResponse(fleet_state(router))

    return routes
