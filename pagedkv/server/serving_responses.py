"""POST /v1/responses: OpenAI's Responses API, text in and text out (`responses_protocol.py`).

The request runs as a chat completion (one sample, the chat template). The JSON answer is a
`response` object with one assistant `message` holding one `output_text`; `status` is
"incomplete" (reason `max_output_tokens`) when the length limit ended it. Streaming sends
OpenAI's events, each `event: <type>` + `data: {..., "sequence_number": i}`:
response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta (one per new text), then
response.output_text.done, response.content_part.done, response.output_item.done and
response.completed with the whole response, whose `status` may be "incomplete": vLLM 0.32 ends
every stream so, and the openai SDK's `responses.stream()` helper needs that event (it raises
on a stream without one).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedkv.engine.outputs import RequestOutput
from pagedkv.http.errors import APIError
from pagedkv.http.prompt_render import tokenize_chat
from pagedkv.http.request_fields import check_request_fields
from pagedkv.http.sse import SSEResponse
from pagedkv.server.deltas import DeltaTracker
from pagedkv.server.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from pagedkv.server.serving import (
    OpenAIServing,
    check_not_failed,
    collect_unless_disconnected,
    streaming_response,
)
from pagedkv.server.serving_chat import collect_final


async def create_response(serving: OpenAIServing, req: ResponsesRequest,
                          raw: Request) -> JSONResponse | SSEResponse:
    """POST /v1/responses. Raises APIError (400; 404 for an unknown model) before anything
    is queued; a disconnect aborts the request."""
    arrival = time.monotonic()
    check_request_fields(req, strict=serving.strict_request_fields)
    if req.previous_response_id is not None:  # nothing is stored (vLLM's unknown-id answer)
        raise APIError(f"Response with id '{req.previous_response_id}' not found.",
                       status_code=404, param="previous_response_id")
    chat = req.to_chat()
    serving.check_common(chat)
    if req.truncation == "auto":  # OpenAI's: drop the input's start so the answer fits
        chat.truncate_prompt_tokens = max(serving.max_model_len - (req.max_output_tokens or 1), 1)
    prompt = serving.truncate(chat, [await serving.run_tokenizer(tokenize_chat, serving, chat)])[0]
    max_tokens = serving.max_tokens_for(req.max_output_tokens, len(prompt), None)
    params = serving.sampling_params(chat, max_tokens=max_tokens, logprobs=None)
    serving.check_fits([prompt], params)
    response_id = f"resp_{uuid.uuid4().hex}"
    streams = await serving.open_streams(response_id, [prompt], params, arrival=arrival)
    message_id = f"msg_{uuid.uuid4().hex}"
    if req.stream:
        body = _stream(serving, req, response_id, message_id, streams, params)
        return streaming_response(body, streams)
    final = await collect_unless_disconnected(raw, streams, collect_final(serving, streams))
    return JSONResponse(_response(serving, req, response_id, message_id, final)
                        .model_dump(mode="json"))


def _response(serving: OpenAIServing, req: ResponsesRequest, response_id: str, message_id: str,
              final: RequestOutput | None) -> ResponseObject:
    """The response object: in progress (no output yet) when `final` is None."""
    verbosity = req.text.verbosity if req.text is not None else None
    common = dict(id=response_id, model=serving.model_name, instructions=req.instructions,
                  max_output_tokens=req.max_output_tokens, temperature=req.temperature,
                  top_p=req.top_p, user=req.user, metadata=req.metadata or {},
                  system_fingerprint=serving.system_fingerprint,
                  text={"format": {"type": "text"}, "verbosity": verbosity or "medium"},
                  prompt_cache_key=req.prompt_cache_key, truncation=req.truncation or "disabled",
                  prompt_cache_retention=req.prompt_cache_retention,
                  safety_identifier=req.safety_identifier)
    if final is None:
        return ResponseObject(status="in_progress", **common)
    comp = final.outputs[0]
    cut = comp.finish_reason == "length"
    status = "incomplete" if cut else "completed"
    usage = ResponseUsage(input_tokens=len(final.prompt_token_ids),
                          input_tokens_details=InputTokensDetails(
                              cached_tokens=final.num_cached_tokens),
                          output_tokens=len(comp.token_ids),
                          total_tokens=len(final.prompt_token_ids) + len(comp.token_ids))
    return ResponseObject(
        status=status, usage=usage, completed_at=int(time.time()) if not cut else None,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None,
        output=[OutputMessage(id=message_id, status=status, content=[OutputText(text=comp.text)])],
        **common)


def _event(kind: str, sequence: int, **payload: Any) -> str:
    data = {"type": kind, "sequence_number": sequence, **payload}
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), allow_nan=False)}\n\n"


async def _stream(serving: OpenAIServing, req: ResponsesRequest, response_id: str,
                  message_id: str, streams: list, params) -> AsyncIterator[str]:
    """The Responses API's streaming events (module docstring). Sent by `OpenAIStreamResponse`."""
    seq = iter(range(1 << 62))
    start = _response(serving, req, response_id, message_id, None).model_dump(mode="json")
    yield _event("response.created", next(seq), response=start)
    yield _event("response.in_progress", next(seq), response=start)
    item = OutputMessage(id=message_id, status="in_progress", content=[]).model_dump(mode="json")
    yield _event("response.output_item.added", next(seq), output_index=0, item=item)
    part = OutputText(text="").model_dump(mode="json")
    yield _event("response.content_part.added", next(seq), item_id=message_id, output_index=0,
                 content_index=0, part=part)
    tracker = DeltaTracker(1, params.stop_strings, params.include_stop_str_in_output)
    final = None
    async for _, output in serving.iterate(streams):
        final = output
        check_not_failed(output)
        delta = tracker.delta(0, output.outputs[0])
        if delta is not None and delta.text:
            yield _event("response.output_text.delta", next(seq), item_id=message_id,
                         output_index=0, content_index=0, delta=delta.text, logprobs=[])
    done = _response(serving, req, response_id, message_id, final).model_dump(mode="json")
    message = done["output"][0]
    text = message["content"][0]["text"]
    yield _event("response.output_text.done", next(seq), item_id=message_id, output_index=0,
                 content_index=0, text=text, logprobs=[])
    yield _event("response.content_part.done", next(seq), item_id=message_id, output_index=0,
                 content_index=0, part=message["content"][0])
    yield _event("response.output_item.done", next(seq), output_index=0, item=message)
    yield _event("response.completed", next(seq), response=done)
