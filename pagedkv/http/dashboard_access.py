"""Who may read the dashboard's data when the server has an API key.

The page (`GET /dashboard`) and its static assets hold no data and stay open. Its data routes
(`/dashboard/events`, `/dashboard/api/...`) show request ids, block hashes and traffic, so with
an API key they answer only:

- a request with `Authorization: Bearer <api key>` (curl, scripts), or
- a request carrying a dashboard session cookie. A browser's EventSource cannot send headers, so
  the page asks for the key once, sends it in a header to `POST /dashboard/session`, and gets
  back an `HttpOnly`, `SameSite=Strict`, `Path=/dashboard` cookie (`Secure` over https) that
  expires after `ttl_s` (15 minutes by default); the page keeps the key in memory only and renews
  the session before it expires. The cookie is `<expiry>.<HMAC-SHA256(expiry)>` under a random
  secret of this app: stateless, unforgeable without the secret, never valid in another server
  process or after a restart, and it never contains the key.

Without an API key everything is open, as before.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from http.cookies import SimpleCookie
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pagedkv.http.auth import bearer_key_matches, invalid_api_key

COOKIE_NAME = "pagedkv_dashboard"
DEFAULT_SESSION_TTL_S = 900.0
# Routes that show the engine's state: the API key or a session cookie when there is a key.
DATA_PREFIXES = ("/dashboard/events", "/dashboard/api/")


class DashboardAccess:
    """The dashboard's access check of one app (see the module docstring); `api_key` None: open.
    Holds this app's random session secret, never in a global."""

    def __init__(self, api_key: str | None, ttl_s: float = DEFAULT_SESSION_TTL_S) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
        self.api_key = api_key or None
        self.ttl_s = ttl_s
        self._secret = secrets.token_bytes(32)

    @property
    def required(self) -> bool:
        return self.api_key is not None

    def key_matches(self, authorization: bytes | str | None) -> bool:
        """True when `authorization` (a header value) is `Bearer <api key>`, or there is no key."""
        return not self.required or bearer_key_matches(authorization, self.api_key)

    def new_session(self, now: float | None = None) -> str:
        """A session token valid for `ttl_s` from `now`."""
        expiry = int((time.time() if now is None else now) + self.ttl_s)
        return f"{expiry}.{self._sign(expiry)}"

    def session_valid(self, token: str | None, now: float | None = None) -> bool:
        """True for an unexpired token of this app."""
        if not token or token.count(".") != 1:
            return False
        expiry, signature = token.split(".")
        if not expiry.isdigit() or not hmac.compare_digest(signature, self._sign(int(expiry))):
            return False
        return int(expiry) > (time.time() if now is None else now)

    def allows(self, authorization: bytes | str | None, cookie_header: bytes | str | None) -> bool:
        """Whether a request with these headers may read the dashboard's data."""
        return self.key_matches(authorization) or self.session_valid(session_cookie(cookie_header))

    def _sign(self, expiry: int) -> str:
        return hmac.new(self._secret, str(expiry).encode(), hashlib.sha256).hexdigest()


def session_cookie(cookie_header: bytes | str | None) -> str | None:
    """The dashboard session token in a Cookie header, None when absent or unparsable."""
    if not cookie_header:
        return None
    raw = cookie_header.decode("latin-1") if isinstance(cookie_header, bytes) else cookie_header
    jar = SimpleCookie()
    try:
        jar.load(raw)
    except Exception:  # a malformed Cookie header: no session (http.cookies raises CookieError)
        return None
    morsel = jar.get(COOKIE_NAME)
    return None if morsel is None else morsel.value


def make_session_router(access: DashboardAccess) -> APIRouter:
    """`/dashboard/session`: GET says whether a key is needed and whether this browser has a
    session; POST (with `Authorization: Bearer <key>`) sets the session cookie; DELETE drops it.
    See access.py."""
    router = APIRouter()

    def state(request: Request) -> dict[str, Any]:
        valid = access.allows(request.headers.get("authorization"),
                              request.headers.get("cookie"))
        return {"required": access.required, "valid": valid, "ttl_s": access.ttl_s}

    @router.get("/dashboard/session", include_in_schema=False)
    async def session_state(request: Request) -> JSONResponse:
        return JSONResponse(state(request))

    @router.post("/dashboard/session", include_in_schema=False)
    async def open_session(request: Request) -> JSONResponse:
        if not access.key_matches(request.headers.get("authorization")):
            raise invalid_api_key()
        response = JSONResponse({"required": access.required, "valid": True,
                                 "ttl_s": access.ttl_s})
        if access.required:
            response.set_cookie(COOKIE_NAME, access.new_session(), max_age=int(access.ttl_s),
                                path="/dashboard", httponly=True, samesite="strict",
                                secure=request.url.scheme == "https")
        return response

    @router.delete("/dashboard/session", include_in_schema=False)
    async def close_session() -> JSONResponse:
        response = JSONResponse({"required": access.required, "valid": False})
        response.delete_cookie(COOKIE_NAME, path="/dashboard", httponly=True,
                               samesite="strict")
        return response

    return router
