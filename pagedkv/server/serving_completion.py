"""POST /v1/completions: a prompt (string, token ids, or a list of either) -> text."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedkv.engine.outputs import RequestOutput
from pagedkv.http.chunk_template import ChunkTemplate
from pagedkv.http.errors import APIError, error_body
from pagedkv.http.prompt_render import tokenize_prompts
from pagedkv.http.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    usage_flags,
)
from pagedkv.http.request_fields import check_request_fields
from pagedkv.http.sse import SSEResponse, sse_event, sse_model_event
from pagedkv.server.deltas import DeltaTracker, LogprobsFormatter
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

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def prompt_texts(serving: OpenAIServing, prompt: str | list, prompts: list[list[int]]
                 ) -> list[str]:
    """The text each prompt echoes: the string as sent, or the decoded token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], str):
        return list(prompt)
    return [serving.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


@dataclass
class _Echo:
    """What `echo` adds in front of each choice: the prompt's text, tokens and logprobs.
    `only` (max_tokens 0): the prompt is the whole answer, the one generated token is dropped."""

    texts: list[str]
    prompts: list[list[int]]
    only: bool

    def output(self, output: RequestOutput) -> RequestOutput:
        if not self.only:
            return output
        return replace(output, outputs=[
            replace(c, text="", token_ids=[], cumulative_logprob=None,
                    logprobs=None if c.logprobs_view is None else [])
            for c in output.outputs])

    def logprobs(self, formatter: LogprobsFormatter, index: int, output: RequestOutput,
                 choice: int) -> CompletionLogprobs:
        return formatter.echoed_prompt(self.prompts[index], output.prompt_logprobs, choice)


def _join(first: CompletionLogprobs | None, second: CompletionLogprobs | None
          ) -> CompletionLogprobs | None:
    if first is None or second is None:
        return first or second
    return CompletionLogprobs(text_offset=first.text_offset + second.text_offset,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              tokens=first.tokens + second.tokens,
                              top_logprobs=first.top_logprobs + second.top_logprobs)


async def create_completion(serving: OpenAIServing, req: CompletionRequest,
                            raw: Request) -> JSONResponse | SSEResponse:
    """POST /v1/completions: one engine request per prompt (n samples each); a JSON body, or
    an SSE stream when `req.stream`. Raises APIError (400; 404 for an unknown model) for bad
    input before anything is queued; a client that disconnects aborts its requests (their
    blocks return at once)."""
    arrival = time.monotonic()
    serving.check_common(req)
    check_request_fields(req, strict=serving.strict_request_fields)
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of must equal n (or be left out)", param="best_of")
    if req.max_tokens == 0 and not req.echo:
        raise APIError("max_tokens must be at least 1 (0 is allowed only with echo)",
                       param="max_tokens")
    prompts = serving.truncate(req, await serving.run_tokenizer(
        tokenize_prompts, serving, req.prompt, req.truncate_prompt_tokens is None,
        req.add_special_tokens is not False))
    echo = None
    if req.echo:  # max_tokens 0 generates one token, which is dropped (as vLLM does)
        # vLLM: with return_token_ids the prompt comes back as prompt_token_ids, not as text
        texts = ([""] * len(prompts) if req.return_token_ids
                 else prompt_texts(serving, req.prompt, prompts))
        echo = _Echo(texts, prompts, req.max_tokens == 0)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else (
        1 if req.max_tokens == 0 else req.max_tokens)
    max_tokens = [serving.max_tokens_for(requested, len(p), DEFAULT_MAX_TOKENS)
                  for p in prompts]
    # The same for every prompt: the request's max_tokens or the default.
    structured = await run_unless_disconnected(raw, serving.structured_outputs(req))
    make_params = beam_search_params if req.use_beam_search else OpenAIServing.sampling_params
    params = make_params(serving, req, max_tokens=max_tokens[0], logprobs=req.logprobs,
                         structured_outputs=structured)
    if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
        params = replace(params, prompt_logprobs=req.logprobs)
    serving.check_fits(prompts, params)
    check_params(req.kv_transfer_params, len(prompts), req.stream)
    await receive(serving, req.kv_transfer_params, prompts[0], req.cache_salt)
    request_id = random_id("cmpl")  # the engine's (unique); the response's may be the client's
    streams = await serving.open_streams(request_id, prompts, params, arrival=arrival,
                                         priority=req.priority, cache_salt=req.cache_salt)
    formatter = LogprobsFormatter(serving.tokenizer, req.logprobs or 0,
                                  as_token_ids=req.return_tokens_as_token_ids)
    # vLLM fills choices[].prompt_logprobs whenever they are computed (echo with logprobs too)
    vllm_prompt_logprobs = params.prompt_logprobs is not None
    extras = ResponseExtras.of(req, "cmpl", raw.headers.get("x-request-id"), request_id,
                               serving.system_fingerprint, prompts)
    if req.stream:
        usage_wanted = usage_flags(req.stream_options)
        body = _stream(serving, extras, streams, params, formatter, len(prompts),
                       usage_wanted, echo, vllm_prompt_logprobs)
        return streaming_response(body, streams)
    final = await collect_unless_disconnected(raw, streams, _collect(serving, streams))
    answer = _response(serving, extras, final, params.n, formatter, echo, vllm_prompt_logprobs)
    answer.kv_transfer_params = await handoff(serving, req.kv_transfer_params, prompts[0],
                                              req.cache_salt)
    return JSONResponse(answer.model_dump(mode="json"))


async def _collect(serving: OpenAIServing, streams: list) -> dict[int, RequestOutput]:
    final: dict[int, RequestOutput] = {}
    async for index, output in serving.iterate(streams):
        final[index] = output
    for output in final.values():
        check_not_failed(output)
    return final


def _response(serving: OpenAIServing, extras: ResponseExtras, final: dict[int, RequestOutput], n: int,
              formatter: LogprobsFormatter, echo: _Echo | None,
              vllm_prompt_logprobs: bool) -> CompletionResponse:
    usage, choices = Usage(), []
    for index in sorted(final):
        output = final[index] if echo is None else echo.output(final[index])
        usage.record(index, output)
        for comp in output.outputs:
            choice = index * n + comp.index
            text, logprobs = extras.text(comp.text), None
            if echo is not None:
                text = echo.texts[index] + text
                if comp.logprobs_view is not None:
                    logprobs = echo.logprobs(formatter, index, output, choice)
            logprobs = _join(logprobs, formatter.completion(comp, 0, len(comp.token_ids), choice))
            choices.append(CompletionChoice(
                index=choice, text=text, logprobs=logprobs,
                finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                prompt_logprobs=(formatter.vllm_prompt_logprobs(output.prompt_logprobs,
                                                                   output.prompt_token_ids)
                                 if vllm_prompt_logprobs else None),
                token_ids=extras.token_ids(comp.token_ids), prompt_token_ids=extras.prompt_ids(index)))
    choices.sort(key=lambda c: c.index)
    return CompletionResponse(id=extras.id, model=serving.model_name, choices=choices,
                              system_fingerprint=extras.fingerprint, usage=usage.info())


async def _stream(serving: OpenAIServing, extras: ResponseExtras, streams: list, params,
                  formatter: LogprobsFormatter, num_prompts: int,
                  usage_wanted: tuple[bool, bool], echo: _Echo | None,
                  vllm_prompt_logprobs: bool) -> AsyncIterator[str]:
    """SSE chunks: one per choice per engine step that added tokens, then usage and [DONE];
    with `echo`, a choice's first chunk starts with the prompt. `usage_wanted`: (a final usage
    chunk, the usage so far on every chunk). Chunks carry vLLM's stream keys (`_chunk_json`).
    Sent by `OpenAIStreamResponse`, which closes the streams (aborting unfinished requests)."""
    n = params.n
    tracker = DeltaTracker(num_prompts * n, params.stop_strings, params.include_stop_str_in_output)
    usage = Usage()
    started: set[int] = set()
    include_usage, continuous = usage_wanted
    # The usual chunk (text only) from a template; None: every chunk through pydantic.
    plain = None if continuous or extras.prompt_token_ids is not None else _plain_template(
        serving, extras)
    async for index, output in serving.iterate(streams):
        if echo is not None:
            output = echo.output(output)
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
            text, logprobs, prompt_logprobs = extras.text(delta.text), None, None
            prompt_ids = None
            if choice not in started:
                started.add(choice)
                prompt_ids = extras.prompt_ids(index)
                if echo is not None:
                    text = echo.texts[index] + text
                    if comp.logprobs_view is not None:
                        logprobs = echo.logprobs(formatter, index, output, choice)
                if vllm_prompt_logprobs:
                    prompt_logprobs = formatter.vllm_prompt_logprobs(output.prompt_logprobs,
                                                                   output.prompt_token_ids)
            if comp.logprobs_view is not None:
                logprobs = _join(logprobs, formatter.completion(comp, delta.token_start,
                                                                delta.token_end, choice))
            if (plain is not None and logprobs is None and prompt_logprobs is None
                    and prompt_ids is None and delta.finish_reason is None
                    and delta.stop_reason is None):
                yield plain.event(int(time.time()), choice, text)
                continue
            chunk = CompletionResponse(
                id=extras.id, model=serving.model_name, system_fingerprint=extras.fingerprint,
                choices=[CompletionChoice(
                    index=choice, text=text, logprobs=logprobs,
                    finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                    prompt_logprobs=prompt_logprobs, prompt_token_ids=prompt_ids,
                    token_ids=extras.token_ids(comp.token_ids_view[delta.token_start:delta.token_end]))],
                usage=usage.info() if continuous else None)
            yield _chunk_event(chunk)
    if include_usage:
        chunk = CompletionResponse(id=extras.id, model=serving.model_name, choices=[],
                                   system_fingerprint=extras.fingerprint, usage=usage.info())
        yield _chunk_event(chunk)


def _plain_template(serving: OpenAIServing, extras: ResponseExtras) -> ChunkTemplate | None:
    """The template of a chunk that carries one choice's text and nothing else: holes for
    `created`, the choice's index and its text."""
    def render(created: int, index: int, text: str) -> str:
        return _chunk_event(CompletionResponse(
            id=extras.id, model=serving.model_name, system_fingerprint=extras.fingerprint,
            created=created, choices=[CompletionChoice(index=index, text=text)]))
    return ChunkTemplate.make(render)


_RESPONSE_ONLY = {"service_tier", "kv_transfer_params", "ec_transfer_params", "metrics"}


def _chunk_event(chunk: CompletionResponse) -> str:
    """A stream chunk's SSE event, `_chunk_json`'s JSON; a chunk without logprobs (no float in
    it, nor `prompt_logprobs`) is written by pydantic in one pass (`sse_model_event`)."""
    if any(c.logprobs is not None or c.prompt_logprobs is not None for c in chunk.choices):
        return sse_event(_chunk_json(chunk))
    exclude: dict[str, Any] = dict.fromkeys(_RESPONSE_ONLY, True)
    exclude["choices"] = {"__all__": {"routed_experts", "prompt_logprobs"}}
    if chunk.usage is None:
        exclude["usage"] = True
    return sse_model_event(chunk, exclude)


def _chunk_json(chunk: CompletionResponse) -> dict:
    """A stream chunk as vLLM writes one: no response-only keys (`service_tier`, transfer
    params, `metrics`, `routed_experts`), `prompt_logprobs` only when set, `usage` only
    with continuous usage stats."""
    exclude: set[str] = set(_RESPONSE_ONLY) | ({"usage"} if chunk.usage is None else set())
    payload = chunk.model_dump(mode="json", exclude=exclude)
    for choice in payload["choices"]:
        choice.pop("routed_experts", None)
        if choice.get("prompt_logprobs") is None:
            choice.pop("prompt_logprobs", None)
    return payload
