"""Keep-alive of SpecPilot's HTTP clients of vLLM's API server.

vLLM's API server (uvicorn) closes a connection that has been idle for
``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` seconds (default 5). httpx keeps an idle connection for 5 s as
well (``httpx.Limits.keepalive_expiry``), so a request sent on a connection idle for about 5 s
can reach the server as it closes that connection: the client gets ``httpx.RemoteProtocolError``
("Server disconnected without sending a response") for a request the server never read. The
clients that go idle between requests (the dual engine host's router between bursts, a
benchmark arm while the other arms run, the control daemon between heartbeats) let idle
connections go well before the server does.
"""

from __future__ import annotations

import httpx

# an idle connection is dropped after this many seconds (s), under vLLM's default keep-alive (5 s)
KEEPALIVE_EXPIRY_S = 2.0


def client_limits(max_connections: int | None = 100, max_keepalive_connections: int | None = 20) -> httpx.Limits:
    """``httpx.Limits`` for a client of vLLM's API server: httpx's defaults for the pool sizes
    (connections) and :data:`KEEPALIVE_EXPIRY_S` for idle connections."""
    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_keepalive_connections,
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )
