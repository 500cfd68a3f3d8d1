"""The in-engine front of the dual engine host: routing inside the plain engine's server.

With ``python -m engine_host.router`` (``--front engine``, the default) the *plain*
engine host listens on the public port and this ASGI middleware, installed inside vLLM's
own API server (:class:`RouterEndpoints`, which the engine host's endpoint plugin loads
because the router names it in ``$SPECPILOT_ENDPOINT_EXTENSIONS``), routes each OpenAI
request:

* to the plain engine: the request goes straight on to vLLM's app in the same process,
  no second HTTP hop, no copy of the streamed tokens (under load nearly every request);
* to the speculative engine: it is relayed over HTTP by the router app
  (:func:`engine_host.router.app.create_app`), as the separate router process does.

The router app also answers ``/health``, ``/ready``, ``/metrics`` (both engines, with an
``engine`` label) and ``/control/*`` (the speculative engine's state plus the ``router``
section) on the public port. It reaches the plain engine's own routes through this same
port with the header :data:`INTERNAL_HEADER`, which sends a request past the front.

It exists because the separate relay process cost the plain path a large share of its
throughput under load (docs/gpu.md, "the dual engine host"); this front removes that hop.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .. import envs
from .app import SCOPE_ENGINE, create_app
from .metrics import local_tpot_totals
from .settings import PLAIN, SPECULATIVE
from .state import RouterState, router_config_from_env, state_from_config

logger = logging.getLogger("specpilot.front")

INTERNAL_HEADER = "x-specpilot-front"
_INTERNAL_KEY = INTERNAL_HEADER.encode()
ROUTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
OWNED_PATHS = frozenset({"/health", "/ready", "/metrics", "/metrics/"})
OWNED_PREFIX = "/control/"

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


def is_internal(scope: Scope) -> bool:
    """True when the request carries :data:`INTERNAL_HEADER` (the router's own calls)."""
    return any(k == _INTERNAL_KEY for k, _ in scope.get("headers") or ())


class RouterFront:
    """Pure ASGI middleware (no per-token work on the plain path) in front of vLLM's app.

    Args:
        app: vLLM's ASGI app (the next one in the middleware stack).
        state: the :class:`~engine_host.router.state.RouterState` (split, backends, HTTP
            client); its :meth:`~engine_host.router.state.RouterState.start` must run in the
            server's event loop before requests arrive (:meth:`RouterEndpoints.init_state`).
    """

    def __init__(self, app: ASGIApp, state: RouterState):
        self.app = app
        self.state = state
        self.router_app = create_app(state)

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path in ROUTED_PATHS and scope["method"] == "POST" and not is_internal(scope):
            await self._route(scope, receive, send)
        elif (path in OWNED_PATHS or path.startswith(OWNED_PREFIX)) and not is_internal(scope):
            await self.router_app(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _route(self, scope: Scope, receive: Callable, send: Callable) -> None:
        state = self.state
        state.follow_mode()  # one stat(): a mode published by another API-server process
        engine = state.split.choose()
        if engine == SPECULATIVE:
            await self.router_app({**scope, SCOPE_ENGINE: SPECULATIVE}, receive, send)
            return
        backend = state.backends[PLAIN]

        async def send_tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-specpilot-engine", b"plain")]}
            await send(message)

        backend.inflight += 1
        try:
            await self.app(scope, receive, send_tagged)
        finally:
            backend.inflight -= 1


FRONT_STATE: RouterState | None = None  # the state of this process's front, once installed


def install_front(app: Any, cfg: dict[str, Any]) -> RouterState:
    """Put :class:`RouterFront` in front of vLLM's routes.

    Args:
        app: vLLM's FastAPI app, before it starts (middleware cannot be added later).
        cfg: the router config (``$SPECPILOT_ROUTER_CONFIG``): its ``plain`` backend is
            this server itself (reached with :data:`INTERNAL_HEADER`, TPOT read in process).
    Returns:
        The front's :class:`~engine_host.router.state.RouterState`.
    """
    global FRONT_STATE
    state = state_from_config(cfg, envs.control_token() or "")
    plain = state.backends[PLAIN]
    plain.extra_headers = {INTERNAL_HEADER: "1"}
    plain.local_tpot = local_tpot_totals
    app.add_middleware(RouterFront, state=state)
    FRONT_STATE = state
    logger.info("SpecPilot in-engine front: plain here, speculative engine at %s", state.backends[SPECULATIVE].url)
    return state


class RouterEndpoints:
    """The in-engine front as an extension of the engine host's endpoint plugin (same
    contract as ``vllm.plugins.endpoint_plugins.interface.EndpointPlugin``): the plain
    engine host of ``python -m engine_host.router`` loads it through
    ``$SPECPILOT_ENDPOINT_EXTENSIONS`` (see ``engine_host.plugin``)."""

    name = "specpilot_router_front"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        """Install the front when ``$SPECPILOT_ROUTER_CONFIG`` asks for it (``"front": "engine"``)."""
        cfg = router_config_from_env()
        if cfg and cfg.get("front") == "engine":
            install_front(app, cfg)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Start the front's polls and HTTP client in the server's event loop."""
        if FRONT_STATE is not None:
            await FRONT_STATE.start()
