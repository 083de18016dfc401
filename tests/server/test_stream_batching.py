"""A step's outputs reach the streams in one hand-over, and an output its reader has not taken
yet is replaced by the next (outputs are cumulative): nothing is lost, reordered or sent twice.

Unit: `RequestStream` merges unread outputs, never an end (error, abort). End to end: many
concurrent streams on the test server, each stream's chunks add up to exactly the text and
token ids of the same request answered without streaming, one finish, in the last chunk."""

from __future__ import annotations

import asyncio
import json

import httpx

from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.request_stream import ABORTED, RequestStream, put_all


def _output(num_tokens: int, finished: bool = False) -> RequestOutput:
    comp = CompletionOutput(0, "x" * num_tokens, list(range(num_tokens)),
                            finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1, 2], [comp], finished)


async def _read(stream: RequestStream) -> list:
    got = []
    try:
        async for output in stream:
            got.append(output.outputs[0].num_tokens)
    except RuntimeError as exc:
        got.append(str(exc))
    return got


def test_unread_outputs_merge_and_ends_are_kept():
    async def main() -> None:
        stream = RequestStream("r", lambda s: None)
        put_all([(stream, _output(1)), (stream, _output(2)), (stream, _output(3, True))])
        assert await _read(stream) == [1, 3]  # the first apart, then the latest: every token once

        stream = RequestStream("r", lambda s: None)
        for item in (_output(1), _output(2), RuntimeError("boom"), _output(9)):
            stream.put(item)
        assert await _read(stream) == [1, 2, "boom"]  # the error after the output before it

        stream = RequestStream("r", lambda s: None)
        stream.put(_output(4))
        stream.put(ABORTED)
        assert await _read(stream) == [4] and stream.aborted

        stream = RequestStream("r", lambda s: None)  # a waiting reader is woken
        reader = asyncio.ensure_future(_read(stream))
        await asyncio.sleep(0)
        stream.put(_output(1))
        await asyncio.sleep(0)
        stream.put(_output(2, True))
        assert await asyncio.wait_for(reader, 5) == [1, 2]

    asyncio.run(main())


NUM_STREAMS = 24
MAX_TOKENS = 20


def _events(body: str) -> list[dict]:
    events = [e for e in body.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def _check(chunks: list[dict], whole: dict, key: str) -> None:
    """The stream's pieces of `key` ("text" or "token_ids") add up to the whole answer's."""
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    pieces = [c[key] for c in choices]
    joined = "".join(pieces) if key == "text" else [t for p in pieces for t in p]
    assert joined == whole["choices"][0][key]
    finishes = [c["finish_reason"] for c in choices]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS


def test_concurrent_streams_carry_every_token_once_in_order(server):
    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            async def ask(i: int, stream: bool) -> httpx.Response:
                body = {"model": "tiny", "prompt": f"story {i}: once upon a time",
                        "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                        "return_token_ids": i % 2 == 1, "stream": stream}
                if stream:
                    body["stream_options"] = {"include_usage": True}
                response = await client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                return response

            streamed = await asyncio.gather(*(ask(i, True) for i in range(NUM_STREAMS)))
            whole = await asyncio.gather(*(ask(i, False) for i in range(NUM_STREAMS)))
        for i, (s, w) in enumerate(zip(streamed, whole, strict=True)):
            chunks, answer = _events(s.text), w.json()
            _check(chunks, answer, "text")
            if i % 2 == 1:  # (the chunk models' path, not the template's)
                _check(chunks, answer, "token_ids")

    asyncio.run(main())
