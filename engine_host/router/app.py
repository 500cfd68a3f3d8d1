"""The dual engine host's HTTP surface: FastAPI routers over one :class:`RouterState`.

* ``openai_router``: ``POST /v1/completions``, ``POST /v1/chat/completions`` (each request
  relayed to the engine the split chooses, streamed as it comes, the engine named in the
  header ``x-specpilot-engine``) and ``GET /v1/models``;
* ``health_router``: ``/health`` (200 while both engines answer), ``/ready`` (200 once both
  are ready), ``/metrics`` (both engines under an ``engine`` label plus ``specpilot:router_*``);
* ``control_router`` (bearer token): ``/control/state`` (the speculative engine's state with
  a ``router`` section; its ``config`` carries the :class:`RouterSettings` in force as its
  ``router`` section and its ``limits`` say ``"dual": true``), ``/control/samples`` (the
  speculative engine's), ``PUT /control/config``.

``PUT /control/config`` takes a :class:`~engine_host.config.LiveConfig` patch: its
``router`` section (the split's settings and ``mode``; ``"routing": MODE`` at the top is
the same as ``{"router": {"mode": MODE}}``) is validated here, the rest goes to the
speculative engine (``batch`` to the plain engine too). The router section takes effect
only once the speculative engine accepted the rest; a refusal of either changes nothing.
A ``router`` of ``null`` (a config recorded before the section existed) leaves the settings
as they are.

The state reaches every route through ``Depends(router_state)`` (``app.state.router``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask

from .. import envs
from ..auth import require_control_token
from ..config import diff_configs
from .metrics import merged_metrics
from .settings import ENGINES, PLAIN, ROUTING_MODES, SPECULATIVE
from .state import ENV_ROUTER_CONFIG, RouterState, router_config_from_env, state_from_config

SCOPE_ENGINE = "specpilot.engine"  # ASGI scope key: the engine a request was routed to
# hop-by-hop headers and the length (the relay re-chunks); Content-Encoding stays: the bytes are relayed as sent
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive"}


def router_state(request: Request) -> RouterState:
    """FastAPI dependency: the :class:`RouterState` of the app serving ``request``."""
    return request.app.state.router


State = Annotated[RouterState, Depends(router_state)]


async def get_from(state: RouterState, engine: str, path: str, auth: bool = False, **params: Any) -> httpx.Response:
    """``GET path`` on one engine (with the control token when ``auth``; 30 s timeout).

    Raises:
        httpx.HTTPError: the engine did not answer.
    """
    b = state.backends[engine]
    assert state.client is not None
    return await state.client.get(
        b.url + path, headers=b.headers if auth else (b.extra_headers or None), params=params or None, timeout=30.0
    )


# --- the OpenAI API ---------------------------------------------------------------------

openai_router = APIRouter(tags=["openai"])


async def relay(state: RouterState, request: Request, path: str) -> Any:
    """Relay one OpenAI request to the engine chosen by the split (or by the in-engine
    front, :data:`SCOPE_ENGINE`), streaming the answer as it comes; 502 when that engine
    does not answer."""
    body = await request.body()
    engine = request.scope.get(SCOPE_ENGINE)  # chosen already by the in-engine front
    if engine is None:
        state.follow_mode()  # one stat(): a mode set through another worker holds from its answer on
        engine = state.split.choose()
    b = state.backends[engine]
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS | {"host"}}
    assert state.client is not None
    req = state.client.build_request(request.method, b.url + path, content=body, headers=headers)
    b.inflight += 1
    try:
        upstream = await state.client.send(req, stream=True)
    except httpx.HTTPError as exc:
        b.inflight -= 1
        return JSONResponse(
            {
                "error": {
                    "message": f"the {engine} engine did not answer: {exc}",
                    "type": "engine_unavailable",
                    "code": 502,
                }
            },
            status_code=502,
        )

    closed = False

    async def close() -> None:  # once, whether the relay ran to its end or never started
        nonlocal closed
        if not closed:
            closed = True
            b.inflight -= 1
            await upstream.aclose()

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await close()

    out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
    out_headers["x-specpilot-engine"] = engine
    return StreamingResponse(
        chunks(), status_code=upstream.status_code, headers=out_headers, background=BackgroundTask(close)
    )


@openai_router.post("/v1/completions")
async def completions(request: Request, state: State) -> Any:
    """OpenAI completions, relayed to the engine the split chooses."""
    return await relay(state, request, "/v1/completions")


@openai_router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: State) -> Any:
    """OpenAI chat completions, relayed to the engine the split chooses."""
    return await relay(state, request, "/v1/chat/completions")


@openai_router.get("/v1/models")
async def models(state: State) -> Any:
    """The plain engine's model list (both engines serve the same model)."""
    try:
        r = await get_from(state, PLAIN, "/v1/models")
    except httpx.HTTPError as exc:
        raise HTTPException(502, f"the plain engine did not answer: {exc}") from None
    return JSONResponse(r.json(), status_code=r.status_code)


# --- health and metrics -----------------------------------------------------------------

health_router = APIRouter(tags=["health"])


async def _status_of_both(state: RouterState, path: str) -> dict[str, int | str]:
    out: dict[str, int | str] = {}
    for e in ENGINES:
        try:
            out[e] = (await get_from(state, e, path)).status_code
        except httpx.HTTPError as exc:
            out[e] = f"down ({type(exc).__name__})"
    return out


@health_router.get("/health")
async def health(state: State) -> Any:
    """200 while both engines answer their ``/health``, 503 (naming the down one) otherwise."""
    st = await _status_of_both(state, "/health")
    ok = all(v == 200 for v in st.values())
    return JSONResponse({"status": "ok" if ok else "degraded", "engines": st}, status_code=200 if ok else 503)


@health_router.get("/ready")
async def ready(state: State) -> Any:
    """200 once both engines are ready, 503 before."""
    st = await _status_of_both(state, "/ready")
    ok = all(v == 200 for v in st.values())
    return JSONResponse({"phase": "ready" if ok else "loading", "engines": st}, status_code=200 if ok else 503)


@health_router.get("/metrics")
async def metrics(state: State) -> Any:
    """Both engines' series with an ``engine`` label, plus ``specpilot:router_*``."""
    texts = {}
    for e in ENGINES:
        try:
            r = await get_from(state, e, "/metrics")
            if r.status_code == 200:
                texts[e] = r.text
        except httpx.HTTPError:
            pass
    return PlainTextResponse(
        merged_metrics(texts, state.split, state.in_flight()), media_type="text/plain; version=0.0.4"
    )


# --- control ----------------------------------------------------------------------------

control_router = APIRouter(prefix="/control", tags=["control"], dependencies=[Depends(require_control_token)])


def router_section(state: RouterState) -> dict[str, Any]:
    """The ``router`` section of ``/control/state`` and of a config answer: the split's
    :meth:`~engine_host.router.split.TrafficSplit.describe` plus this process's pid,
    requests in flight, the engines' URLs and last poll errors."""
    state.follow_mode()
    return {
        **state.split.describe(),
        "worker_pid": os.getpid(),
        "in_flight": state.in_flight(),
        "engines": {e: {"url": b.url, "last_poll_error": b.last_error} for e, b in state.backends.items()},
        "poll_errors": state.poll_errors,
    }


def _with_router_settings(state: RouterState, body: dict[str, Any]) -> dict[str, Any]:
    """An engine's state or config answer as the dual host's: its ``config`` with the
    router section in force, its ``limits`` marked ``dual``."""
    if isinstance(body.get("config"), dict):
        body["config"]["router"] = state.split.config.model_dump(mode="json")
    if isinstance(body.get("limits"), dict):
        body["limits"]["dual"] = True
    return body


@control_router.get("/state")
async def control_state(state: State) -> Any:
    """The speculative engine's state, its config with the router section, and a
    ``router`` section (:func:`router_section`, with the plain engine's batch and identity)."""
    try:
        r = await get_from(state, SPECULATIVE, "/control/state", auth=True)
    except httpx.HTTPError as exc:
        raise HTTPException(503, f"the speculative engine did not answer: {exc}") from None
    if r.status_code != 200:
        return JSONResponse(r.json(), status_code=r.status_code)
    st = r.json()
    try:
        plain = (await get_from(state, PLAIN, "/control/state", auth=True)).json()
    except (httpx.HTTPError, ValueError):
        plain = None
    state.follow_mode()
    _with_router_settings(state, st)
    st["router"] = router_section(state)
    st["router"]["plain_engine"] = (
        {k: plain.get(k) for k in ("batch", "engine", "overhead", "limits")} if isinstance(plain, dict) else None
    )
    batch = st.get("batch") or {}
    if isinstance(plain, dict):
        pb = plain.get("batch") or {}
        for k in ("running", "waiting"):
            if isinstance(batch.get(k), int) and isinstance(pb.get(k), int):
                batch[k] += pb[k]
    return st


@control_router.get("/samples")
async def control_samples(state: State, since: float = 0.0) -> Any:
    """The speculative engine's per-second samples after ``since`` (unix s)."""
    try:
        r = await get_from(state, SPECULATIVE, "/control/samples", auth=True, since=since)
    except httpx.HTTPError as exc:
        raise HTTPException(503, f"the speculative engine did not answer: {exc}") from None
    return JSONResponse(r.json(), status_code=r.status_code)


def _refused(message: str) -> JSONResponse:
    return JSONResponse({"error": "invalid_config", "message": message}, status_code=422)


@control_router.put("/config")
async def control_config(request: Request, state: State) -> Any:
    """Apply a config patch (module docstring): 422 with the reason when the router section
    or the routing is invalid, the engine's own answer when it refuses; nothing changes then."""
    try:
        patch = await request.json()
    except ValueError:
        raise HTTPException(422, "the body must be a JSON object") from None
    if not isinstance(patch, dict):
        raise HTTPException(422, "the body must be a JSON object")
    routing = patch.pop("routing", None)
    if routing is not None and routing not in ROUTING_MODES:
        return _refused(f"routing must be one of {', '.join(ROUTING_MODES)}, got {routing!r}")
    router_patch = patch.pop("router", None)
    if router_patch is not None and not isinstance(router_patch, dict):
        return _refused("router: the router settings must be a JSON object")
    router_patch = dict(router_patch or {})
    if routing is not None:
        if router_patch.get("mode", routing) != routing:
            return _refused(f"routing {routing!r} and router.mode {router_patch['mode']!r} disagree")
        router_patch["mode"] = routing
    state.follow_mode()
    old = state.split.config
    try:
        new = old.patched(router_patch)
    except ValueError as exc:
        return _refused(f"router: {exc}")
    answer: dict[str, Any] = {}
    assert state.client is not None
    if patch:
        spec = state.backends[SPECULATIVE]
        try:
            r = await state.client.put(spec.url + "/control/config", json=patch, headers=spec.headers, timeout=60.0)
        except httpx.HTTPError as exc:  # nothing was applied, routing included
            raise HTTPException(503, f"the speculative engine did not answer: {exc}") from None
        if r.status_code != 200:  # refused: nothing changes, routing included
            return JSONResponse(r.json(), status_code=r.status_code)
        answer = r.json()
        if "batch" in patch:
            plain = state.backends[PLAIN]
            try:
                rp = await state.client.put(
                    plain.url + "/control/config", json={"batch": patch["batch"]}, headers=plain.headers, timeout=60.0
                )
                answer["plain_engine"] = {"status": rp.status_code, "answer": rp.json()}
            except httpx.HTTPError as exc:
                answer["plain_engine"] = {"status": None, "error": f"did not answer: {exc}"}
    if router_patch:
        state.publish_mode(settings=router_patch)
    _with_router_settings(state, answer)
    if isinstance(answer.get("diff"), list):
        answer["diff"] = sorted(
            answer["diff"]
            + diff_configs({"router": old.model_dump(mode="json")}, {"router": new.model_dump(mode="json")}),
            key=lambda d: d["field"],
        )
    answer["router"] = router_section(state)
    return answer


# --- the app ----------------------------------------------------------------------------


def create_app(state: RouterState) -> FastAPI:
    """The router's FastAPI app over ``state`` (its backends must be reachable later); the
    app's lifespan starts and stops the state (:meth:`RouterState.start`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.aclose()

    app = FastAPI(title="SpecPilot engine router", lifespan=lifespan)
    app.state.router = state
    for r in (openai_router, health_router, control_router):
        app.include_router(r)
    return app


def app_from_env() -> FastAPI:
    """The app for one uvicorn worker of the relay front (``--front relay``), built from
    ``$SPECPILOT_ROUTER_CONFIG`` (see :func:`~engine_host.router.state.state_from_config`).
    Every worker polls the engines and keeps its own split; the routing mode and settings
    are shared through the routing file.

    Raises:
        RuntimeError: the variable is missing (the router was not started by its CLI).
    """
    cfg = router_config_from_env()
    if not cfg:
        raise RuntimeError(f"${ENV_ROUTER_CONFIG} is not set: start the router with python -m engine_host.router")
    return create_app(state_from_config(cfg, envs.control_token() or ""))
