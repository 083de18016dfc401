"""OpenAI-style error bodies and the exception handlers that make every bad input a 4xx.

Every error answer is `{"error": {"message", "type", "param", "code"}}`; the server's `code` is
the HTTP status as an integer (vLLM's `ErrorInfo.code`; the kind of error is in `type`):

| cause                                                  | status | type                   |
| ------------------------------------------------------ | ------ | ---------------------- |
| malformed JSON, wrong type, value out of range         | 400    | invalid_request_error  |
| prompt longer than max_model_len, n that never fits    | 400    | invalid_request_error  |
| unknown model (OpenAI's choice)                        | 404    | invalid_request_error  |
| missing or wrong API key on /v1 routes                 | 401    | authentication_error   |
| too many requests in flight                            | 503    | server_overloaded      |
| unknown route / wrong method                           | 404/405| invalid_request_error  |
| a bug (any other exception)                            | 500    | internal_server_error  |
"""

from __future__ import annotations

import logging
import reprlib
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("pagedkv.server")



def _short_repr_maker() -> reprlib.Repr:
    """A repr that shows a huge list, dict or string by its first entries (cost bounded)."""
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict = 3, 12, 8
    short.maxstring = short.maxother = short.maxlong = 80
    return short


_SHORT = _short_repr_maker()


class APIError(Exception):
    """An error answered with `status_code` and an OpenAI-style body. The body's `code` is
    `status_code` (an integer, as vLLM's) unless `code` names one (the router's own errors)."""

    def __init__(self, message: str, *, status_code: int = 400,
                 type: str = "invalid_request_error", param: str | None = None,
                 code: int | str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = status_code if code is None else code


def error_body(message: str, type: str, param: str | None = None,
               code: int | str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    body = error_body(exc.message, exc.type, exc.param, exc.code)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def model_not_found(name: str, code: str | None = "model_not_found") -> APIError:
    """404 for an unknown model; `code=None` gives vLLM's integer code (the server's)."""
    return APIError(f"The model `{name}` does not exist.", status_code=404,
                    param="model", code=code)


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message and the offending parameter for pydantic's error list."""
    parts, param = [], None
    for err in exc.errors()[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        if err.get("type") == "json_invalid":
            parts.append(f"malformed JSON: {err.get('msg')}")
            param = None
        else:
            shown = _SHORT.repr(err.get("input"))  # a huge list costs its first entries only
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            parts.append(f"{where or 'body'}: {err.get('msg')} (got {shown})")
    return "; ".join(parts) or "invalid request", param


def _phrase(status_code: int) -> str:
    try:
        return HTTPStatus(status_code).phrase
    except ValueError:
        return f"HTTP {status_code}"


def install_error_handlers(app: FastAPI) -> None:
    """Map validation errors, ValueError, APIError and HTTP errors to OpenAI-style bodies."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc)
        return error_response(APIError(message, param=param))

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(APIError(str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else _phrase(exc.status_code)
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
        return error_response(APIError(message, status_code=exc.status_code, type=kind))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error: %s", exc)
        return error_response(APIError(f"internal error: {type(exc).__name__}: {exc}",
                                       status_code=500, type="internal_server_error"))
