"""The prefill/decode hand-off's wire: vLLM's, as its disaggregated-prefill proxy speaks it.

The prefill request is the client's with `max_tokens` 1 (and `max_completion_tokens` 1 on
chat), no stream, and `kv_transfer_params` asking the producer to keep the prompt's KV for a
remote decode (`REMOTE_DECODE`). The producer's answer carries a top-level
`kv_transfer_params` object naming where the KV is; the decode request is the client's own
(its stream flag, `max_tokens` and the rest unchanged) with that object copied in verbatim.
"""

from __future__ import annotations

import json
from typing import Any

REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}
CHAT_PATH = "/v1/chat/completions"
# Fields of the client's request that would make a one-token prefill invalid or streamed.
_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens")


def parse_object(body: bytes) -> dict[str, Any] | None:
    """`body` as a JSON object; None when it is not one (the backend answers the 400)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def prefill_body(request: dict[str, Any], path: str) -> bytes:
    """The prefill hop's body for the client's `request` (a JSON object) sent to `path`."""
    body = {k: v for k, v in request.items() if k not in _DROPPED_FOR_PREFILL}
    body.update(max_tokens=1, stream=False, kv_transfer_params=dict(REMOTE_DECODE))
    if path == CHAT_PATH:
        body["max_completion_tokens"] = 1
    return json.dumps(body).encode()


def decode_body(request: dict[str, Any], transfer_params: dict[str, Any]) -> bytes:
    """The decode hop's body: the client's `request` with the producer's `transfer_params`."""
    return json.dumps({**request, "kv_transfer_params": transfer_params}).encode()


def transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The top-level `kv_transfer_params` object of a producer's answer; None when it has
    none (a server without a producer role, or an answer that is not a JSON object)."""
    value = parse_object(answer)
    params = None if value is None else value.get("kv_transfer_params")
    return params if isinstance(params, dict) and params else None
