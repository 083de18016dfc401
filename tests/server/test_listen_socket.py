"""The listening socket `pagedkv serve` and `pagedkv router` bind before start-up: its
connections have Nagle's algorithm off, as asyncio's own sockets do (with it on, a response
written in two parts waited up to 40 ms for the client's delayed ACK)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pagedkv.server.graceful import bind_socket


def test_accepted_connections_have_tcp_nodelay():
    async def scenario() -> int:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        sock = bind_socket("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            nodelay = await asyncio.wait_for(accepted, timeout=10)
            writer.close()
            return nodelay
        finally:
            server.close()

    assert asyncio.run(scenario()) != 0


def test_a_busy_port_is_a_value_error_naming_it():
    sock = bind_socket("127.0.0.1", 0)
    sock.listen()
    port = sock.getsockname()[1]
    try:
        with pytest.raises(ValueError, match=f"127.0.0.1:{port}"):
            bind_socket("127.0.0.1", port)
    finally:
        sock.close()
