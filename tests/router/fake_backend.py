"""A tiny OpenAI-shaped backend on a free loopback port, in a thread, for the router's fault
tests: real sockets, real timeouts. `mode` says how it answers completions:

    ok         a JSON completion (a stream when asked: two events and data: [DONE])
    wedged     accepts the request and never answers (as a stuck engine) while the test
               runs; /health stays 200
    500        a 500 with an OpenAI-style error body
    not_json   a 200 whose body is not JSON
    no_done    a stream whose connection closes cleanly mid-event, without data: [DONE]
    stall      a stream that sends one event, then nothing while the test runs
    json       a JSON completion even when a stream is asked for

`attempts` counts the completion requests it received, `aborted` the streams that ended
because their client (the router) went away. `ThreadServer` serves any ASGI app
(the router's too) the same way.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.server.graceful import bind_socket


class ThreadServer:
    """`app` served by uvicorn in a daemon thread on a free loopback port (`url`), as a
    context manager; its lifespan runs when `lifespan` is "on"."""

    def __init__(self, app: Any, lifespan: str = "off") -> None:
        self._sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="error", timeout_graceful_shutdown=1,
                                lifespan=lifespan)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> ThreadServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()


class FakeBackend(ThreadServer):
    def __init__(self, mode: str = "ok", *, model: str = "tiny",
                 kv_info: dict[str, Any] | None = None) -> None:
        self.mode = mode
        self.model = model
        self.kv_info = kv_info
        self.attempts = 0
        self.aborted = 0
        self.closing = False
        super().__init__(self._build())

    def __exit__(self, *exc: object) -> None:
        self.closing = True
        super().__exit__(*exc)

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model, "object": "model"}]}

        @app.get("/kv_cache_info")
        async def kv_cache_info() -> Response:
            if self.kv_info is None:
                return Response(status_code=404)
            return JSONResponse(self.kv_info)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response("", media_type="text/plain")

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def completions(raw: Request) -> Response:
            self.attempts += 1
            body = await raw.json()
            if self.mode == "wedged":  # until the test ends (so shutdown is quick)
                while not self.closing:
                    await asyncio.sleep(0.02)
                return Response(status_code=503)
            if self.mode == "500":
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            if self.mode == "not_json":
                return Response("<html>proxy error</html>", media_type="text/html")
            if body.get("stream") and self.mode != "json":
                return StreamingResponse(self._events(), media_type="text/event-stream")
            return JSONResponse({"object": "text_completion", "model": self.model,
                                 "choices": [{"index": 0, "text": f"from {self.url}"}]})

        return app

    async def _events(self):
        try:
            yield 'data: {"choices":[{"text":"a"}]}\n\n'
            if self.mode == "no_done":
                yield 'data: {"choices":[{"te'
                return
            while self.mode == "stall" and not self.closing:
                await asyncio.sleep(0.02)
            yield 'data: {"choices":[{"text":"b"}]}\n\n'
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted += 1
            raise
