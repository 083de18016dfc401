"""What completions and chat completions share: checking a request, turning it into engine
requests, and reading their outputs back (merged across prompts, with metrics and aborts).

One HTTP request becomes one engine request per prompt (a completions `prompt` may be a list);
`n > 1` stays inside one engine request (the engine forks it). Choice `i * n + k` of the answer is
sample `k` of prompt `i`, as in OpenAI's API.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

from fastapi import Request

from pagedkv.config.errors import ErrorKind
from pagedkv.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineStepError,
    RequestStream,
)
from pagedkv.engine.outputs import RequestOutput
from pagedkv.http.errors import APIError, model_not_found
from pagedkv.http.protocol import PromptTokensDetails, SamplingFields, UsageInfo
from pagedkv.http.sse import OpenAIStreamResponse, SSEResponse
from pagedkv.sched.sampling_params import GREEDY_TEMPERATURE_BELOW, SamplingParams
from pagedkv.sched.validation import PromptTooLongError
from pagedkv.server.metrics import RequestPhases, ServerMetrics
from pagedkv.server.structured import compile_constraint, structured_outputs_of
from pagedkv.server.tool_parsers import ToolParser
from pagedkv.structured.params import StructuredOutputsParams

TOKENIZER_THREADS = 2  # worker threads that tokenize (and render chat templates) off the loop
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams) if f.init)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class _Timing:
    """Arrival, first token and finish times of one engine request (time.monotonic)."""

    arrival: float
    submitted: float | None = None  # queued for the engine loop
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    params: SamplingParams | None = None


@dataclass
class Usage:
    """Token counts of one HTTP request (all its prompts and samples)."""

    per_prompt: dict[int, RequestOutput] = field(default_factory=dict)

    def record(self, prompt_index: int, output: RequestOutput) -> None:
        self.per_prompt[prompt_index] = output

    def info(self) -> UsageInfo:
        prompt = sum(len(o.prompt_token_ids) for o in self.per_prompt.values())
        completion = sum(c.num_tokens for o in self.per_prompt.values() for c in o.outputs)
        cached = sum(max(o.num_cached_tokens, 0) for o in self.per_prompt.values())
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class OpenAIServing:
    """The shared machinery of the /v1 handlers, bound to one engine and one model name."""

    def __init__(self, engine: AsyncEngine, *, model_name: str, metrics: ServerMetrics,
                 tool_parser: ToolParser | None = None, strict_request_fields: bool = False,
                 system_fingerprint: str | None = None) -> None:
        self.engine = engine
        # 400 (instead of a logged warning) for request fields no API of ours defines
        self.strict_request_fields = strict_request_fields
        self.system_fingerprint = system_fingerprint
        self.tool_parser = tool_parser  # for tool_choice "auto" (`--tool-call-parser`)
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.model_name = model_name
        self.metrics = metrics
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS,
                                                  thread_name_prefix="pagedkv-tokenize")
        # `pagedkv serve --request-log`: a RequestLog that gets every finished request.
        self.request_log = None

    def close(self) -> None:
        """Stop the tokenizer threads (work not started yet is dropped)."""
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # ---- tokenizing (off the event loop) ------------------------------------------------

    async def run_tokenizer(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in a tokenizer thread: a huge prompt never stalls the event loop (the
        tokenizer releases the GIL), so /health and other requests go on meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    def encode_prompt(self, text: str, *, add_special_tokens: bool,
                      param: str = "prompt", bounded: bool = True) -> list[int]:
        """Token ids of a prompt text; 400 for invalid Unicode, and (when `bounded`) a cheap 400
        for a prompt longer than max_model_len (only a prefix of it is tokenized). Unbounded is
        for a request that truncates its prompt. Call it in run_tokenizer."""
        limit = self.max_model_len - 1 if bounded else sys.maxsize
        try:
            return self.tokenizer.encode_bounded(text, limit,
                                                 add_special_tokens=add_special_tokens)
        except PromptTooLongError as exc:
            raise APIError(
                f"The prompt has at least {exc.num_tokens} tokens but this model's maximum "
                f"context length is {self.max_model_len} tokens (the prompt plus at least one "
                "generated token must fit).", param=param) from exc
        except ValueError as exc:
            raise APIError(str(exc), param=param) from exc

    # ---- checks -------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise model_not_found(name, code=None)  # vLLM's integer code

    def check_common(self, req: SamplingFields) -> None:
        self.check_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise APIError("stream_options is only allowed when stream is true",
                           param="stream_options")

    def check_prompt_length(self, prompt_len: int, param: str = "prompt") -> None:
        """400 for an empty prompt or one that leaves no room for a generated token."""
        if prompt_len == 0:
            raise APIError("the prompt must not be empty", param=param)
        if prompt_len >= self.max_model_len:
            raise APIError(
                f"The prompt has {prompt_len} tokens but this model's maximum context length is "
                f"{self.max_model_len} tokens (the prompt plus at least one generated token "
                "must fit).", param=param)

    def check_prompt_ids(self, ids: Sequence[int], param: str = "prompt") -> None:
        """400 for token ids a completion refuses before they reach the engine: an empty
        prompt, one past max_model_len, or an id outside the vocabulary."""
        self.check_prompt_length(len(ids), param)
        vocab = self.engine.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"prompt token id {bad} is out of the vocabulary [0, {vocab})",
                           param=param)

    def max_tokens_for(self, requested: int | None, prompt_len: int, default: int | None) -> int:
        """The request's max_tokens (or `default`, or all that fits when None); 400 when the
        prompt plus max_tokens exceeds max_model_len."""
        self.check_prompt_length(prompt_len)
        room = self.max_model_len - prompt_len
        max_tokens = requested if requested is not None else (default or room)
        if max_tokens > room:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} in the completion). Please reduce the length of the prompt or "
                "the completion.", param="max_tokens")
        return max_tokens

    def sampling_params(self, req: SamplingFields, *, max_tokens: int, logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        """SamplingParams for `req` (ValueError, hence 400, on a bad combination; 400 for
        `n` > 1 with greedy sampling, as vLLM 0.32 refuses it: the samples would be equal)."""
        if req.n > 1 and req.temperature < GREEDY_TEMPERATURE_BELOW:  # param null, as vLLM's
            raise APIError(f"n must be 1 when using greedy sampling, got {req.n}.")
        try:
            return self._make_sampling_params(req, max_tokens, logprobs, structured_outputs)
        except ValueError as exc:  # SamplingParams' own checks (a cap in bytes, ...)
            raise APIError(str(exc), param=_sampling_field(exc)) from exc

    def _make_sampling_params(self, req: SamplingFields, max_tokens: int, logprobs: int | None,
                              structured_outputs: StructuredOutputsParams | None
                              ) -> SamplingParams:
        return SamplingParams(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            min_p=req.min_p, seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            logprobs=logprobs, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=getattr(req, "spaces_between_special_tokens", True),
            include_stop_str_in_output=req.include_stop_str_in_output,
            prompt_logprobs=req.prompt_logprobs, structured_outputs=structured_outputs,
            logit_bias=_logit_bias(req.logit_bias), allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words, truncate_prompt_tokens=req.truncate_prompt_tokens)

    def truncate(self, req: SamplingFields, prompts: list[list[int]]) -> list[list[int]]:
        """The prompts cut to their last `truncate_prompt_tokens` tokens (when asked)."""
        return [self.engine.truncate_prompt(p, req.truncate_prompt_tokens) for p in prompts]

    def check_fits(self, prompts: Sequence[list[int]], params: SamplingParams) -> None:
        """400 when a prompt with its n samples could never fit in the KV cache. (The engine's
        check_fits reads only the cache's fixed sizes, so calling it here, outside the loop
        thread, is safe.)"""
        for ids in prompts:
            try:
                self.engine.check_fits(len(ids), params)
            except ValueError as exc:
                raise APIError(str(exc), param="n" if params.n > 1 else "prompt") from exc

    # ---- running ------------------------------------------------------------------------

    async def structured_outputs(self, req: SamplingFields,
                                 tool_constraint: StructuredOutputsParams | None = None
                                 ) -> StructuredOutputsParams | None:
        """The request's structured-output constraint (or the one its `tool_choice` implies),
        compiled (cached by the engine's grammar backend); APIError 400 when it is malformed,
        ambiguous or rejected."""
        so = structured_outputs_of(req)
        if tool_constraint is not None:
            if so is not None:
                raise APIError("tool_choice required or a named function cannot be combined "
                               "with structured outputs", param="tool_choice")
            await compile_constraint(self.engine.engine, tool_constraint, "tools")
            return tool_constraint
        await compile_constraint(self.engine.engine, so)
        return so

    async def open_streams(self, request_id: str, prompts: Sequence[list[int]],
                           params: SamplingParams, *, arrival: float, priority: int = 0,
                           cache_salt: str | None = None) -> list[RequestStream]:
        """Add one engine request per prompt (ids `request_id-i`); 503 when overloaded.
        `arrival` (time.monotonic()) is when the HTTP request came in, for the latency metrics.

        On any failure the streams already opened are closed (aborted) before raising.
        """
        if params.bad_words:  # tokenized here, in a tokenizer thread, never on the engine loop
            await self.run_tokenizer(self.engine.engine.inputs.prepare_bad_words, params)
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                stream = await self.engine.add_request(
                    f"{request_id}-{i}", list(ids), params, priority=priority,
                    cache_salt=cache_salt)
                stream.arrival = arrival
                stream.params = params  # for the per-request metrics
                streams.append(stream)
        except EngineOverloadedError as exc:
            close_all(streams)
            self.metrics.admission_rejected("max_num_queued_reqs")
            raise APIError(str(exc), status_code=503, type="server_overloaded") from exc
        except EngineDeadError as exc:
            close_all(streams)
            raise APIError(str(exc), status_code=503, type="server_unavailable") from exc
        except ValueError as exc:  # the engine's checks (token ids past the vocabulary, ...)
            close_all(streams)
            raise APIError(str(exc), param=_sampling_field(exc)) from exc
        except BaseException:
            close_all(streams)
            raise
        return streams

    async def iterate(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield `(prompt_index, output)` from all streams as outputs arrive, recording latency
        metrics (from each stream's `arrival`) as each finishes. Raises APIError(503) when a
        stream ends without finishing (aborted by a shutdown). Does not close the streams (the
        caller does, in a finally)."""
        timings = [_Timing(s.arrival, s.submitted, params=getattr(s, "params", None))
                   for s in streams]
        try:
            async for index, output in _tagged(streams):
                timing = timings[index]
                self._observe_tokens(timing, output)
                if output.finished:
                    self._observe(timing, output)
                yield index, output
        except EngineDeadError as exc:  # a shutdown cut it off, or the engine died
            raise APIError(str(exc), status_code=503, type="server_unavailable") from exc
        except EngineStepError as exc:
            raise APIError(str(exc), status_code=500, type="internal_server_error") from exc
        if any(s.aborted for s in streams):  # the server is shutting down
            raise APIError("request aborted", status_code=503, type="server_unavailable")

    def _observe_tokens(self, timing: _Timing, output: RequestOutput) -> None:
        """First-token time and inter-token gaps (of the longest sequence) as outputs come."""
        outputs = output.outputs
        count = (outputs[0].num_tokens if len(outputs) == 1
                 else max((c.num_tokens for c in outputs), default=0))
        if count <= timing.num_tokens:
            return
        now = time.monotonic()
        if timing.first_token is None:
            timing.first_token = now
        elif timing.last_token is not None:
            self.metrics.observe_inter_token(now - timing.last_token, count - timing.num_tokens)
        timing.last_token, timing.num_tokens = now, count

    def _observe(self, timing: _Timing, output: RequestOutput) -> None:
        if any(c.finish_reason in ("abort", "error") for c in output.outputs):
            return
        now = time.monotonic()
        ttft = None if timing.first_token is None else timing.first_token - timing.arrival
        longest = max((c.num_tokens for c in output.outputs), default=0)
        engine_times = output.metrics or {}
        queue_time = None
        if engine_times.get("first_scheduled_time"):
            queue_time = engine_times["first_scheduled_time"] - engine_times["arrival_time"]
        reason = next((c.finish_reason for c in output.outputs if c.finish_reason), "stop")
        self.metrics.observe_request(ttft=ttft, e2e=now - timing.arrival,
                                     num_output_tokens=longest,
                                     num_prompt_tokens=len(output.prompt_token_ids),
                                     finished_reason=reason, queue_time=queue_time,
                                     phases=_phases(timing, output, now))
        if self.request_log is not None:
            self.request_log.record(output, arrival_monotonic=timing.arrival,
                                    submitted_monotonic=timing.submitted, ttft=ttft,
                                    e2e=now - timing.arrival, queue_time=queue_time,
                                    num_output_tokens=longest, finish_reason=reason)


def _phases(timing: _Timing, output: RequestOutput, now: float) -> RequestPhases:
    """The request's phases from the engine's monotonic times (same clock as `now`)."""
    times = output.metrics or {}
    scheduled = times.get("first_scheduled_time") or None
    first = times.get("first_token_time") or None
    last = timing.last_token or now
    params = timing.params
    return RequestPhases(
        n=params.n if params is not None else len(output.outputs),
        max_tokens=params.max_tokens if params is not None else None,
        num_preemptions=int(times.get("num_preemptions", 0)),
        num_computed_prompt_tokens=max(len(output.prompt_token_ids) - output.num_cached_tokens, 0),
        prefill_time=first - scheduled if first and scheduled else None,
        decode_time=last - first if first else None,
        inference_time=last - scheduled if scheduled else None)


def _sampling_field(exc: ValueError) -> str | None:
    """The SamplingParams field a check's message starts with (its `param`), else None."""
    word = str(exc).split(" ", 1)[0]
    return word if word in SAMPLING_FIELDS else None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON object keys) with int keys; 400 otherwise."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise APIError(f"logit_bias keys must be token ids, got {key!r}",
                           param="logit_bias") from None
    return out


def close_all(streams: Sequence[RequestStream]) -> None:
    """Close (abort if unfinished) every stream; idempotent."""
    for stream in streams:
        stream.close()


def streaming_response(events: AsyncIterator[str],
                       streams: Sequence[RequestStream]) -> SSEResponse:
    """The SSE answer of a streaming request: `events` framed (error event, `[DONE]`), and
    `streams` closed however it ends (finished, client gone, cancelled before it started)."""
    return OpenAIStreamResponse(events, on_close=lambda: close_all(streams))


async def collect_unless_disconnected(request: Request, streams: Sequence[RequestStream],
                                      collect: Any) -> Any:
    """Await the `collect` coroutine of a non-streaming request, then close `streams` (its
    requests are aborted if the client left first: see `run_unless_disconnected`)."""
    try:
        return await run_unless_disconnected(request, collect)
    finally:
        close_all(streams)


class _Tagged:
    """One stream's outputs tagged with index 0 (`_merge`'s items, without a generator)."""

    __slots__ = ("stream",)

    def __init__(self, stream: RequestStream) -> None:
        self.stream = stream

    def __aiter__(self) -> _Tagged:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        return 0, await self.stream.__anext__()


def _tagged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The streams' outputs tagged with their stream's index, in arrival order."""
    return _Tagged(streams[0]) if len(streams) == 1 else _merge(streams)


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams' outputs in arrival order, tagged with the stream's index."""
    merged: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                merged.put_nowait((index, output))
        except Exception as exc:  # handed to the reader below
            merged.put_nowait((index, exc))
        finally:
            merged.put_nowait((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client goes away (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, coro: Any) -> Any:
    """Await `coro`, cancelling it (its finally blocks abort its requests) if the client
    disconnects first (then it raises APIError 499: the answer goes nowhere anyway)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task  # let its finally blocks abort its requests now
    if task.cancelled():
        raise APIError("client disconnected", status_code=499, type="client_disconnected")
    return task.result()


def failure(output: RequestOutput, param: str = "prompt") -> APIError:
    """The error of a request the engine finished with an error: a 400 when it can never fit,
    a 500 when its model step failed."""
    message = output.error or "the request failed in the engine"
    if output.error_kind is ErrorKind.INTERNAL:
        return APIError(message, status_code=500, type="internal_server_error")
    return APIError(message, param=param)


def check_not_failed(output: RequestOutput) -> None:
    """Raise `failure(output)` when the engine finished the request with an error."""
    if output.error or any(c.finish_reason == "error" for c in output.outputs):
        raise failure(output)
