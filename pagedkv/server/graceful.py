"""Serving with a clean end: the listening socket is bound before the model loads, and a
SIGTERM / SIGINT drains the server instead of cutting clients off.

`DrainingServer` is uvicorn's `Server` with its shutdown reordered around the app's engine:

1. on the signal, stop accepting connections (uvicorn) and refuse new requests with 503
   (`AsyncEngine.begin_drain`: /health answers 503 too);
2. let the requests in flight finish, for at most `shutdown_timeout` seconds;
3. then end every remaining one (`AsyncEngine.end_remaining`): a stream gets an error event
   and `data: [DONE]`, a non-streaming request a 503 — before uvicorn's own graceful-shutdown
   timeout (`shutdown_timeout` + `UVICORN_GRACE_S`) would cancel them with no answer;
4. exit with status 0 (uvicorn would re-raise the signal, ending the process by it).

When the engine loop dies, `stop_for_dead_engine(reason)` drains the same way and
`exit_reason` says why, so `pagedkv serve` exits non-zero instead of answering 503 for ever.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn

from pagedkv.engine.async_engine import AsyncEngine

logger = logging.getLogger("pagedkv.server")

DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
UVICORN_GRACE_S = 5.0  # uvicorn cancels what is left only this long after our own deadline


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), before anything slow happens: a busy port fails at
    once (ValueError naming it) rather than after the model has loaded. Its protocol is
    IPPROTO_TCP, as the sockets asyncio opens itself: asyncio turns Nagle's algorithm off
    (TCP_NODELAY) only on connections whose socket says so, and with it on, a response written
    in two parts (headers, then a small body or SSE event) waited for the client's delayed ACK,
    up to 40 ms."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


class CleanExitServer(uvicorn.Server):
    """uvicorn's `Server`, except that a SIGTERM / SIGINT ends it with exit status 0 after
    uvicorn's graceful shutdown (uvicorn re-raises the signal). A second SIGINT stops waiting."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        else:
            self.should_exit = True


class DrainingServer(CleanExitServer):
    """See the module docstring. `config.timeout_graceful_shutdown` is set from
    `shutdown_timeout`."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        config.timeout_graceful_shutdown = int(shutdown_timeout + UVICORN_GRACE_S + 0.999)
        super().__init__(config)
        self.async_engine = async_engine
        self.shutdown_timeout = shutdown_timeout
        self.exit_reason: str | None = None  # set when the engine loop died

    def stop_for_dead_engine(self, reason: str) -> None:
        """Stop serving because the engine cannot go on (any thread)."""
        self.exit_reason = reason
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.async_engine.begin_drain()
        if self.async_engine.num_in_flight:
            logger.info("draining %d requests (at most %.1f s)", self.async_engine.num_in_flight,
                        self.shutdown_timeout)
        deadline = asyncio.get_running_loop().call_later(
            self.shutdown_timeout, self.async_engine.end_remaining,
            f"the server shut down before this request finished "
            f"(--shutdown-timeout {self.shutdown_timeout:g} s)")
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()
