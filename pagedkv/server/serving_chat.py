"""POST /v1/chat/completions: messages -> the tokenizer's chat template -> one engine request."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.http.chunk_template import ChunkTemplate
from pagedkv.http.errors import APIError, error_body
from pagedkv.http.prompt_render import render_and_tokenize_chat
from pagedkv.http.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaToolCall,
    UsageInfo,
    usage_flags,
)
from pagedkv.http.request_fields import check_request_fields
from pagedkv.http.sse import SSEResponse, sse_event, sse_model_event
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.server.deltas import Delta, DeltaTracker, LogprobsFormatter
from pagedkv.server.kv_transfer import check_params, handoff, receive
from pagedkv.server.response_extras import ResponseExtras
from pagedkv.server.serving import (
    OpenAIServing,
    Usage,
    check_not_failed,
    collect_unless_disconnected,
    failure,
    random_id,
    run_unless_disconnected,
    streaming_response,
)
from pagedkv.server.serving_beam import beam_search_params
from pagedkv.server.tools import ToolChoice, tool_call_id


async def create_chat_completion(serving: OpenAIServing, req: ChatCompletionRequest,
                                 raw: Request) -> JSONResponse | SSEResponse:
    """POST /v1/chat/completions: the chat template applied to the messages, one engine
    request (n samples); a JSON body, or an SSE stream when `req.stream`. Raises APIError (400;
    404 for an unknown model) for bad input before anything is queued; a disconnect
    aborts the request."""
    arrival = time.monotonic()
    serving.check_common(req)
    check_request_fields(req, strict=serving.strict_request_fields)
    if req.top_logprobs and not req.logprobs:  # 0 without logprobs is fine (vLLM)
        raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
    if req.echo and req.prompt_logprobs is None and not req.stream:
        # vLLM: echo asks for the prompt's logprobs too (top_logprobs of them, rank-only at 0)
        req = req.model_copy(update={"prompt_logprobs": req.top_logprobs or 0})
    tools = ToolChoice.of(req, serving.tool_parser)
    text, ids = await serving.run_tokenizer(render_and_tokenize_chat, serving, req,
                                            tools.template_tools)
    prompt = serving.truncate(req, [ids])[0]
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = serving.max_tokens_for(requested, len(prompt), None)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    structured = await run_unless_disconnected(
        raw, serving.structured_outputs(req, tools.constraint))
    make_params = beam_search_params if req.use_beam_search else OpenAIServing.sampling_params
    params = make_params(serving, req, max_tokens=max_tokens, logprobs=logprobs,
                         structured_outputs=structured)
    serving.check_fits([prompt], params)
    check_params(req.kv_transfer_params, 1, req.stream)
    await receive(serving, req.kv_transfer_params, prompt, req.cache_salt)
    request_id = random_id("chatcmpl")  # the engine's (unique); the response's may be the client's
    streams = await serving.open_streams(request_id, [prompt], params, arrival=arrival,
                                         priority=req.priority, cache_salt=req.cache_salt)
    formatter = LogprobsFormatter(serving.tokenizer, req.top_logprobs or 0,
                                  as_token_ids=req.return_tokens_as_token_ids)
    extras = ResponseExtras.of(req, "chatcmpl", raw.headers.get("x-request-id"), request_id,
                               serving.system_fingerprint, [prompt], echo=_echoed(req),
                               prompt_text=text if req.return_prompt_text else None)
    if req.stream:
        body = _stream(serving, extras, streams, params, formatter,
                       usage_flags(req.stream_options), tools)
        return streaming_response(body, streams)
    final = await collect_unless_disconnected(raw, streams, collect_final(serving, streams))
    answer = _response(serving, extras, final, formatter, tools)
    answer.kv_transfer_params = await handoff(serving, req.kv_transfer_params, prompt,
                                              req.cache_salt)
    return JSONResponse(answer.model_dump(mode="json"))


def _echoed(req: ChatCompletionRequest) -> str:
    """What `echo` puts before the answer: the last message's text when it is the assistant's
    (the role the answer has), else nothing (vLLM's meaning)."""
    last = req.messages[-1]
    return last.text() if req.echo and last.role == "assistant" else ""


async def collect_final(serving: OpenAIServing, streams: list) -> RequestOutput:
    """The last output of a one-prompt request's streams (503 if it ended unfinished)."""
    final = None
    async for _, output in serving.iterate(streams):
        final = output
    if final is None:  # iterate raises first when a stream ends unfinished
        raise APIError("request aborted", status_code=503, type="server_unavailable")
    check_not_failed(final)
    return final


def _response(serving: OpenAIServing, extras: ResponseExtras, final: RequestOutput,
              formatter: LogprobsFormatter, tools: ToolChoice) -> ChatCompletionResponse:
    usage = Usage()
    usage.record(0, final)
    choices = []
    for c in sorted(final.outputs, key=lambda c: c.index):
        message = tools.message(extras.text(c.text))
        if extras.echo:
            message.content = extras.echo + (message.content or "")
        choices.append(ChatChoice(index=c.index, message=message,
                                  logprobs=formatter.chat(c, 0, len(c.token_ids)),
                                  finish_reason=tools.finish_reason(c.finish_reason, message),
                                  stop_reason=c.stop_reason, token_ids=extras.token_ids(c.token_ids)))
    return ChatCompletionResponse(id=extras.id, model=serving.model_name, choices=choices,
                                  system_fingerprint=extras.fingerprint, usage=usage.info(),
                                  prompt_logprobs=formatter.vllm_prompt_logprobs(
                                      final.prompt_logprobs, final.prompt_token_ids),
                                  prompt_token_ids=extras.prompt_ids(),
                                  prompt_text=extras.prompt_text)


def _chunk(serving: OpenAIServing, extras: ResponseExtras, choice: ChatStreamChoice,
           role: bool = False, usage: UsageInfo | None = None, created: int | None = None
           ) -> str:
    """One SSE chunk; a choice's `role` chunk (the first of each choice) carries the prompt's
    ids and text (when asked for), as vLLM's do; `usage`: the usage so far (continuous usage
    stats), left out when None; `created`: default now."""
    chunk = ChatCompletionChunk(id=extras.id, model=serving.model_name, choices=[choice],
                                system_fingerprint=extras.fingerprint, usage=usage,
                                prompt_token_ids=extras.prompt_ids() if role else None,
                                prompt_text=extras.prompt_text if role else None,
                                **({} if created is None else {"created": created}))
    delta = choice.delta
    if choice.logprobs is None and delta.tool_calls is None:  # no float, nothing nested
        unset = {name for name in ("role", "content", "tool_calls")
                 if getattr(delta, name) is None}  # OpenAI leaves unset delta fields out
        exclude: dict[str, Any] = {"choices": {"__all__": {"delta": unset}}}
        if usage is None:
            exclude["usage"] = True
        return sse_model_event(chunk, exclude)
    payload = chunk.model_dump(mode="json", exclude={"usage"} if usage is None else None)
    for item in payload["choices"]:  # OpenAI leaves unset delta fields out
        item["delta"] = _without_none(item["delta"])
    return sse_event(payload)


def _plain_template(serving: OpenAIServing, extras: ResponseExtras) -> ChunkTemplate | None:
    """The template of a chunk that carries one choice's content delta and nothing else:
    holes for `created`, the choice's index and the content."""
    def render(created: int, index: int, content: str) -> str:
        return _chunk(serving, extras, ChatStreamChoice(index=index,
                                                        delta=ChatDelta(content=content)),
                      created=created)
    return ChunkTemplate.make(render)


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def _tool_deltas(tools: ToolChoice, comp: CompletionOutput, delta: Delta,
                 started: bool) -> ChatDelta | None:
    """The delta of a choice whose output becomes tool calls (None: nothing to send yet).
    A named function streams its arguments as they come; `auto` and `required` hold the
    text until it ends, then send the content and every call at once."""
    if tools.mode == "named":
        call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta.text))
        if not started:
            call.id, call.type, call.function.name = tool_call_id(), "function", tools.function_name
        elif not delta.text:
            return ChatDelta() if delta.finish_reason else None
        return ChatDelta(tool_calls=[call])
    if delta.finish_reason is None:
        return None
    message = tools.message(comp.text)
    calls = [DeltaToolCall(index=i, id=c.id, type="function",
                           function=DeltaFunctionCall(name=c.function.name,
                                                      arguments=c.function.arguments))
             for i, c in enumerate(message.tool_calls)]
    return ChatDelta(content=message.content, tool_calls=calls or None)


async def _stream(serving: OpenAIServing, extras: ResponseExtras, streams: list,
                  params: SamplingParams, formatter: LogprobsFormatter,
                  usage_wanted: tuple[bool, bool], tools: ToolChoice) -> AsyncIterator[str]:
    """SSE chunks: a role chunk per choice once the prompt is processed (with the first
    output, as vLLM sends it, so clients measure a true time to first token), content or tool
    call deltas, the finish, usage, [DONE]. `usage_wanted`: (a final usage chunk, the usage so
    far on every chunk).
    Sent by `OpenAIStreamResponse`, which closes the streams (aborting unfinished requests)."""
    tracker = DeltaTracker(params.n, params.stop_strings, params.include_stop_str_in_output)
    usage = Usage()
    role_sent = False
    tool_started: set[int] = set()
    include_usage, continuous = usage_wanted
    # The usual chunk (a content delta only) from a template; None: every chunk through pydantic.
    plain = None if continuous or extras.prompt_token_ids is not None else _plain_template(
        serving, extras)
    async for _, output in serving.iterate(streams):
        usage.record(0, output)
        so_far = usage.info() if continuous else None
        if output.error:
            err = failure(output, "messages")
            yield sse_event(error_body(err.message, err.type, err.param, err.code))
            continue
        if not role_sent:
            role_sent = True
            for index in range(params.n):
                yield _chunk(serving, extras, ChatStreamChoice(
                    index=index, delta=ChatDelta(role="assistant", content="")),
                    role=True, usage=so_far)
                if extras.echo:
                    yield _chunk(serving, extras, ChatStreamChoice(
                        index=index, delta=ChatDelta(content=extras.echo)), usage=so_far)
        for comp in output.outputs:
            delta = tracker.delta(comp.index, comp)
            if delta is None:
                continue
            start = delta.token_start
            chat_delta: ChatDelta | None = ChatDelta(content=extras.text(delta.text))
            if tools.mode in ("named", "auto", "required"):
                chat_delta = _tool_deltas(tools, comp, delta, comp.index in tool_started)
                if chat_delta is None:
                    continue
                tool_started.add(comp.index)
                if tools.buffers_stream:
                    start = 0
            finish = delta.finish_reason
            if finish is not None and tools.buffers_stream:
                finish = "tool_calls" if chat_delta.tool_calls and finish == "stop" else finish
            logprobs = formatter.chat(comp, start, delta.token_end)
            if (plain is not None and logprobs is None and finish is None
                    and delta.stop_reason is None and chat_delta.tool_calls is None
                    and chat_delta.role is None and chat_delta.content is not None):
                yield plain.event(int(time.time()), comp.index, chat_delta.content)
                continue
            yield _chunk(serving, extras, ChatStreamChoice(
                index=comp.index, delta=chat_delta, logprobs=logprobs,
                finish_reason=finish, stop_reason=delta.stop_reason,
                token_ids=extras.token_ids(comp.token_ids_view[delta.token_start:delta.token_end])),
                usage=so_far)
    if include_usage:
        chunk = ChatCompletionChunk(id=extras.id, model=serving.model_name, choices=[],
                                    system_fingerprint=extras.fingerprint, usage=usage.info())
        yield sse_event(chunk.model_dump(mode="json"))
