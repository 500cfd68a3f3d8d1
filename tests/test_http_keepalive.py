"""SpecPilot's HTTP clients of vLLM's API server drop idle connections before the server does.

The server here answers a connection's first request and keeps it open; a later request on the
same connection after 1.5 s or more of idling is met as uvicorn meets one that arrives while its
keep-alive ends: the connection is closed without an answer. httpx's default pool reuses the
connection and fails; the pool of ``client_limits`` has dropped it and opens a new one."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from engine_host.http_keepalive import KEEPALIVE_EXPIRY_S, client_limits

CLOSES_AFTER_IDLE_S = 1.5


async def _serve() -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered_at = None
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")  # a GET: no body
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            if answered_at is not None and time.monotonic() - answered_at >= CLOSES_AFTER_IDLE_S:
                break  # the keep-alive ended as the request came: closed, no answer
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok")
            await writer.drain()
            answered_at = time.monotonic()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _two_gets(url: str, limits: httpx.Limits | None, idle_s: float) -> str:
    kwargs = {"limits": limits} if limits is not None else {}
    async with httpx.AsyncClient(base_url=url, timeout=5.0, **kwargs) as client:
        assert (await client.get("/")).text == "ok"
        await asyncio.sleep(idle_s)
        try:
            return (await client.get("/")).text
        except httpx.RemoteProtocolError as exc:
            return f"failed: {exc}"


def test_a_request_after_an_idle_spell_opens_a_new_connection_instead_of_meeting_the_servers_close() -> None:
    assert CLOSES_AFTER_IDLE_S < KEEPALIVE_EXPIRY_S < 5.0  # under vLLM's default keep-alive (5 s)

    async def run() -> tuple[str, str]:
        server, port = await _serve()
        url = f"http://127.0.0.1:{port}"
        idle = KEEPALIVE_EXPIRY_S + 0.3
        try:
            return await asyncio.gather(_two_gets(url, None, idle), _two_gets(url, client_limits(), idle))
        finally:
            server.close()
            await server.wait_closed()

    default, ours = asyncio.run(run())
    assert default.startswith("failed: Server disconnected")  # httpx's defaults reuse the stale connection
    assert ours == "ok"


def test_the_limits_keep_httpx_pool_sizes_unless_given() -> None:
    limits = client_limits()
    assert (limits.max_connections, limits.max_keepalive_connections) == (100, 20)
    assert limits.keepalive_expiry == pytest.approx(KEEPALIVE_EXPIRY_S)
    assert client_limits(1024, 256).max_connections == 1024
