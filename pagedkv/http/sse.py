"""Server-Sent Events framing of OpenAI's streaming answers, and the response that sends them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from pydantic.main import IncEx
from pydantic_core import PydanticSerializationError
from starlette.types import Receive, Scope, Send

from pagedkv.http.errors import APIError, error_body

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: dict[str, Any]) -> str:
    """One `data: {...}` event (compact JSON, no NaN or infinity)."""
    return f"data: {json.dumps(payload, separators=(',', ':'), allow_nan=False)}\n\n"


def sse_model_event(model: BaseModel, exclude: IncEx | None = None) -> str:
    """`sse_event(model.model_dump(mode="json", exclude=exclude))`, byte for byte, with the JSON
    written by pydantic's serializer in one pass (about a third of the dict-then-`json.dumps`
    time for a streamed chunk). Only for a model that holds no float: pydantic writes a float's
    digits, and a NaN, otherwise than `json.dumps`."""
    try:
        text: str | None = model.model_dump_json(ensure_ascii=True, exclude=exclude)
    except PydanticSerializationError:  # a lone surrogate, which json.dumps escapes
        text = None
    if text is None or "\x7f" in text:  # DEL, which json.dumps escapes and pydantic does not
        return sse_event(model.model_dump(mode="json", exclude=exclude))
    return f"data: {text}\n\n"


def sse_done() -> str:
    """The last event of every stream."""
    return "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that calls `on_close` however it ends: finished, client
    gone, or cancelled before the body generator even started (whose own finally blocks would
    then never run). `on_close` must be idempotent."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class OpenAIStreamResponse(SSEResponse):
    """An OpenAI streaming answer: `events` (each a whole `data: ...` event), an APIError raised
    by them as an error event, then `data: [DONE]`, sent as the last body. `on_close`
    (idempotent) runs as soon as the events end, and however the response ends.

    The framing is done here, in the loop that sends, rather than by another generator around
    `events`: each event costs one pass through one generator, then one `send`."""

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        events = self.body_iterator
        try:
            async for event in events:
                await send({"type": "http.response.body", "body": event.encode(),
                            "more_body": True})
        except APIError as exc:
            error = sse_event(error_body(exc.message, exc.type, exc.param, exc.code))
            await send({"type": "http.response.body", "body": error.encode(), "more_body": True})
        finally:
            self.on_close()
            await events.aclose()
        await send({"type": "http.response.body", "body": sse_done().encode(),
                    "more_body": False})
