"""The dual engine host: a plain engine and a speculative engine behind one address.

``python -m engine_host.router [--model M] [--port 8000] [--k-max 8] [--gpu-memory-utilization 0.4] ...``

starts two engine hosts (the *plain* one with ``--k-max 0``: no speculative config, so
vLLM keeps async scheduling, its newest model runner and full CUDA graphs; the
*speculative* one with n-gram drafts and SpecPilot's adaptive K) and serves, on one port:

* the OpenAI API (``/v1/completions``, ``/v1/chat/completions``, streaming or not,
  ``/v1/models``): each request goes to one engine, chosen by
  :class:`engine_host.routing.TrafficSplit` from the two engines' measured TPOT; the
  answer says which in the header ``x-specpilot-engine``;
* ``/health`` (200 while both engines answer), ``/ready`` (200 once both are ready);
* ``/metrics``: both engines' series with a label ``engine="plain"|"speculative"``,
  plus ``specpilot:router_*`` series (share, TPOT, requests routed);
* ``/control/state``: the speculative engine's state with a ``router`` section;
  ``/control/config``: the engine host's body plus ``"routing": "auto"|"plain"|"speculative"``
  and ``"router": {"p_min", "p_max", "eta", "tpot_margin", "p_probe", "probe_every_s", "probe_s",
  "probe_backoff", "probe_every_max_s"}``
  (the split's settings, live: :class:`engine_host.routing.TrafficSplit`)
  (speculation goes to the speculative engine, batch caps to both); ``/control/samples``.

Two fronts serve that port:

* ``--front engine`` (default): the plain engine host itself listens on the port and
  routes inside vLLM's server (:mod:`engine_host.front`): a request for the plain engine
  costs no extra hop; one for the speculative engine is relayed over HTTP.
* ``--front relay``: a separate router process (this module's app under uvicorn) relays
  every request; ``--workers N`` runs N of them (each keeps its own split from the same
  TPOT polls; with N > 1 the ``router`` figures are the answering worker's). The routing
  mode is shared through a file under ``$SPECPILOT_HOME/run`` that is checked before each
  request. ``--plain-url`` and ``--spec-url`` attach it to engine hosts already running.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import httpx
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from control.metrics_parse import select_families

from . import envs
from .auth import ENV_TOKEN, control_token, require_control_token
from .home import subdir
from .routing import ENGINES, PLAIN, ROUTING_MODES, SPECULATIVE, SPLIT_SETTINGS, TrafficSplit

logger = logging.getLogger("specpilot.router")

TPOT_FAMILY = "vllm:request_time_per_output_token_seconds"
POLL_INTERVAL_S = 0.25
ENV_ROUTER_CONFIG = envs.ROUTER_CONFIG
SCOPE_ENGINE = "specpilot.engine"  # ASGI scope key: the engine a request was routed to
# hop-by-hop headers and the length (the relay re-chunks); Content-Encoding stays: the bytes are relayed as sent
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass
class Backend:
    """One engine host behind the router: base URL, control token, requests in flight.

    Attributes:
        extra_headers: sent with every request the router makes to it (the in-engine
            front marks requests to its own engine, see :mod:`engine_host.front`).
        local_tpot: reads the TPOT histogram's ``(sum_s, count)`` without HTTP (the
            in-engine front's own engine); None: poll ``/metrics``.
    """

    name: str
    url: str
    token: str
    inflight: int = 0
    last_error: str | None = None
    extra_headers: dict[str, str] = field(default_factory=dict)
    local_tpot: Callable[[], tuple[float, float] | None] | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}", **self.extra_headers}


@dataclass
class RouterState:
    """Everything the router process holds (one instance per app)."""

    backends: dict[str, Backend]
    split: TrafficSplit = field(default_factory=TrafficSplit)
    client: httpx.AsyncClient | None = None
    poll_errors: int = 0
    mode_file: Path | None = None
    _mode_mtime: float = 0.0
    _poll_task: "asyncio.Task[None] | None" = None

    async def start(self) -> None:
        """Open the HTTP client and start :func:`poll_loop` (in the running event loop)."""
        if self.client is None:
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits)
        if self._poll_task is None:
            self._poll_task = asyncio.create_task(poll_loop(self))

    async def aclose(self) -> None:
        """Stop polling and close the HTTP client."""
        if self._poll_task is not None:
            self._poll_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll_task
            self._poll_task = None
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    def publish_mode(self, mode: str | None = None, settings: dict | None = None) -> None:
        """Set the routing mode and/or split settings (:meth:`TrafficSplit.configure`) here
        and, through :attr:`mode_file` (JSON ``{"mode", "settings"}``), in every worker.

        Raises:
            ValueError: an unknown mode or invalid settings (nothing changes).
        """
        if mode is not None and mode not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, got {mode!r}")
        if settings:
            self.split.configure(settings)
        if mode is not None:
            self.split.set_mode(mode)
        if self.mode_file is not None:
            tmp = self.mode_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"mode": self.split.mode, "settings": self.split.settings()}))
            os.replace(tmp, self.mode_file)
            self._mode_mtime = self.mode_file.stat().st_mtime

    def follow_mode(self) -> None:
        """Take up a mode (and split settings) another worker published."""
        if self.mode_file is None:
            return
        try:
            mtime = self.mode_file.stat().st_mtime
            if mtime != self._mode_mtime:
                self._mode_mtime = mtime
                doc = json.loads(self.mode_file.read_text())
                if doc.get("settings"):
                    self.split.configure(doc["settings"])
                self.split.set_mode(doc["mode"])
        except (OSError, ValueError, KeyError, AttributeError):
            pass


def tpot_totals(metrics_text: str) -> tuple[float, float] | None:
    """``(sum_s, count)`` of vLLM's TPOT histogram in a ``/metrics`` text (all label sets
    added), or None when the family is absent."""
    # only the one family is parsed: vLLM's full exposition is large and this runs 4x a second
    return _tpot_from(text_string_to_metric_families(select_families(metrics_text, {TPOT_FAMILY})))


def local_tpot_totals() -> tuple[float, float] | None:
    """``(sum_s, count)`` of vLLM's TPOT histogram in this process's Prometheus registry
    (the in-engine front reads its own engine so, without rendering the whole exposition
    4x a second), or None when vLLM has not registered it here."""
    from prometheus_client import REGISTRY

    # the registry's name index (prometheus_client's, unchanged since 0.4) finds the one collector
    collector = getattr(REGISTRY, "_names_to_collectors", {}).get(TPOT_FAMILY + "_sum")
    return None if collector is None else _tpot_from(collector.collect())


def _tpot_from(families: Any) -> tuple[float, float] | None:
    total_s = count = 0.0
    found = False
    for fam in families:
        if fam.name != TPOT_FAMILY:
            continue
        for s in fam.samples:
            if s.name == TPOT_FAMILY + "_sum":
                total_s += s.value
                found = True
            elif s.name == TPOT_FAMILY + "_count":
                count += s.value
    return (total_s, count) if found else None


def relabel(metrics_text: str, engine: str) -> list[Metric]:
    """Parsed metric families of one engine with ``engine=<name>`` added to every sample."""
    out = []
    for fam in text_string_to_metric_families(metrics_text):
        m = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        for s in fam.samples:
            m.add_sample(s.name, dict(s.labels, engine=engine), s.value, s.timestamp, s.exemplar)
        out.append(m)
    return out


class _Families:
    """A one-shot collector for :func:`prometheus_client.generate_latest`."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):  # noqa: D102
        return iter(self.families)


def merged_metrics(texts: dict[str, str], state: RouterState) -> bytes:
    """One exposition text: each engine's families merged under an ``engine`` label,
    plus the router's own ``specpilot:router_*`` series."""
    by_name: dict[str, Metric] = {}
    for engine, text in texts.items():
        for fam in relabel(text, engine):
            have = by_name.get(fam.name)
            if have is None:
                by_name[fam.name] = fam
            else:
                have.samples.extend(fam.samples)
    d = state.split.describe()
    share = GaugeMetricFamily("specpilot:router_speculative_share",
                              "share of new requests sent to the speculative engine (0..1)")
    share.add_metric([], d["p_speculative"])
    tpot = GaugeMetricFamily("specpilot:router_tpot_seconds",
                             "EWMA of each engine's windowed TPOT as the router sees it (s/token)", labels=["engine"])
    routed = CounterMetricFamily("specpilot:router_requests_routed", "requests sent to each engine",
                                 labels=["engine"])
    inflight = GaugeMetricFamily("specpilot:router_requests_in_flight", "requests in flight per engine",
                                 labels=["engine"])
    for e in ENGINES:
        w = state.split.windows[e].tpot_s
        if w is not None:
            tpot.add_metric([e], w)
        routed.add_metric([e], d["routed"][e])
        inflight.add_metric([e], state.backends[e].inflight)
    mode = GaugeMetricFamily("specpilot:router_mode_info", "routing mode in force (1 for the one in force)",
                             labels=["mode"])
    for m in ROUTING_MODES:
        mode.add_metric([m], 1.0 if d["mode"] == m else 0.0)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Families([*by_name.values(), share, tpot, routed, inflight, mode]))
    return generate_latest(reg)


async def poll_loop(state: RouterState) -> None:
    """Every :data:`POLL_INTERVAL_S`: read both engines' TPOT histograms, move the split."""
    assert state.client is not None
    while True:
        now = time.monotonic()
        for name, b in state.backends.items():
            try:
                totals = b.local_tpot() if b.local_tpot is not None else None
                if totals is None:
                    r = await state.client.get(b.url + "/metrics", headers=b.extra_headers or None, timeout=5.0)
                    r.raise_for_status()
                    totals = tpot_totals(r.text)
                if totals is not None:
                    state.split.observe(name, totals[0], totals[1], now)
                b.last_error = None
            except (httpx.HTTPError, ValueError) as exc:
                state.poll_errors += 1
                b.last_error = f"{type(exc).__name__}: {exc}"
        state.split.update(now)
        state.follow_mode()
        await asyncio.sleep(POLL_INTERVAL_S)


def create_app(state: RouterState) -> FastAPI:
    """The router's FastAPI app over ``state`` (its backends must be reachable later)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.aclose()

    app = FastAPI(title="SpecPilot engine router", lifespan=lifespan)

    async def proxy(request: Request, path: str) -> Any:
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
            return JSONResponse({"error": {"message": f"the {engine} engine did not answer: {exc}",
                                           "type": "engine_unavailable", "code": 502}}, status_code=502)

        closed = False

        async def close() -> None:  # once, whether the relay ran to its end or never started
            nonlocal closed
            if not closed:
                closed = True
                b.inflight -= 1
                await upstream.aclose()

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await close()

        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
        out_headers["x-specpilot-engine"] = engine
        return StreamingResponse(relay(), status_code=upstream.status_code, headers=out_headers,
                                 background=BackgroundTask(close))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await proxy(request, "/v1/chat/completions")

    async def get_json(engine: str, path: str, auth: bool = False, **params: Any) -> httpx.Response:
        b = state.backends[engine]
        assert state.client is not None
        return await state.client.get(b.url + path, headers=b.headers if auth else (b.extra_headers or None),
                                      params=params or None, timeout=30.0)

    @app.get("/v1/models")
    async def models() -> Any:
        try:
            r = await get_json(PLAIN, "/v1/models")
        except httpx.HTTPError as exc:
            raise HTTPException(502, f"the plain engine did not answer: {exc}") from None
        return JSONResponse(r.json(), status_code=r.status_code)

    async def probe(path: str) -> dict[str, int | str]:
        out: dict[str, int | str] = {}
        for e in ENGINES:
            try:
                out[e] = (await get_json(e, path)).status_code
            except httpx.HTTPError as exc:
                out[e] = f"down ({type(exc).__name__})"
        return out

    @app.get("/health")
    async def health() -> Any:
        st = await probe("/health")
        ok = all(v == 200 for v in st.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "engines": st}, status_code=200 if ok else 503)

    @app.get("/ready")
    async def ready() -> Any:
        st = await probe("/ready")
        ok = all(v == 200 for v in st.values())
        return JSONResponse({"phase": "ready" if ok else "loading", "engines": st}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Any:
        texts = {}
        for e in ENGINES:
            try:
                r = await get_json(e, "/metrics")
                if r.status_code == 200:
                    texts[e] = r.text
            except httpx.HTTPError:
                pass
        return PlainTextResponse(merged_metrics(texts, state), media_type="text/plain; version=0.0.4")

    def router_section() -> dict[str, Any]:
        state.follow_mode()
        return {**state.split.describe(), "worker_pid": os.getpid(),
                "in_flight": {e: b.inflight for e, b in state.backends.items()},
                "engines": {e: {"url": b.url, "last_poll_error": b.last_error} for e, b in state.backends.items()},
                "poll_errors": state.poll_errors}

    @app.get("/control/state", dependencies=[Depends(require_control_token)])
    async def control_state() -> Any:
        try:
            r = await get_json(SPECULATIVE, "/control/state", auth=True)
        except httpx.HTTPError as exc:
            raise HTTPException(503, f"the speculative engine did not answer: {exc}") from None
        if r.status_code != 200:
            return JSONResponse(r.json(), status_code=r.status_code)
        st = r.json()
        try:
            plain = (await get_json(PLAIN, "/control/state", auth=True)).json()
        except (httpx.HTTPError, ValueError):
            plain = None
        st["router"] = router_section()
        st["router"]["plain_engine"] = ({k: plain.get(k) for k in ("batch", "engine", "overhead", "limits")}
                                       if isinstance(plain, dict) else None)
        batch = st.get("batch") or {}
        if isinstance(plain, dict):
            pb = plain.get("batch") or {}
            for k in ("running", "waiting"):
                if isinstance(batch.get(k), int) and isinstance(pb.get(k), int):
                    batch[k] += pb[k]
        return st

    @app.get("/control/samples", dependencies=[Depends(require_control_token)])
    async def control_samples(since: float = 0.0) -> Any:
        try:
            r = await get_json(SPECULATIVE, "/control/samples", auth=True, since=since)
        except httpx.HTTPError as exc:
            raise HTTPException(503, f"the speculative engine did not answer: {exc}") from None
        return JSONResponse(r.json(), status_code=r.status_code)

    @app.put("/control/config", dependencies=[Depends(require_control_token)])
    async def control_config(request: Request) -> Any:
        try:
            patch = await request.json()
        except ValueError:
            raise HTTPException(422, "the body must be a JSON object") from None
        if not isinstance(patch, dict):
            raise HTTPException(422, "the body must be a JSON object")
        routing = patch.pop("routing", None)
        if routing is not None and routing not in ROUTING_MODES:
            return JSONResponse({"error": "invalid_config",
                                 "message": f"routing must be one of {', '.join(ROUTING_MODES)}, got {routing!r}"},
                                status_code=422)
        split_patch = patch.pop("router", None)
        if split_patch is not None:
            try:
                state.split.check_settings(split_patch)
            except ValueError as exc:
                return JSONResponse({"error": "invalid_config", "message": str(exc)}, status_code=422)
        answer: dict[str, Any] = {}
        assert state.client is not None
        if patch:
            spec = state.backends[SPECULATIVE]
            try:
                r = await state.client.put(spec.url + "/control/config", json=patch, headers=spec.headers,
                                           timeout=60.0)
            except httpx.HTTPError as exc:  # nothing was applied, routing included
                raise HTTPException(503, f"the speculative engine did not answer: {exc}") from None
            if r.status_code != 200:  # refused: nothing changes, routing included
                return JSONResponse(r.json(), status_code=r.status_code)
            answer = r.json()
            if "batch" in patch:
                plain = state.backends[PLAIN]
                try:
                    rp = await state.client.put(plain.url + "/control/config", json={"batch": patch["batch"]},
                                                headers=plain.headers, timeout=60.0)
                    answer["plain_engine"] = {"status": rp.status_code, "answer": rp.json()}
                except httpx.HTTPError as exc:
                    answer["plain_engine"] = {"status": None, "error": f"did not answer: {exc}"}
        if routing is not None or split_patch:
            state.publish_mode(routing, split_patch)
        answer["router"] = router_section()
        return answer

    return app


def state_from_config(cfg: dict[str, Any], token: str) -> RouterState:
    """A :class:`RouterState` from the JSON :func:`main` passes in ``$SPECPILOT_ROUTER_CONFIG``
    (backends by name and URL, split bounds and step, mode file)."""
    backends = {name: Backend(name, url, token) for name, url in cfg["backends"].items()}
    split = TrafficSplit(p=cfg["p_start"], **{k: cfg[k] for k in SPLIT_SETTINGS if k in cfg})
    state = RouterState(backends=backends, split=split, mode_file=Path(cfg["mode_file"]))
    state.follow_mode()
    return state


def router_config_from_env() -> dict[str, Any] | None:
    """The parsed ``$SPECPILOT_ROUTER_CONFIG``, or None when it is not set."""
    raw = envs.router_config()
    return json.loads(raw) if raw else None


def app_from_env() -> FastAPI:
    """The app for one uvicorn worker of the relay front (``--front relay``), built from
    ``$SPECPILOT_ROUTER_CONFIG`` (see :func:`state_from_config`). Every worker polls the
    engines and keeps its own split; the routing mode is shared through the mode file.

    Raises:
        RuntimeError: the variable is missing (the router was not started by :func:`main`).
    """
    cfg = router_config_from_env()
    if not cfg:
        raise RuntimeError(f"${ENV_ROUTER_CONFIG} is not set: start the router with python -m engine_host.router")
    return create_app(state_from_config(cfg, envs.control_token() or ""))


def split_settings(args: argparse.Namespace) -> dict[str, float]:
    """The split's settings (:data:`engine_host.routing.SPLIT_SETTINGS` but ``probe_s``) from
    the command line: shares as fractions 0..1, ``probe_every_s``/``probe_every_max_s`` in s."""
    return {"p_min": args.p_min, "p_max": args.p_max, "eta": args.eta, "tpot_margin": args.tpot_margin,
            "p_probe": args.p_probe, "probe_every_s": args.probe_every, "probe_backoff": args.probe_backoff,
            "probe_every_max_s": args.probe_every_max}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m engine_host.router",
        description="A plain engine and a speculative engine behind one OpenAI-compatible address; "
                    "each request goes to the one that currently gives it more tokens per second.",
        epilog="Arguments after '--' go to both engine hosts (python -m engine_host ...).")
    p.add_argument("--model", default="default", help="model for both engines (default: the default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--k-max", type=int, default=8, help="K_max of the speculative engine (tokens)")
    p.add_argument("--speculation-mode", default="adaptive", help="speculative engine's initial mode")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="GPU memory fraction for EACH engine (GPU build; two engines share one GPU: e.g. 0.4)")
    p.add_argument("--routing", choices=ROUTING_MODES, default="auto", help="initial routing")
    p.add_argument("--p-start", type=float, default=0.1, help="initial share of requests for the speculative engine")
    p.add_argument("--p-min", type=float, default=0.01,
                   help="floor of the speculative engine's share; resting there, it gets only probes")
    p.add_argument("--p-probe", type=float, default=0.1, help="share sent to the speculative engine during a probe")
    p.add_argument("--probe-every", type=float, default=20.0,
                   help="seconds from the share's coming to rest to the first probe of the speculative engine "
                        "(1 s each); 0: a constant share of --p-min instead")
    p.add_argument("--probe-backoff", type=float, default=2.0,
                   help="factor on the time to the next probe after each probe that leaves the share at its floor "
                        "(1: a probe every --probe-every seconds)")
    p.add_argument("--probe-every-max", type=float, default=300.0,
                   help="longest time between probes (s) that the backoff reaches")
    p.add_argument("--p-max", type=float, default=0.97, help="largest share of requests for the speculative engine")
    p.add_argument("--eta", type=float, default=0.5, help="step of the share's update per poll (0.25 s)")
    p.add_argument("--tpot-margin", type=float, default=0.0,
                   help="fraction by which the speculative engine's TPOT must beat the plain engine's before it "
                        "gains traffic (both share one GPU: see engine_host.routing); changeable live")
    p.add_argument("--front", choices=("engine", "relay"), default=None,
                   help="engine: the plain engine's own server takes the port and routes inside it (plain "
                        "requests cost no extra hop); relay: a separate router process relays every request "
                        "(default: engine; relay with --plain-url/--spec-url)")
    p.add_argument("--workers", type=int, default=1,
                   help="relay front: router processes (each relays requests; 4 or more at thousands of tokens/s)")
    p.add_argument("--plain-url", default=None, help="relay front: attach to this running plain engine host")
    p.add_argument("--spec-url", default=None, help="relay front: attach to this running speculative engine host")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for both engines")
    p.add_argument("engine_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.engine_args and args.engine_args[0] == "--":
        args.engine_args = args.engine_args[1:]
    if bool(args.plain_url) != bool(args.spec_url):
        p.error("--plain-url and --spec-url go together")
    if not 0.0 <= args.p_min <= args.p_start <= args.p_max <= 1.0:
        p.error("need 0 <= --p-min <= --p-start <= --p-max <= 1")
    if not (args.probe_every == 0 or args.probe_every >= 1.0):
        p.error("--probe-every must be 0 (no probes) or at least 1 s (a probe lasts 1 s)")
    try:  # the same checks as a live change of the split's settings
        TrafficSplit().check_settings(split_settings(args))
    except ValueError as exc:
        p.error(f"router settings: {exc}")
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if args.front is None:
        args.front = "relay" if args.plain_url else "engine"
    if args.front == "engine" and args.plain_url:
        p.error("--plain-url/--spec-url attach to running engines: only the relay front can (--front relay)")
    if args.front == "engine" and args.workers > 1:
        p.error("--workers is for the relay front; the engine front runs inside the plain engine's server")
    return args


def cpu_child_env(environ: dict[str, str] | None = None, ncpu: int | None = None) -> dict[str, str]:
    """Environment for the two engine hosts on vLLM's CPU build ({} on the GPU build).

    vLLM's "auto" binding pins each engine's OpenMP threads to the same cores: a second
    engine pinned beside a busy first one got almost no CPU time and never finished loading
    (2-core machine). Unpinned, each engine starts an OpenMP thread per core, and the Intel
    OpenMP runtime by default spins 200 ms after every parallel region, so two engines (and
    any other on the machine) slowed each other down several times over (figures in
    docs/engine_host.md, "Two engines on one CPU"). Each engine therefore gets half the
    cores (at least one), unpinned, with vLLM's own short spin (``KMP_BLOCKTIME=5`` ms).
    Settings already in the environment win.

    Args:
        environ: the environment to respect (default ``os.environ``).
        ncpu: cores on this machine (default ``os.cpu_count()``).
    """
    from .launcher import is_cpu_build

    environ = os.environ if environ is None else environ
    if not is_cpu_build() or "VLLM_CPU_OMP_THREADS_BIND" in environ:
        return {}
    threads = max(1, (ncpu or os.cpu_count() or 2) // 2)
    wanted = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads), "KMP_BLOCKTIME": "5"}
    return {k: v for k, v in wanted.items() if k not in environ}


def main(argv: list[str] | None = None) -> int:
    """Start both engine hosts (or attach), then serve until Ctrl-C / SIGTERM.

    ``--front engine``: the speculative engine host starts on a free port, then the plain
    one on ``--port`` with :mod:`engine_host.front` inside; this process only watches them.
    ``--front relay``: both start on free ports and uvicorn serves :func:`app_from_env`.
    """
    from .process import EngineHostError, EngineHostProcess

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    token, _ = control_token()
    os.environ[ENV_TOKEN] = token
    os.environ.pop(ENV_ROUTER_CONFIG, None)  # set below for the one process that routes
    mode_file = subdir("run") / f"router-{args.port}.routing"
    mode_file.write_text(json.dumps({"mode": args.routing}))
    config = {"p_start": args.p_start, **split_settings(args), "mode_file": str(mode_file), "front": args.front}
    children: list[tuple[str, EngineHostProcess]] = []
    if args.plain_url:
        config["backends"] = {PLAIN: args.plain_url.rstrip("/"), SPECULATIVE: args.spec_url.rstrip("/")}
    else:
        common = list(args.engine_args)
        if args.model != "default":
            common = ["--model", args.model, *common]
        if args.gpu_memory_utilization is not None:
            common += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        env = cpu_child_env()
        spec = EngineHostProcess(token=token, env=env, extra_args=[*common, "--k-max", str(args.k_max),
                                                                   "--speculation-mode", args.speculation_mode])
        if args.front == "engine":
            self_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
            config["backends"] = {PLAIN: f"http://{self_host}:{args.port}", SPECULATIVE: spec.url}
            plain = EngineHostProcess(port=args.port, host=args.host, token=token, extra_args=[*common, "--k-max", "0"],
                                      env={**env, ENV_ROUTER_CONFIG: json.dumps(config)})
            # the speculative one first: the plain one takes the public port and answers
            # /ready only once both engines are ready
            children = [(SPECULATIVE, spec), (PLAIN, plain)]
        else:
            plain = EngineHostProcess(token=token, env=env, extra_args=[*common, "--k-max", "0"])
            config["backends"] = {PLAIN: plain.url, SPECULATIVE: spec.url}
            children = [(PLAIN, plain), (SPECULATIVE, spec)]

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # start-up is cut short like Ctrl-C; uvicorn has its own handlers later

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        # one after the other: vLLM sizes its KV cache from the GPU memory that changes while
        # it profiles, so an engine starting beside another one sees the other's KV cache
        # appear and fails ("Available KV cache memory: -1.01 GiB", seen on an H100)
        for name, c in children:
            print(f"starting the {name} engine host: {c.url} (log {c.log_path})", flush=True)
            c.start()
            secs = c.wait_ready(timeout_s=args.ready_timeout)
            print(f"  {name} engine host ready in {secs:.1f} s", flush=True)
        b = config["backends"]
        print(f"SpecPilot engine router on http://{args.host}:{args.port} ({args.front} front; "
              f"plain {b[PLAIN]}, speculative {b[SPECULATIVE]}, routing {args.routing}"
              + (f", {args.workers} worker(s))" if args.front == "relay" else ")"), flush=True)
        if args.front == "engine":
            return watch(children)
        import uvicorn

        os.environ[ENV_ROUTER_CONFIG] = json.dumps(config)
        uvicorn.run("engine_host.router:app_from_env", factory=True, host=args.host, port=args.port,
                    workers=args.workers, log_level="warning")
    except EngineHostError as exc:
        print(f"error: an engine host did not start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for _, c in children:
            c.stop()
    return 0


def watch(children: list[tuple[str, Any]], interval_s: float = 1.0) -> int:
    """Wait while every engine host runs; returns 1 (with the reason on stderr) when one
    exits. Ctrl-C / SIGTERM end the wait with KeyboardInterrupt."""
    while True:
        for name, c in children:
            if not c.alive():
                print(f"error: the {name} engine host exited ({c.proc and c.proc.returncode}):\n{c.log_tail()}",
                      file=sys.stderr)
                return 1
        time.sleep(interval_s)


if __name__ == "__main__":
    sys.exit(main())
