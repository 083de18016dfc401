"""POST /v1/chat/completions: messages -> the tokenizer's chat template -> one engine request."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedkv.engine.outputs import RequestOutput
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.server.deltas import DeltaTracker, LogprobsFormatter
from pagedkv.server.errors import APIError, error_body
from pagedkv.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    ChatStreamChoice,
)
from pagedkv.server.serving import (
    OpenAIServing,
    Usage,
    check_not_failed,
    close_all,
    random_id,
    run_unless_disconnected,
)
from pagedkv.server.sse import SSEResponse, sse_event, sse_stream


def tokenize_chat(serving: OpenAIServing, req: ChatCompletionRequest) -> list[int]:
    """The chat template applied to the messages, tokenized without adding special tokens
    (the template writes them), as vLLM does. 400 when the model has no chat template."""
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = serving.tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt)
    except ValueError as exc:
        raise APIError(f"cannot apply the chat template: {exc}", param="messages") from exc
    return serving.tokenizer.encode(text, add_special_tokens=False)


async def create_chat_completion(serving: OpenAIServing, req: ChatCompletionRequest,
                                 raw: Request) -> JSONResponse | SSEResponse:
    arrival = time.monotonic()
    serving.check_common(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
    prompt = tokenize_chat(serving, req)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = serving.max_tokens_for(requested, len(prompt), None)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = serving.sampling_params(req, max_tokens=max_tokens, logprobs=logprobs,
                                     structured_outputs=await serving.structured_outputs(req))
    serving.check_fits([prompt], params)
    request_id = random_id("chatcmpl")
    streams = await serving.open_streams(request_id, [prompt], params, arrival=arrival,
                                         priority=req.priority, cache_salt=req.cache_salt)
    formatter = LogprobsFormatter(serving.tokenizer, req.top_logprobs or 0,
                                  as_token_ids=req.return_tokens_as_token_ids)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(serving, request_id, streams, params, formatter, include_usage)
        return SSEResponse(sse_stream(body, on_exit=lambda: close_all(streams)),
                           on_close=lambda: close_all(streams))
    try:
        final = await run_unless_disconnected(raw, _collect(serving, streams))
    finally:
        close_all(streams)
    return JSONResponse(_response(serving, request_id, final, formatter).model_dump(mode="json"))


async def _collect(serving: OpenAIServing, streams: list) -> RequestOutput:
    final = None
    async for _, output in serving.iterate(streams):
        final = output
    if final is None:  # iterate raises first when a stream ends unfinished
        raise APIError("request aborted", status_code=503, type="server_unavailable")
    check_not_failed(final)
    return final


def _response(serving: OpenAIServing, request_id: str, final: RequestOutput,
              formatter: LogprobsFormatter) -> ChatCompletionResponse:
    usage = Usage()
    usage.record(0, final)
    choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                          logprobs=formatter.chat(c, 0, len(c.token_ids)),
                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)
               for c in sorted(final.outputs, key=lambda c: c.index)]
    return ChatCompletionResponse(id=request_id, model=serving.model_name, choices=choices,
                                  usage=usage.info(),
                                  prompt_logprobs=formatter.vllm_prompt_logprobs(
                                      final.prompt_logprobs))


def _chunk(serving: OpenAIServing, request_id: str, choice: ChatStreamChoice) -> str:
    chunk = ChatCompletionChunk(id=request_id, model=serving.model_name, choices=[choice])
    payload = chunk.model_dump(mode="json", exclude={"usage"})
    for item in payload["choices"]:  # OpenAI leaves unset delta fields out
        item["delta"] = {k: v for k, v in item["delta"].items() if v is not None}
    return sse_event(payload)


async def _stream(serving: OpenAIServing, request_id: str, streams: list,
                  params: SamplingParams, formatter: LogprobsFormatter,
                  include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks: a role chunk per choice, content deltas, the finish, usage, [DONE].
    Wrapped by `sse_stream`, which closes the streams (aborting unfinished requests)."""
    tracker = DeltaTracker(params.n, params.stop_strings, params.include_stop_str_in_output)
    usage = Usage()
    for index in range(params.n):
        yield _chunk(serving, request_id, ChatStreamChoice(
            index=index, delta=ChatDelta(role="assistant", content="")))
    async for _, output in serving.iterate(streams):
        usage.record(0, output)
        if output.error:
            yield sse_event(error_body(output.error, "invalid_request_error", "messages"))
            continue
        for comp in output.outputs:
            delta = tracker.delta(comp.index, comp)
            if delta is None:
                continue
            yield _chunk(serving, request_id, ChatStreamChoice(
                index=comp.index, delta=ChatDelta(content=delta.text),
                logprobs=formatter.chat(comp, delta.token_start, delta.token_end),
                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason))
    if include_usage:
        chunk = ChatCompletionChunk(id=request_id, model=serving.model_name, choices=[],
                                    usage=usage.info())
        yield sse_event(chunk.model_dump(mode="json"))
