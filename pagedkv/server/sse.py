"""Server-Sent Events framing of OpenAI's streaming answers."""

from __future__ import annotations

import json
from typing import Any

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: dict[str, Any]) -> str:
    """One `data: {...}` event (compact JSON, no NaN or infinity)."""
    return f"data: {json.dumps(payload, separators=(',', ':'), allow_nan=False)}\n\n"


def sse_done() -> str:
    """The last event of every stream."""
    return "data: [DONE]\n\n"
