"""With an API key, the dashboard's data (its SSE feed, block tables, explanations) is closed
to anyone without the key or a session cookie obtained with it; the page itself stays open, and
without a key everything is open (issue 23; pagedkv/http/dashboard_access.py)."""

from __future__ import annotations

import httpx
import pytest

from pagedkv.http.dashboard_access import COOKIE_NAME, DashboardAccess, session_cookie
from tests.dashboard.conftest import make_engine, serving, sse_events

pytestmark = pytest.mark.timeout(120)

DATA_ROUTES = ("/dashboard/events", "/dashboard/api/request/r1", "/dashboard/api/explain/r1")


def test_session_tokens_expire_and_belong_to_one_app():
    access = DashboardAccess("sekrit", ttl_s=60)
    token = access.new_session(now=1000.0)
    assert access.session_valid(token, now=1059.0)
    assert not access.session_valid(token, now=1060.0)  # expired
    expiry, signature = token.split(".")
    assert not access.session_valid(f"{int(expiry) + 3600}.{signature}", now=1000.0)  # extended
    assert not access.session_valid(token[:-1] + ("0" if token[-1] != "0" else "1"), now=1000.0)
    assert not DashboardAccess("sekrit", ttl_s=60).session_valid(token, now=1000.0)  # other app
    for bad in (None, "", "x", "1.2.3", "abc.def", f".{signature}"):
        assert not access.session_valid(bad, now=1000.0)
    assert "sekrit" not in token
    assert access.allows("Bearer sekrit", None) and access.allows("bearer sekrit", "")
    assert not access.allows("Bearer wrong", None) and not access.allows(None, None)
    assert session_cookie(f"a=1; {COOKIE_NAME}={token}") == token
    assert session_cookie('bad"cookie') is None and session_cookie(b"") is None
    assert DashboardAccess(None).allows(None, None)  # no key: open
    with pytest.raises(ValueError, match="ttl_s"):
        DashboardAccess("k", ttl_s=0)


def test_dashboard_data_needs_the_key_or_a_session(tiny_llama):
    engine = make_engine(tiny_llama)
    try:
        with serving(engine, api_key="sekrit") as url:
            assert httpx.get(url + "/dashboard").status_code == 200  # the page: no data
            assert httpx.get(url + "/dashboard/static/app.js").status_code == 200
            for route in DATA_ROUTES:
                r = httpx.get(url + route)
                assert r.status_code == 401, route
                assert r.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(url + "/dashboard/session").json() == {
                "required": True, "valid": False, "ttl_s": 900.0}
            assert httpx.post(url + "/dashboard/session").status_code == 401
            wrong = httpx.post(url + "/dashboard/session",
                               headers={"Authorization": "Bearer wrong"})
            assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
            forged = httpx.get(url + "/dashboard/api/request/r1",
                               cookies={COOKIE_NAME: "9999999999.00"})
            assert forged.status_code == 401

            with httpx.Client(base_url=url, timeout=30) as browser:
                ok = browser.post("/dashboard/session", headers={"Authorization": "Bearer sekrit"})
                assert ok.status_code == 200
                cookie = ok.headers["set-cookie"]
                for attribute in ("HttpOnly", "SameSite=strict", "Path=/dashboard",
                                  "Max-Age=900"):
                    assert attribute.lower() in cookie.lower(), cookie
                assert "sekrit" not in cookie
                assert browser.get("/dashboard/session").json()["valid"] is True
                # The cookie opens the data routes (a 404 is past the check).
                assert browser.get("/dashboard/api/request/r1").status_code == 404
                with browser.stream("GET", "/dashboard/events") as resp:
                    assert resp.status_code == 200
                    assert next(sse_events(resp))[0] == "snapshot"
                # It does not open the /v1 API: that needs the key itself.
                assert browser.post("/v1/cache/explain",
                                    json={"prompt": [1, 2, 3, 4, 5]}).status_code == 401
                browser.delete("/dashboard/session")
                assert browser.get("/dashboard/api/request/r1").status_code == 401

            # The key in a header works too (curl, scripts).
            auth = {"Authorization": "Bearer sekrit"}
            assert httpx.get(url + "/dashboard/api/request/r1", headers=auth).status_code == 404
    finally:
        engine.shutdown()


def test_without_a_key_the_dashboard_is_open(tiny_llama):
    engine = make_engine(tiny_llama)
    try:
        with serving(engine) as url:
            assert httpx.get(url + "/dashboard/session").json()["required"] is False
            assert httpx.get(url + "/dashboard/api/request/r1").status_code == 404
            opened = httpx.post(url + "/dashboard/session")
            assert opened.status_code == 200 and "set-cookie" not in opened.headers
    finally:
        engine.shutdown()
