"""Warm-up and heartbeats: real requests through the engine host's own OpenAI API.

Start-up warm-up (before ``/ready`` turns true): for every draft length K the
controller may choose (0..K_max) the engine core is held at that K (the channel's
``warmup_k``) while a short prompt, a long prompt and a small concurrent batch run, so
that prefill and decode shapes and every speculation depth are exercised before any
real request; one short chat completion then warms the chat path (its template and
serving code), which the first chat request would otherwise pay for in its TTFT. Its
duration is exported as ``specpilot:warmup_duration_seconds``; the steps run at each K as
``specpilot:warmup_steps_total{k}``.

Heartbeats: schedules from the live config (``warmup.heartbeats``: interval or cron,
prompts, max tokens, idle condition), run by the engine host itself so they continue
with no dashboard open. Every run (warm-up or heartbeat, including skips) is recorded
with start, duration, TTFT and outcome in :data:`RUNS`, served at
``GET /control/warmup/runs`` for the control plane's store.

Internal requests carry ``X-Request-Id: specpilot-<kind>-...`` so that live latency and
throughput figures leave them out (``engine_host.stats``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import threading
import time
from collections import deque
from datetime import datetime, timezone
from typing import Any

import httpx

from .stats import SAMPLES

logger = logging.getLogger("specpilot.warmup")

SHORT_PROMPT = "Hello"
# Real text with repetition (the opening of the Python Zen, PEP 20), so that n-gram
# drafts are proposed and verified at every depth.
_ZEN = (
    "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex. "
    "Complex is better than complicated. Flat is better than nested. Sparse is better than dense. "
    "Readability counts. "
)
LONG_PROMPT = "Repeat the following text exactly.\n" + _ZEN * 6 + "\nRepeat:\n" + _ZEN
#: Temperature of the start-up warm-up's chat request (sampled, with a seed; see :func:`warm_chat_path`).
CHAT_WARMUP_TEMPERATURE = 0.7


class RunLog:
    """Thread-safe ring of warm-up and heartbeat runs with increasing ids.

    Each run: ``{"id", "kind": "warmup"|"heartbeat", "schedule", "started_at" (unix s),
    "duration_s", "ttft_s", "output_tokens", "k", "outcome": "ok"|"skipped"|"error",
    "detail"}``.
    """

    def __init__(self, size: int = 2000):
        self._runs: deque[dict[str, Any]] = deque(maxlen=size)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.counts: dict[tuple[str, str], int] = {}

    def add(self, run: dict[str, Any]) -> dict[str, Any]:
        """Record a run; returns it with its id."""
        with self._lock:
            run = {"id": next(self._ids), **run}
            self._runs.append(run)
            key = (run["kind"], run["outcome"])
            self.counts[key] = self.counts.get(key, 0) + 1
            return run

    def since(self, after_id: int = 0) -> list[dict[str, Any]]:
        """Runs with ``id > after_id``, oldest first."""
        with self._lock:
            return [r for r in self._runs if r["id"] > after_id]


RUNS = RunLog()


def _base_url(args: Any) -> str:
    host = getattr(args, "host", None) or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{getattr(args, 'port', 8000)}"


def _headers(args: Any, request_id: str) -> dict[str, str]:
    """Headers of a warm-up or heartbeat request: its id, and the OpenAI API key the server
    checks, as vLLM picks it (``--api-key``, else ``$VLLM_API_KEY``, which is how the
    launcher hands the key over: never on a command line)."""
    headers = {"X-Request-Id": request_id}
    keys = getattr(args, "api_key", None)
    if isinstance(keys, list):
        keys = keys[0] if keys else None
    keys = keys or os.environ.get("VLLM_API_KEY", "").strip()
    if keys:
        headers["Authorization"] = f"Bearer {keys}"
    return headers


def _served_name(args: Any) -> str:
    names: Any = getattr(args, "served_model_name", None)
    if isinstance(names, list) and names:
        return names[0]
    return names or getattr(args, "model", "")


_seq = itertools.count(1)


async def timed_request(
    client: httpx.AsyncClient,
    args: Any,
    kind: str,
    prompt: str,
    max_tokens: int,
    chat: bool = False,
    temperature: float = 0.0,
    seed: int | None = None,
) -> dict[str, Any]:
    """One streamed completion (``POST /v1/completions``; with ``chat``, ``POST
    /v1/chat/completions`` with ``prompt`` as the user's message), greedy unless
    ``temperature`` > 0, with vLLM's per-request ``seed`` when given; returns ``{"ttft_s",
    "duration_s", "output_tokens"}``.

    Raises:
        httpx.HTTPError: the request failed (an ``httpx.HTTPStatusError`` with status 400
            for a chat request to a model without a chat template).
    """
    rid = f"specpilot-{kind}-{next(_seq)}"
    body: dict[str, Any] = {
        "model": _served_name(args),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if seed is not None:
        body["seed"] = seed
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.monotonic()
    ttft = None
    tokens = 0
    SAMPLES.internal_inflight += 1
    try:
        async with client.stream("POST", path, json=body, headers=_headers(args, rid)) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if ttft is None and _has_text(line[6:], chat):
                    ttft = time.monotonic() - t0
                if '"usage"' in line and '"completion_tokens"' in line:
                    usage = (json.loads(line[6:]) or {}).get("usage") or {}
                    tokens = usage.get("completion_tokens", tokens)
    finally:
        SAMPLES.internal_inflight -= 1
    return {"ttft_s": ttft, "duration_s": time.monotonic() - t0, "output_tokens": tokens}


def _has_text(data: str, chat: bool) -> bool:
    """True when the streamed chunk ``data`` (JSON) carries generated text: a completion's
    ``"text"``; a chat completion's non-empty ``delta.content`` (its first chunk carries the
    role and empty content)."""
    if not chat:
        return '"text"' in data
    if '"content"' not in data:
        return False
    try:
        choices = json.loads(data).get("choices") or []
    except ValueError:
        return False
    return any((c.get("delta") or {}).get("content") for c in choices)


def _record_startup(res: dict[str, Any], k: int | None, detail: str) -> None:
    """Record one finished start-up warm-up request (``timed_request``'s result) in :data:`RUNS`."""
    RUNS.add(
        {
            "kind": "warmup",
            "schedule": "startup",
            "started_at": time.time() - res["duration_s"],
            "k": k,
            "outcome": "ok",
            "detail": detail,
            **res,
        }
    )


async def warm_chat_path(client: httpx.AsyncClient, args: Any, k: int | None) -> bool:
    """One short chat completion, so that the first chat request after start-up does not pay
    for the chat path's first use (the chat template's compilation and the chat serving
    code's first call) in its TTFT. It is sampled (temperature :data:`CHAT_WARMUP_TEMPERATURE`)
    with a per-request seed, as chat traffic often is, so that the sampler's random path and
    its per-request generators are used once before the first user's request too (every
    other warm-up request is greedy). Recorded in :data:`RUNS` as a warm-up run at ``k``
    (tokens; None: the policy's K). A model without a chat template answers 400: then
    nothing is recorded and the warm-up goes on.

    Returns:
        True when the chat request ran (and was recorded).

    Raises:
        httpx.HTTPError: the request failed for another reason.
    """
    try:
        res = await timed_request(
            client, args, "warmup", SHORT_PROMPT, 4, chat=True, temperature=CHAT_WARMUP_TEMPERATURE, seed=0
        )
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code != 400:
            raise
        logger.info("no chat warm-up: the model does not serve chat completions (%s)", exc.response.status_code)
        return False
    _record_startup(res, k, "chat")
    return True


async def run_startup_warmup(host_state: Any, args: Any, k_max: int, level: str = "full") -> None:
    """Warm the engine up, then mark it ready.

    Args:
        host_state: the plugin's ``EngineHostState`` (phase, warm-up figures, channel).
        args: vLLM's parsed server arguments (host, port, model name, API key).
        k_max: the engine's K_max (tokens); every K in 0..k_max is covered.
        level: ``full`` (each K: short, long and a batch of 4; then one short chat
            request), ``quick`` (one short request and one short chat request), ``off``.
    """
    base = _base_url(args)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=300.0) as client:
        for _ in range(1200):
            try:
                if (await client.get("/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
        try:
            if level == "full":
                for k in range(0, k_max + 1):
                    await host_state.set_warmup_k(k)
                    jobs = [(SHORT_PROMPT, 8), (LONG_PROMPT, 24)]
                    for prompt, n in jobs:
                        res = await timed_request(client, args, "warmup", prompt, n)
                        _record_startup(res, k, f"{len(prompt)} chars")
                        host_state.warmup["runs"] += 1
                    batch = await asyncio.gather(
                        *(timed_request(client, args, "warmup", LONG_PROMPT, 12) for _ in range(4))
                    )
                    for res in batch:
                        _record_startup(res, k, "batch of 4")
                        host_state.warmup["runs"] += 1
                if await warm_chat_path(client, args, k_max):  # still held at the last K
                    host_state.warmup["runs"] += 1
                await host_state.set_warmup_k(None)
            elif level == "quick":
                res = await timed_request(client, args, "warmup", SHORT_PROMPT, 4)
                _record_startup(res, None, "quick")
                host_state.warmup["runs"] += 1
                if await warm_chat_path(client, args, None):
                    host_state.warmup["runs"] += 1
        except Exception as exc:
            await host_state.set_warmup_k(None)
            host_state.warmup["error"] = f"{type(exc).__name__}: {exc}"
            host_state.phase = "warmup_failed"
            RUNS.add(
                {
                    "kind": "warmup",
                    "schedule": "startup",
                    "started_at": time.time(),
                    "duration_s": None,
                    "ttft_s": None,
                    "output_tokens": 0,
                    "k": None,
                    "outcome": "error",
                    "detail": str(exc),
                }
            )
            logger.error("SpecPilot warm-up failed: %s", exc)
            return
    host_state.warmup["seconds"] = round(time.monotonic() - t0, 3)
    host_state.warmup["level"] = level
    host_state.phase = "ready"
    host_state.ready_at = time.time()
    print(
        f"SpecPilot engine host ready at {base} (OpenAI API under {base}/v1, control under {base}/control, "
        f"warm-up {level}: {host_state.warmup['seconds']:.1f} s, {host_state.warmup['runs']} requests)",
        flush=True,
    )


def next_fire(schedule: dict[str, Any], after: float) -> float:
    """Next due time (unix s) of a heartbeat schedule after ``after``.

    Interval schedules fire every ``interval_s`` seconds; cron schedules at the next
    match of the expression in UTC (croniter).
    """
    if schedule.get("interval_s"):
        return after + float(schedule["interval_s"])
    from croniter import croniter

    base = datetime.fromtimestamp(after, tz=timezone.utc)
    return croniter(schedule["cron"], base).get_next(float)


class HeartbeatRunner:
    """Runs the heartbeat schedules of the config in force, in the API process.

    Reads the schedules from the engine core's published config each tick (0.25 s), so
    a new config version adds, changes or removes schedules at once.
    """

    def __init__(self, host_state: Any, args: Any, tick_s: float = 0.25):
        self.host = host_state
        self.args = args
        self.tick_s = tick_s
        self.due: dict[str, tuple[str, float]] = {}  # name -> (schedule fingerprint, next due unix s)
        self.counter = itertools.count()

    def _schedules(self) -> list[dict[str, Any]]:
        core = self.host.core_state() or {}
        hb = ((core.get("config") or {}).get("warmup") or {}).get("heartbeats") or []
        return [h for h in hb if h.get("enabled", True)]

    async def run_forever(self) -> None:
        """Tick until cancelled."""
        async with httpx.AsyncClient(base_url=_base_url(self.args), timeout=300.0) as client:
            while True:
                try:
                    await self.tick(client, time.time())
                except asyncio.CancelledError:
                    raise
                except Exception:  # a broken heartbeat must not stop the others
                    logger.exception("heartbeat tick failed")
                await asyncio.sleep(self.tick_s)

    async def tick(self, client: httpx.AsyncClient, now: float) -> None:
        """Run every schedule that is due at ``now``."""
        if self.host.phase != "ready":
            return
        schedules = self._schedules()
        live = {h["name"] for h in schedules}
        for name in list(self.due):
            if name not in live:
                del self.due[name]
        for h in schedules:
            fp = repr(sorted(h.items()))
            known = self.due.get(h["name"])
            if known is None or known[0] != fp:
                self.due[h["name"]] = (fp, next_fire(h, now))
                continue
            if now < known[1]:
                continue
            self.due[h["name"]] = (fp, next_fire(h, now))
            idle_s = h.get("idle_s") or 0
            quiet_for = now - SAMPLES.last_user_activity
            if idle_s and quiet_for < idle_s:
                RUNS.add(
                    {
                        "kind": "heartbeat",
                        "schedule": h["name"],
                        "started_at": now,
                        "duration_s": 0.0,
                        "ttft_s": None,
                        "output_tokens": 0,
                        "k": None,
                        "outcome": "skipped",
                        "detail": f"real traffic {quiet_for:.1f} s ago (idle condition {idle_s:g} s)",
                    }
                )
                continue
            prompt = h["prompts"][next(self.counter) % len(h["prompts"])]
            core = self.host.core_state() or {}
            try:
                res = await timed_request(
                    client, self.args, f"heartbeat-{h['name']}", prompt, int(h.get("max_tokens", 8))
                )
                RUNS.add(
                    {
                        "kind": "heartbeat",
                        "schedule": h["name"],
                        "started_at": now,
                        "k": core.get("k_current"),
                        "outcome": "ok",
                        "detail": "",
                        **res,
                    }
                )
                self.host.warmup["runs"] += 1
            except Exception as exc:
                RUNS.add(
                    {
                        "kind": "heartbeat",
                        "schedule": h["name"],
                        "started_at": now,
                        "duration_s": time.time() - now,
                        "ttft_s": None,
                        "output_tokens": 0,
                        "k": core.get("k_current"),
                        "outcome": "error",
                        "detail": f"{type(exc).__name__}: {exc}",
                    }
                )


def start_background_tasks(host_state: Any, args: Any, k_max: int, level: str) -> None:
    """Schedule the start-up warm-up and the heartbeat runner on the server's loop."""
    loop = asyncio.get_running_loop()
    host_state.warmup_task = loop.create_task(run_startup_warmup(host_state, args, k_max, level))
    host_state.heartbeat_task = loop.create_task(HeartbeatRunner(host_state, args).run_forever())
