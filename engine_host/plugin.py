"""SpecPilot's routes inside vLLM's OpenAI-compatible server (an endpoint plugin).

Registered under the entry-point group ``vllm.endpoint_plugins`` and allow-listed by
the launcher through ``VLLM_PLUGINS``. Adds:

* ``GET /ready``: 200 once the engine is loaded and the start-up warm-up finished,
  503 with the phase before;
* ``GET /control/state``: the live config, controller state, caps, engine identity;
* ``PUT /control/config``: validate, publish, wait for the engine core's
  acknowledgement (within one engine step), answer with what took effect;
* ``GET /control/samples?since=``: per-second samples for live views;
* ``GET /control/warmup/runs?after_id=``: warm-up and heartbeat runs;
* ``specpilot:*`` Prometheus series, computed at scrape time, beside vLLM's ``vllm:*``
  series on the same ``GET /metrics``.

``/control/*`` needs ``Authorization: Bearer <token>`` (``$SPECPILOT_CONTROL_TOKEN``).

Further endpoint plugins named in ``$SPECPILOT_ENDPOINT_EXTENSIONS`` (``module:factory``,
comma-separated; same contract) are loaded and called with it: the dual engine host puts
its in-engine front there (``engine_host.router.front:RouterEndpoints``), so that this
module knows nothing of the router.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel

from . import envs
from .auth import ControlAuthError, control_auth_error_handler, require_control_token
from .channel import ACK_APPLIED, ACK_REFUSED, CONFIG_BYTES, Channel, ChannelError, channel_from_env
from .config import ConfigError, EngineLimits, LiveConfig, apply_patch, diff_configs
from .schema import (
    ApplyAnswer,
    ConfigPatch,
    ControlState,
    ErrorAnswer,
    SamplesAnswer,
    WarmupRunsAnswer,
    openapi_schema,
)
from .stats import SAMPLES
from .warmup import RUNS, start_background_tasks

logger = logging.getLogger("specpilot.plugin")

ENV_EXTENSIONS = envs.ENDPOINT_EXTENSIONS
#: How long ``PUT /control/config`` waits for the engine core's decision (s). The core
#: decides at its next step; a CPU step of a full batch with a long prefill chunk can
#: take seconds on a small machine, so this is well above one step.
ACK_TIMEOUT_S = 10.0
#: How long the API waits for the command lock to withdraw a command it gave up on (s).
LOCK_WAIT_S = 5.0
#: Largest ``PUT /control/config`` body (bytes); larger is 413.
MAX_BODY_BYTES = 1024 * 1024
#: Deepest nesting of arrays/objects in a ``PUT /control/config`` body; deeper is 422.
MAX_BODY_DEPTH = 32


class ChannelBusy(RuntimeError):
    """The command lock could not be taken in time (the engine core holds it: stopped
    or stuck in the middle of a config decision)."""


async def _take_channel_lock(channel: Channel, timeout_s: float) -> None:
    """Take the channel's command lock without blocking the event loop.

    Raises:
        ChannelBusy: not taken within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not channel.try_lock():
        if time.monotonic() >= deadline:
            raise ChannelBusy(f"the control channel stayed locked for {timeout_s:.0f} s")
        await asyncio.sleep(0.002)


class EngineHostState:
    """What the API process knows: the channel, identity, warm-up phase, apply lock."""

    def __init__(self) -> None:
        self.channel: Channel | None = None
        self.engine_client: Any = None
        self.args: Any = None
        self.pid = os.getpid()
        self.started_at = time.time()
        self.phase = "loading"  # loading -> warming_up -> ready | warmup_failed
        self.ready_at: float | None = None
        self.warmup: dict[str, Any] = {"runs": 0, "seconds": None, "error": None}
        self.lock = asyncio.Lock()

    async def set_warmup_k(self, k: int | None, timeout_s: float = 10.0) -> None:
        """Hold the engine core at draft length ``k`` (None: back to the policy) and
        wait until it says so. Keeps the config version unchanged."""
        if self.channel is None:
            return
        async with self.lock:
            await _take_channel_lock(self.channel, timeout_s)
            try:
                _, payload = self.channel.read_config()
                payload = payload or {}
                self.channel.write_config(int(payload.get("version", 0)), payload.get("config") or {}, warmup_k=k)
            finally:
                self.channel.unlock()
        await _wake_engine_core()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (self.core_state() or {}).get("warmup_k") == k:
                return
            await asyncio.sleep(0.005)
        raise RuntimeError(f"the engine core did not take warm-up K={k} within {timeout_s:.0f} s")

    def core_state(self) -> dict[str, Any] | None:
        if self.channel is None:
            return None
        try:
            return self.channel.read_state()
        except ChannelError:
            return None


HOST = EngineHostState()


def _core_or_503() -> dict[str, Any]:
    state = HOST.core_state()
    if state is None:
        raise HTTPException(status_code=503, detail="the engine core has not published its state yet")
    return state


def build_state() -> dict[str, Any]:
    """The JSON answered by ``GET /control/state``."""
    core = _core_or_503()
    cfg = core.get("config") or {}
    spec = cfg.get("speculation", {})
    limits = core.get("limits", {})
    caps = core.get("caps_in_force", {})
    ctl = core.get("controller", {})
    k_hi = spec.get("k_max") if spec.get("k_max") is not None else limits.get("k_max")
    return {
        "config_version": core.get("config_version"),
        "config": cfg,
        "config_applied_at": core.get("config_applied_at"),
        "config_error": core.get("config_error"),
        "config_ack_step": core.get("config_ack_step"),
        "k_first_use_step": core.get("k_first_use_step"),
        "speculation": {
            "mode": spec.get("mode"),
            "k_current": core.get("k_current"),
            "k_next": core.get("k_next"),
            "k": spec.get("k"),
            "k_min": spec.get("k_min"),
            "k_max": k_hi,
            "k_max_engine": limits.get("k_max"),
            "method": limits.get("speculative_method"),
            "draft_model": limits.get("draft_model"),
            "draft_name": Path(limits["draft_model"]).name if limits.get("draft_model") else None,
            "per_request": core.get("per_request"),
        },
        "batch": {
            "max_num_seqs": caps.get("max_num_seqs"),
            "max_num_batched_tokens": caps.get("max_num_batched_tokens"),
            "running": core.get("running"),
            "waiting": core.get("waiting"),
            "max_running_seen_since_config": core.get("max_running_seen_since_config"),
        },
        "limits": limits,
        "controller": ctl,
        "overhead": core.get("overhead"),
        "engine": {
            "pid": HOST.pid,
            "started_at": HOST.started_at,
            "core_pid": core.get("core_pid"),
            "core_started_at": core.get("core_started_at"),
            "core_cpu": core.get("core_cpu"),
            "core_thread_cpus": core.get("core_thread_cpus"),
            "core_cpu_threads_moved": core.get("core_cpu_threads_moved"),
            "phase": HOST.phase,
            "ready_at": HOST.ready_at,
            "model": limits.get("model"),
            "step_index": core.get("step_index"),
        },
        "warmup": HOST.warmup,
    }


async def _wake_engine_core() -> None:
    """Make an idle engine core run one loop iteration (it then reads the channel)."""
    client = HOST.engine_client
    if client is None:
        return
    try:
        await asyncio.wait_for(client.is_sleeping(), timeout=2.0)
    except Exception:  # an engine that cannot answer is reported by the ack timeout
        logger.debug("wake-up call to the engine core failed", exc_info=True)


async def check_prompt_lengths(config: LiveConfig, limits: EngineLimits) -> None:
    """Refuse heartbeat prompts that do not fit the model's context with their max_tokens.

    Raises:
        ConfigError: names each prompt that is too long (tokens counted with the
            engine's tokenizer; without it, one token per character is assumed).
    """
    tok = None
    client = HOST.engine_client
    if client is not None:
        try:
            tok = client.get_tokenizer()
            if asyncio.iscoroutine(tok):
                tok = await tok
        except Exception:
            tok = None
    errors = []
    for i, hb in enumerate(config.warmup.heartbeats):
        for j, prompt in enumerate(hb.prompts):
            n = len(tok.encode(prompt)) if tok is not None else len(prompt)
            if n + hb.max_tokens > limits.max_model_len:
                errors.append(
                    {
                        "loc": ["warmup", "heartbeats", i, "prompts", j],
                        "msg": f"prompt of {n} tokens + max_tokens {hb.max_tokens} exceeds the model's "
                        f"context of {limits.max_model_len} tokens",
                    }
                )
    if errors:
        raise ConfigError(errors)


async def apply_config(patch: dict[str, Any]) -> dict[str, Any]:
    """Validate ``patch`` against the config in force, publish it, wait for the engine
    core's decision.

    The command is published and, when the API gives up waiting, withdrawn under the
    channel's command lock (see :mod:`engine_host.channel`): a command answered 503 was
    not applied and never will be; one the core applied is answered 200, late or not.

    Returns:
        An :class:`~engine_host.schema.ApplyAnswer` as a dict.
    Raises:
        ConfigError / RestartRequired: refused; nothing changed.
        HTTPException(413): the config does not fit the control channel.
        HTTPException(503): the engine core took no decision within ``ACK_TIMEOUT_S``;
            the command was withdrawn (not applied).
        HTTPException(504): the engine core stopped in the middle of its decision; the
            outcome is unknown (``GET /control/state`` says which version is in force).
    """
    channel = HOST.channel
    if channel is None:
        raise HTTPException(
            status_code=503, detail="no control channel: start the engine host with python -m engine_host"
        )
    async with HOST.lock:
        core = _core_or_503()
        limits = EngineLimits.model_validate(core["limits"])
        current = LiveConfig.model_validate(core["config"])
        new = apply_patch(current, patch, limits)
        await check_prompt_lengths(new, limits)
        old_version = int(core.get("config_version") or 0)
        version = old_version + 1
        new_dump, old_dump = new.model_dump(mode="json"), current.model_dump(mode="json")
        t0 = time.monotonic()
        try:
            await _take_channel_lock(channel, LOCK_WAIT_S)
        except ChannelBusy as exc:
            raise HTTPException(status_code=503, detail=f"{exc}; nothing was sent, the config is unchanged") from None
        try:
            warmup_k = (channel.read_config()[1] or {}).get("warmup_k")
            try:
                channel.write_config(version, new_dump, warmup_k=warmup_k)
            except ChannelError as exc:
                raise HTTPException(
                    status_code=413,
                    detail=f"the config does not fit the engine's control channel ({CONFIG_BYTES} bytes): {exc}",
                ) from None
            seq = channel.config_seq()
        finally:
            channel.unlock()
        await _wake_engine_core()
        outcome = await _wait_for_decision(channel, seq, t0)
        if outcome is None:  # gave up: withdraw under the lock, unless the core decided meanwhile
            try:
                await _take_channel_lock(channel, LOCK_WAIT_S)
            except ChannelBusy:
                raise HTTPException(
                    status_code=504,
                    detail=f"the engine core stopped while deciding on config version {version}; whether it took "
                    "effect is unknown: read GET /control/state",
                ) from None
            try:
                ack_seq, ack = channel.read_ack()
                outcome = ack if ack_seq == seq else None
                if outcome is None:
                    channel.write_config(old_version, old_dump, warmup_k=warmup_k, withdrawn=version)
            finally:
                channel.unlock()
            if outcome is None:
                raise HTTPException(
                    status_code=503,
                    detail=f"the engine core did not acknowledge config version {version} within "
                    f"{ACK_TIMEOUT_S:.0f} s (busy or stopped); the command was withdrawn and will not be applied: "
                    f"version {old_version} stays in force",
                )
        state = HOST.core_state() or core
        if outcome == ACK_REFUSED:
            await _take_channel_lock(channel, LOCK_WAIT_S)
            try:
                channel.write_config(old_version, old_dump, warmup_k=warmup_k, withdrawn=version)
            finally:
                channel.unlock()
            raise ConfigError(
                [
                    {
                        "loc": ["config"],
                        "msg": state.get("config_error") or f"version {version} refused by the engine core",
                    }
                ]
            )
        return {
            "config_version": version,
            "previous_version": old_version,
            "config": new_dump,
            "diff": diff_configs(old_dump, new_dump),
            "applied": True,
            "applied_at": state.get("config_applied_at"),
            "ack_step": state.get("config_ack_step"),
            "apply_latency_ms": round((time.monotonic() - t0) * 1000.0, 3),
            "k_current": state.get("k_current"),
            "k_next": state.get("k_next"),
        }


_WAKES: set[asyncio.Future[None]] = set()  # wake-up calls in flight, referenced until done


async def _wait_for_decision(channel: Channel, seq: int, t0: float) -> int | None:
    """Poll the acknowledgement word (one struct read) until the core decided on the
    command published as ``seq``: ``ACK_APPLIED``/``ACK_REFUSED``, None on timeout. The
    idle core is woken again every second (a wake-up can race its lock attempt)."""
    delay, next_wake = 0.001, t0 + 1.0
    while time.monotonic() - t0 < ACK_TIMEOUT_S:
        ack_seq, outcome = channel.read_ack()
        if ack_seq == seq and outcome in (ACK_APPLIED, ACK_REFUSED):
            return outcome
        if time.monotonic() >= next_wake:
            next_wake += 1.0
            task = asyncio.ensure_future(_wake_engine_core())
            _WAKES.add(task)
            task.add_done_callback(_WAKES.discard)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.02)
    return None


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (iterative: any depth is safe)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, d)
            if d > MAX_BODY_DEPTH:
                return d
            stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def _refusal(status: int, loc: list[Any], msg: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"detail": [{"loc": loc, "msg": msg}], "message": msg})


async def parse_config_body(request: Request) -> Any:
    """The JSON body of ``PUT /control/config``, or a refusal naming the cause.

    Returns:
        The parsed body, or a ``JSONResponse``: 413 over :data:`MAX_BODY_BYTES`, 422 for
        malformed JSON or nesting deeper than :data:`MAX_BODY_DEPTH`.
    """
    declared = request.headers.get("content-length")
    too_big = f"the request body is larger than the limit of {MAX_BODY_BYTES} bytes"
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return _refusal(413, ["body"], too_big)
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            return _refusal(413, ["body"], too_big)
    try:
        body = json.loads(raw or b"null")
    except RecursionError:
        return _refusal(422, ["body"], f"the JSON body is nested deeper than {MAX_BODY_DEPTH} levels")
    except ValueError as exc:
        return _refusal(422, ["body"], f"malformed JSON: {exc}")
    if _depth(body) > MAX_BODY_DEPTH:
        return _refusal(422, ["body"], f"the JSON body is nested deeper than {MAX_BODY_DEPTH} levels")
    return body


control_router = APIRouter(prefix="/control", tags=["control"], dependencies=[Depends(require_control_token)])


_REFUSALS: dict[int | str, dict[str, Any]] = {
    409: {"model": ErrorAnswer, "description": "needs an engine restart; nothing changed"},
    413: {"model": ErrorAnswer, "description": "body or config too large; nothing changed"},
    422: {"model": ErrorAnswer, "description": "invalid config, malformed or too deep JSON; nothing changed"},
    503: {"description": "no decision by the engine core in time; the command was withdrawn (not applied)"},
    504: {"description": "the engine core stopped mid-decision; the outcome is unknown"},
}


@control_router.get("/state", response_model=ControlState)
async def get_state() -> dict[str, Any]:
    """Live config, controller state, caps in force and engine identity."""
    return build_state()


@control_router.put(
    "/config",
    response_model=ApplyAnswer,
    responses=_REFUSALS,
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": openapi_schema(ConfigPatch)}}}
    },
)
async def put_config(request: Request) -> Any:
    """Apply a partial config live (within one engine step). 422 invalid, 409 needs a
    restart, 413 too large, 503 not acknowledged in time (withdrawn, not applied).

    Body: any subset of ``{"speculation": {...}, "batch": {...}, "warmup": {...}}``
    (:class:`~engine_host.schema.ConfigPatch`).
    """
    body = await parse_config_body(request)
    if isinstance(body, JSONResponse):
        return body
    try:
        return await apply_config(body)
    except ConfigError as exc:
        return JSONResponse(status_code=exc.status, content={"detail": exc.errors, "message": str(exc)})


@control_router.get("/samples", response_model=SamplesAnswer)
async def get_samples(
    since: float | None = Query(None, description="unix seconds; only samples after this"),
) -> dict[str, Any]:
    """Per-second samples (last 10 minutes) for live views."""
    return {"now": time.time(), "samples": SAMPLES.samples(since)}


@control_router.get("/warmup/runs", response_model=WarmupRunsAnswer)
async def get_warmup_runs(
    after_id: int = Query(0, ge=0, description="only runs with a larger id (incremental fetch)"),
) -> dict[str, Any]:
    """Warm-up and heartbeat runs (start, duration, TTFT, outcome), oldest first."""
    core = HOST.core_state() or {}
    return {
        "runs": RUNS.since(after_id),
        "warmup": HOST.warmup,
        "phase": HOST.phase,
        "warmup_steps_at_k": core.get("warmup_steps_at_k"),
        "heartbeats": ((core.get("config") or {}).get("warmup") or {}).get("heartbeats", []),
        "internal_requests_total": SAMPLES.internal_requests_total,
    }


class ReadyAnswer(BaseModel):
    """Body of ``GET /ready``."""

    ready: bool
    phase: str
    warmup: dict[str, Any]


health_router = APIRouter(tags=["health"])


@health_router.get("/ready", response_model=ReadyAnswer)
async def ready() -> Any:
    """200 when the engine is loaded and warmed up, 503 before (or if warm-up failed)."""
    body = {"ready": HOST.phase == "ready", "phase": HOST.phase, "warmup": HOST.warmup}
    return JSONResponse(status_code=200 if body["ready"] else 503, content=body)


class SpecPilotCollector:
    """``specpilot:*`` series computed at scrape time from the engine core's state."""

    def collect(self):  # noqa: D102
        core = HOST.core_state()
        if core is None:
            return
        cfg = core.get("config") or {}
        spec = cfg.get("speculation", {})
        caps = core.get("caps_in_force", {})
        ctl = core.get("controller", {})
        limits = core.get("limits", {})

        def gauge(name: str, doc: str, value: Any, labels: dict[str, str] | None = None):
            g = GaugeMetricFamily(f"specpilot:{name}", doc, labels=list(labels or {}))
            if value is not None:
                g.add_metric(list((labels or {}).values()), float(value))
            return g

        yield gauge("speculation_k", "Draft length K in force (tokens).", core.get("k_current"))
        yield gauge(
            "speculation_k_max",
            "Upper bound of K (tokens), engine K_max when unset.",
            spec.get("k_max") if spec.get("k_max") is not None else limits.get("k_max"),
        )
        yield gauge("speculation_k_max_engine", "K_max the engine was started with (tokens).", limits.get("k_max"))
        info = GaugeMetricFamily(
            "specpilot:speculation_info",
            "Speculation method and draft the engine was started with (1 for the pair; "
            "draft empty for n-gram drafts, method none without speculation).",
            labels=["method", "draft"],
        )
        draft = limits.get("draft_model")
        info.add_metric([str(limits.get("speculative_method") or "none"), Path(draft).name if draft else ""], 1.0)
        yield info
        mode = GaugeMetricFamily(
            "specpilot:speculation_mode_info", "Speculation mode in force (1 for the mode).", labels=["mode"]
        )
        mode.add_metric([str(spec.get("mode"))], 1.0)
        yield mode
        yield gauge("max_num_seqs", "Cap on running sequences in force.", caps.get("max_num_seqs"))
        yield gauge(
            "max_num_batched_tokens", "Cap on tokens per engine step in force.", caps.get("max_num_batched_tokens")
        )
        yield gauge("config_version", "Config version in force on the engine core.", core.get("config_version"))
        yield gauge("num_requests_running", "Running requests seen by the scheduler hook.", core.get("running"))
        yield gauge("engine_start_time_seconds", "Unix time the API process started.", HOST.started_at)
        yield gauge("ready", "1 when warmed up and ready.", 1.0 if HOST.phase == "ready" else 0.0)
        if HOST.warmup.get("seconds") is not None:
            yield gauge("warmup_duration_seconds", "Duration of the start-up warm-up (s).", HOST.warmup["seconds"])
        wr = CounterMetricFamily(
            "specpilot:warmup_runs", "Warm-up and heartbeat runs by kind and outcome.", labels=["kind", "outcome"]
        )
        for (kind, outcome), n in sorted(RUNS.counts.items()):
            wr.add_metric([kind, outcome], float(n))
        yield wr
        ws = CounterMetricFamily(
            "specpilot:warmup_steps", "Engine steps run at each K during the start-up warm-up.", labels=["k"]
        )
        for k, n in enumerate(core.get("warmup_steps_at_k") or []):
            ws.add_metric([str(k)], float(n))
        yield ws
        yield from SAMPLES.metric_families()
        ov = core.get("overhead") or {}
        yield gauge(
            "controller_overhead_perc", "Scheduler-hook wall time / step time (fraction 0..1).", ov.get("fraction")
        )
        yield gauge(
            "controller_overhead_cpu_perc",
            "Scheduler-hook CPU time of the engine-core thread / step time (fraction 0..1).",
            ov.get("cpu_fraction"),
        )
        acc = GaugeMetricFamily(
            "specpilot:acceptance_per_position",
            "Estimated P(draft positions 1..i all accepted) per decode request-step.",
            labels=["position"],
        )
        for i, v in enumerate(ctl.get("acceptance_per_position") or [], start=1):
            if v is not None:  # None: position not measured yet
                acc.add_metric([str(i)], float(v))
        yield acc
        cond = GaugeMetricFamily(
            "specpilot:conditional_acceptance",
            "Estimated conditional acceptance a_j at draft position j.",
            labels=["position"],
        )
        for i, v in enumerate(ctl.get("conditional_acceptance") or [], start=1):
            if v is not None:  # None: position not measured yet
                cond.add_metric([str(i)], float(v))
        yield cond
        for key, name, doc, scale in (
            ("expected_tokens_per_step", "expected_tokens_per_step", "E(K): tokens per request per step.", 1.0),
            ("step_time_ms", "step_time_seconds", "Learned step time T(B, K) at the current batch size (s).", 0.001),
            (
                "predicted_goodput_tokens_per_s",
                "predicted_goodput_tokens_per_second",
                "G(K) = B*E(K)/T(B,K) (tokens/s).",
                1.0,
            ),
        ):
            fam = GaugeMetricFamily(f"specpilot:{name}", doc, labels=["k"])
            for k, v in (ctl.get(key) or {}).items():
                fam.add_metric([str(k)], float(v) * scale)
            yield fam
        steps = CounterMetricFamily("specpilot:steps", "Engine steps scheduled at each K.", labels=["k"])
        for k, n in enumerate(ctl.get("steps_at_k", [])):
            steps.add_metric([str(k)], float(n))
        yield steps


_collector_registered = False


def _register_collector() -> None:
    global _collector_registered
    if not _collector_registered:
        REGISTRY.register(SpecPilotCollector())
        _collector_registered = True


EXTENSIONS: list[Any] = []  # the endpoint extensions loaded in this process


def load_extensions(spec: str | None = None) -> list[Any]:
    """Instantiate the endpoint extensions named in ``spec`` (default
    ``$SPECPILOT_ENDPOINT_EXTENSIONS``): ``module:factory`` items, comma-separated, each
    factory returning an object with vLLM's endpoint-plugin methods ``attach_router(app)``
    and ``async init_state(engine_client, state, args)``.

    Raises:
        ImportError, AttributeError: an item names no importable factory.
    """
    spec = (envs.endpoint_extensions() or "") if spec is None else spec
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        module, _, attr = item.partition(":")
        out.append(getattr(importlib.import_module(module), attr)())
    return out


class SpecPilotEndpoints:
    """The endpoint plugin object (``vllm.plugins.endpoint_plugins.interface.EndpointPlugin``)."""

    name = "specpilot_control"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        """Add ``/control/*`` and ``/ready`` to vLLM's app, then let the extensions
        (:func:`load_extensions`) attach theirs."""
        app.include_router(control_router)
        app.include_router(health_router)
        app.add_exception_handler(ControlAuthError, control_auth_error_handler)  # type: ignore[arg-type]
        EXTENSIONS[:] = load_extensions()
        for ext in EXTENSIONS:
            ext.attach_router(app)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Open the channel, register metrics, schedule the start-up warm-up."""
        HOST.engine_client = engine_client
        HOST.args = args
        HOST.lock = asyncio.Lock()
        try:
            HOST.channel = channel_from_env()
        except ChannelError as exc:
            logger.error("SpecPilot control channel unavailable: %s", exc)
        SAMPLES.k_source = HOST.core_state
        _register_collector()
        for ext in EXTENSIONS:
            await ext.init_state(engine_client, state, args)
        HOST.phase = "warming_up"
        k_max = int(((HOST.core_state() or {}).get("limits") or {}).get("k_max") or 0)
        start_background_tasks(HOST, args, k_max, envs.warmup())
