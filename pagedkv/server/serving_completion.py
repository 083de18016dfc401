"""POST /v1/completions: a prompt (string, token ids, or a list of either) -> text."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedkv.engine.outputs import RequestOutput
from pagedkv.server.deltas import DeltaTracker, LogprobsFormatter
from pagedkv.server.errors import APIError, error_body
from pagedkv.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from pagedkv.server.serving import (
    OpenAIServing,
    Usage,
    check_not_failed,
    close_all,
    failure,
    random_id,
    run_unless_disconnected,
)
from pagedkv.server.sse import SSEResponse, sse_event, sse_stream

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def tokenize_prompts(serving: OpenAIServing, prompt: str | list) -> list[list[int]]:
    """The prompt(s) of a completions request as token-id lists (strings get the BOS token).
    Runs in a tokenizer thread (`serving.run_tokenizer`)."""
    if isinstance(prompt, str):
        return [serving.encode_prompt(prompt, add_special_tokens=True)]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [serving.encode_prompt(p, add_special_tokens=True) for p in prompt]
    return [list(p) for p in prompt]


async def create_completion(serving: OpenAIServing, req: CompletionRequest,
                            raw: Request) -> JSONResponse | SSEResponse:
    """POST /v1/completions: one engine request per prompt (n samples each); a JSON body, or
    an SSE stream when `req.stream`. Raises APIError (400; 404 for an unknown model) for bad
    input before anything is queued; a client that disconnects aborts its requests (their
    blocks return at once)."""
    arrival = time.monotonic()
    serving.check_common(req)
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of must equal n (or be left out)", param="best_of")
    prompts = await serving.run_tokenizer(tokenize_prompts, serving, req.prompt)
    max_tokens = [serving.max_tokens_for(req.max_tokens, len(p), DEFAULT_MAX_TOKENS)
                  for p in prompts]
    # The same for every prompt: the request's max_tokens or the default.
    params = serving.sampling_params(req, max_tokens=max_tokens[0], logprobs=req.logprobs)
    serving.check_fits(prompts, params)
    request_id = random_id("cmpl")
    streams = await serving.open_streams(request_id, prompts, params, arrival=arrival,
                                         priority=req.priority, cache_salt=req.cache_salt)
    formatter = LogprobsFormatter(serving.tokenizer, req.logprobs or 0,
                                  as_token_ids=req.return_tokens_as_token_ids)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(serving, request_id, streams, params, formatter, len(prompts),
                       include_usage)
        return SSEResponse(sse_stream(body, on_exit=lambda: close_all(streams)),
                           on_close=lambda: close_all(streams))
    try:
        final = await run_unless_disconnected(raw, _collect(serving, streams))
    finally:
        close_all(streams)
    return JSONResponse(_response(serving, request_id, final, params.n, formatter)
                        .model_dump(mode="json"))


async def _collect(serving: OpenAIServing, streams: list) -> dict[int, RequestOutput]:
    final: dict[int, RequestOutput] = {}
    async for index, output in serving.iterate(streams):
        final[index] = output
    for output in final.values():
        check_not_failed(output)
    return final


def _response(serving: OpenAIServing, request_id: str, final: dict[int, RequestOutput], n: int,
              formatter: LogprobsFormatter) -> CompletionResponse:
    usage, choices = Usage(), []
    for index in sorted(final):
        output = final[index]
        usage.record(index, output)
        for comp in output.outputs:
            choices.append(CompletionChoice(
                index=index * n + comp.index, text=comp.text,
                logprobs=formatter.completion(comp, 0, len(comp.token_ids), index * n + comp.index),
                finish_reason=comp.finish_reason, stop_reason=comp.stop_reason))
    choices.sort(key=lambda c: c.index)
    return CompletionResponse(id=request_id, model=serving.model_name, choices=choices,
                              usage=usage.info())


async def _stream(serving: OpenAIServing, request_id: str, streams: list, params,
                  formatter: LogprobsFormatter, num_prompts: int,
                  include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks: one per choice per engine step that added tokens, then usage and [DONE].
    Wrapped by `sse_stream`, which closes the streams (aborting unfinished requests)."""
    n = params.n
    tracker = DeltaTracker(num_prompts * n, params.stop_strings, params.include_stop_str_in_output)
    usage = Usage()
    async for index, output in serving.iterate(streams):
        usage.record(index, output)
        if output.error:
            err = failure(output, "prompt")
            yield sse_event(error_body(err.message, err.type, err.param, err.code))
            continue
        for comp in output.outputs:
            choice = index * n + comp.index
            delta = tracker.delta(choice, comp)
            if delta is None:
                continue
            logprobs = formatter.completion(comp, delta.token_start, delta.token_end, choice)
            chunk = CompletionResponse(id=request_id, model=serving.model_name, choices=[
                CompletionChoice(index=choice, text=delta.text, logprobs=logprobs,
                                 finish_reason=delta.finish_reason,
                                 stop_reason=delta.stop_reason)])
            yield sse_event(chunk.model_dump(mode="json", exclude={"usage"}))
    if include_usage:
        chunk = CompletionResponse(id=request_id, model=serving.model_name, choices=[],
                                   usage=usage.info())
        yield sse_event(chunk.model_dump(mode="json"))
