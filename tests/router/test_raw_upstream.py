"""The router's raw HTTP/1.1 upstream (raw_upstream.py) against hand-written servers on loopback
sockets: bodies intact whatever the reads split (chunked, sized, until close), keep-alive reuse
and the retry on a connection the backend had closed, refused connections and cut streams as
UpstreamError, an answer closed early closing its connection (the backend sees the client go).
Every wait is bounded."""

from __future__ import annotations

import asyncio
import random

import pytest

from pagedkv.router.raw_upstream import RawUpstream
from pagedkv.router.upstream import UpstreamError
from tests.server.helpers import free_port

pytestmark = pytest.mark.timeout(60, method="thread")

EVENTS = b"".join(b'data: {"choices":[{"text":"%d \xc3\xa9"}]}\n\n' % i for i in range(40)) \
    + b"data: [DONE]\n\n"


def chunked(body: bytes, sizes: list[int]) -> bytes:
    """`body` in HTTP/1.1 chunked encoding, chunks of `sizes` (cycled), then the last chunk."""
    out, at, i = [], 0, 0
    while at < len(body):
        piece = body[at:at + sizes[i % len(sizes)]]
        out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
        at += len(piece)
        i += 1
    return b"".join(out) + b"0\r\n\r\n"


class Server:
    """An asyncio server answering each request on a connection with the next of `answers`
    (raw bytes, written in pieces of 1-7 bytes with a pause now and then). After `close_after`
    answers a connection closes; after `drop_after` it takes the next request and closes
    without a word (a keep-alive connection dropped just as the client reused it). Counts connections and requests; `gone` is set when
    a client closes a connection before its answer is written whole."""

    def __init__(self, answers: list[bytes], close_after: int | None = None,
                 drop_after: int | None = None, hold: int | None = None) -> None:
        self.answers = answers
        self.close_after = close_after
        self.drop_after = drop_after
        self.hold = hold  # after this many bytes of an answer, wait for the client to go
        self.connections = 0
        self.requests = 0
        self.gone = asyncio.Event()
        self.rng = random.Random(0)

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if self.drop_after is not None and served >= self.drop_after:
                    break
                answer = self.answers[self.requests % len(self.answers)]
                self.requests += 1
                await self.write_in_pieces(writer, reader, answer)
                served += 1
                if self.close_after is not None and served >= self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def write_in_pieces(self, writer: asyncio.StreamWriter,
                              reader: asyncio.StreamReader, answer: bytes) -> None:
        at = 0
        while at < len(answer):
            step = self.rng.randint(1, 7)
            writer.write(answer[at:at + step])
            await writer.drain()
            at += step
            if self.hold is not None and at >= self.hold:
                await reader.read()  # returns at EOF: the client closed the connection
                self.gone.set()
                raise ConnectionError("the client went")
            if self.rng.random() < 0.05:
                await asyncio.sleep(0.001)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


HEAD_SSE = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")


@pytest.mark.parametrize("sizes", [[1], [3, 17, 250], [len(EVENTS)]])
def test_a_chunked_stream_split_anywhere_arrives_whole_and_in_order(sizes):
    async def scenario() -> None:
        async with Server([HEAD_SSE + chunked(EVENTS, sizes)]) as server:
            upstream = RawUpstream(connect_timeout_s=5)
            answer = await upstream.post(server.url + "/v1/completions", b'{"a": 1}', {})
            assert answer.status_code == 200
            assert answer.content_type == "text/event-stream"
            got = [chunk async for chunk in answer.chunks()]
            assert all(got) and b"".join(got) == EVENTS
            await answer.aclose()
            await upstream.aclose()

    run(scenario())


def test_sized_and_until_close_bodies_and_keep_alive_reuse():
    body = b'{"choices": [{"text": "\xc3\xa9"}]}'
    sized = b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n" \
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    until_close = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: text/plain\r\n\r\n" \
        + body

    async def scenario() -> None:
        async with Server([sized]) as server:
            upstream = RawUpstream(connect_timeout_s=5)
            for _ in range(3):
                answer = await upstream.post(server.url + "/x", b"{}", {})
                assert (answer.status_code, await answer.read()) == (500, body)
                await answer.aclose()
            assert (server.connections, server.requests) == (1, 3)  # one kept-alive connection
            await upstream.aclose()
        async with Server([until_close], close_after=1) as server:
            upstream = RawUpstream(connect_timeout_s=5)
            for _ in range(2):
                answer = await upstream.get(server.url + "/metrics?name%5B%5D=a")
                assert (answer.status_code, await answer.read()) == (200, body)
                await answer.aclose()
            assert server.connections == 2
            await upstream.aclose()

    run(scenario())


def test_a_kept_alive_connection_the_backend_closed_is_retried_on_a_new_one():
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"

    async def scenario() -> None:
        # Each connection answers once, then drops the next request unanswered (no
        # "connection: close"): each reuse fails and is sent again on a new connection.
        async with Server([ok], drop_after=1) as server:
            upstream = RawUpstream(connect_timeout_s=5)
            for _ in range(3):
                answer = await upstream.post(server.url + "/v1/completions", b"{}", {})
                assert await answer.read() == b"ok"
                await answer.aclose()
            assert server.requests == 3 and server.connections == 3
            await upstream.aclose()

    run(scenario())


def test_refused_and_cut_connections_are_upstream_errors():
    cut = HEAD_SSE + chunked(EVENTS, [50])[:120]

    async def scenario() -> None:
        upstream = RawUpstream(connect_timeout_s=5)
        with pytest.raises(UpstreamError) as refused:
            await upstream.post(f"http://127.0.0.1:{free_port()}/v1/completions", b"{}", {})
        assert not refused.value.connected
        async with Server([cut], close_after=1) as server:
            answer = await upstream.post(server.url + "/v1/completions", b"{}", {})
            chunks = answer.chunks()
            assert (await anext(chunks)).startswith(b"data: ")
            with pytest.raises(UpstreamError) as broken:
                async for _ in chunks:
                    pass
            assert broken.value.connected
        await upstream.aclose()

    run(scenario())


def test_closing_an_answer_early_closes_its_connection():
    async def scenario() -> None:
        async with Server([HEAD_SSE + chunked(EVENTS, [10])], hold=len(HEAD_SSE) + 20) as server:
            upstream = RawUpstream(connect_timeout_s=5)
            answer = await upstream.post(server.url + "/v1/completions", b"{}", {})
            assert await anext(answer.chunks())
            await answer.aclose()  # the client left mid-answer
            await asyncio.wait_for(server.gone.wait(), timeout=5)
            await upstream.aclose()

    run(scenario())


def test_the_idle_timeout_counts_waits_on_the_backend_not_on_the_client():
    from pagedkv.router.relay import Cut, relay

    async def source(gaps: list[float]):
        for gap in gaps:
            await asyncio.sleep(gap)
            yield b"data: {}\n\n"
        yield b"data: [DONE]\n\n"

    async def consume(gaps: list[float], client_s: float) -> tuple[list[Cut], bool, bytes]:
        cuts: list[Cut] = []
        done: list[bool] = []
        out = []
        lasts = []
        async for chunk, last in relay(b"data: {}\n\n", source(gaps), idle_timeout_s=0.2,
                                       on_cut=lambda _, cut: cuts.append(cut),
                                       on_done=lambda: done.append(True)):
            out.append(chunk)
            lasts.append(last)
            await asyncio.sleep(client_s)  # a slow client: not the backend's fault
        assert lasts[-1] and lasts.count(True) == 1  # the end goes with the last bytes
        return cuts, bool(done), b"".join(out)

    # Steady chunks, each within the timeout, a client slower than the timeout: whole.
    cuts, done, out = run(consume([0.1] * 5, client_s=0.3))
    assert (cuts, done) == ([], True) and out.count(b"data: {}") == 6
    # A backend silent for longer than the timeout: cut, however quick the chunks before.
    cuts, done, out = run(consume([0.0, 0.0, 0.5], client_s=0.0))
    assert (cuts, done) == ([Cut.IDLE], False)
    assert b"sent nothing for 0.2 s" in out and out.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("pieces", [
    [b"data: a\n\ndata: [DONE]\n\n"],  # all in the first read
    [b"data: a\n\n", b"data: [DONE]\n\n", b"", b"junk after the end"],
    [b"data: a\n\n", b"data: [DONE]", b"\n\n"],  # its blank line in the next read
    [b"data: a\n\n", b"data: [DONE]"],  # no blank line at all: added
    [b"data: a\n\n", b"data: b\n\n"],  # no [DONE]: an error event and [DONE]
])
def test_the_last_chunk_carries_the_end_and_the_client_gets_one_done(pieces):
    from pagedkv.router.relay import relay

    async def source():
        for piece in pieces[1:]:
            yield piece

    async def scenario() -> tuple[list[tuple[bytes, bool]], list[str]]:
        ended: list[str] = []
        pairs = [pair async for pair in relay(
            pieces[0], source(), idle_timeout_s=5, on_cut=lambda m, _: ended.append("cut"),
            on_done=lambda: ended.append("done"))]
        return pairs, ended

    pairs, ended = run(scenario())
    assert [last for _, last in pairs].count(True) == 1 and pairs[-1][1]
    text = b"".join(chunk for chunk, _ in pairs)
    assert text.startswith(b"data: a\n\n") and text.endswith(b"data: [DONE]\n\n")
    assert text.count(b"data: [DONE]\n\n") == 1 and b"junk" not in text
    assert ended == (["cut"] if b"data: b" in text else ["done"])
