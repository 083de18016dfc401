"""The one API-key check, shared by `pagedkv serve` and `pagedkv router`.

A request is authorized when its `Authorization` header is `Bearer <key>`: the scheme in any
case (HTTP auth schemes are case-insensitive, RFC 9110 section 11.1), the key compared in
constant time. Anything else is answered with `invalid_api_key()` (a 401, OpenAI-style).
"""

from __future__ import annotations

import hmac

from pagedkv.http.errors import APIError


def bearer_key_matches(header: bytes | str | None, expected: bytes | str) -> bool:
    """True when `header` (an Authorization header's value) is `Bearer <expected>`."""
    if header is None:
        return False
    raw = header.encode("latin-1", "replace") if isinstance(header, str) else header
    want = expected.encode() if isinstance(expected, str) else expected
    scheme, _, key = raw.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), want)


def invalid_api_key() -> APIError:
    """The 401 answered to a request without the right key."""
    return APIError("Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                    status_code=401, type="authentication_error", code="invalid_api_key")
