"""pagedkv's pinned prefixes: POST /v1/pin and POST /v1/unpin (serving_pins.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from pagedkv.http.protocol import PinRequest, PinResponse
from pagedkv.server.routes import ERROR_RESPONSES
from pagedkv.server.serving_pins import pin

router = APIRouter()


@router.post("/v1/pin", response_model=PinResponse, responses=ERROR_RESPONSES)
async def pin_route(body: PinRequest, raw: Request) -> PinResponse:
    """Keep a prompt's prefix blocks cached (never evicted) until /v1/unpin."""
    return await pin(raw.app.state.serving, body)


@router.post("/v1/unpin", response_model=PinResponse, responses=ERROR_RESPONSES)
async def unpin_route(body: PinRequest, raw: Request) -> PinResponse:
    return await pin(raw.app.state.serving, body, unpin=True)
