"""Load generation against the OpenAI-compatible API: Poisson arrivals (open loop) or a
fixed number of concurrent clients (closed loop), streamed with httpx.

Each request asks for ``stream_options: {include_usage, continuous_usage_stats}`` so
every server-sent event carries the cumulative ``usage.completion_tokens``: the
difference between two events is the number of tokens that event brought (one engine
step can bring several with speculative decoding). Times are taken with
:func:`time.perf_counter` when each event arrives.

When the window (``duration_s``) closes, no new request is sent and requests still
streaming are cancelled (the connection closes and vLLM aborts them); what they
delivered inside the window is kept (see :mod:`bench.metrics`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Callable

import httpx

from engine_host.http_keepalive import client_limits

from .metrics import RequestRecord, poisson_arrivals
from .workloads import Prompt, Workload

ERROR_BACKOFF_S = 0.5


@dataclass(frozen=True)
class Load:
    """Offered load: ``rate`` requests/s (Poisson) or ``concurrency`` parallel clients."""

    rate: float | None = None
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of rate (req/s) or concurrency (clients)")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be > 0 requests/s")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")

    def describe(self) -> str:
        """``"rate=2.0/s"`` or ``"concurrency=4"``."""
        return f"rate={self.rate:g}/s" if self.rate is not None else f"concurrency={self.concurrency}"


async def stream_request(
    http: httpx.AsyncClient, prompt: Prompt, model: str, max_tokens: int, rec: RequestRecord, t0: float
) -> None:
    """Send one streaming request and fill ``rec`` as events arrive.

    Args:
        http: client whose ``base_url`` is the engine host.
        prompt: what to send.
        model: served model name.
        max_tokens: output cap (tokens).
        rec: record to fill (``chunks``, ``output_tokens``, ``done_s``, ``error``).
        t0: ``time.perf_counter()`` at the run start (record times are relative to it).
    """
    seen = 0
    try:
        async with http.stream("POST", prompt.path, json=prompt.body(model, max_tokens)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")[:300]
                rec.error = f"HTTP {resp.status_code}: {body}"
                rec.done_s = time.perf_counter() - t0
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                try:
                    event = json.loads(data)
                except ValueError:
                    continue
                if "error" in event and not event.get("choices"):
                    rec.error = str(event["error"])[:300]
                    break
                usage = event.get("usage") or {}
                total = usage.get("completion_tokens")
                if usage.get("prompt_tokens") is not None:
                    rec.prompt_tokens = usage["prompt_tokens"]
                if total is None:
                    continue
                new = int(total) - seen
                if new > 0 and event.get("choices"):
                    rec.chunks.append((now, new))
                    seen = int(total)
                elif new > 0:  # final usage-only event: tokens not yet attributed
                    rec.chunks.append((now, new))
                    seen = int(total)
        rec.output_tokens = seen
        rec.done_s = time.perf_counter() - t0
    except asyncio.CancelledError:
        rec.output_tokens = seen
        rec.cancelled = True
        raise
    except httpx.HTTPError as exc:
        rec.output_tokens = seen
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
        rec.done_s = time.perf_counter() - t0


ProgressFn = Callable[[float, list[RequestRecord]], None]


async def run_load(
    url: str,
    model: str,
    workload: Workload,
    load: Load,
    duration_s: float,
    max_tokens: int = 128,
    seed: int = 0,
    api_key: str | None = None,
    t0: float | None = None,
    progress: ProgressFn | None = None,
    num_requests: int | None = None,
) -> tuple[list[RequestRecord], float]:
    """Drive the engine for ``duration_s`` seconds, or until ``num_requests`` are done.

    Args:
        url: engine host base URL.
        model: served model name.
        workload: prompt stream (its ``next_prompt`` gets the seconds elapsed).
        load: Poisson rate (requests/s) or concurrency (clients).
        duration_s: window length (s); nothing is sent after it, streams still open are
            cancelled. With ``num_requests``: a safety limit on the whole run (s).
        max_tokens: output cap per request (tokens).
        seed: seed of the Poisson arrival times.
        api_key: sent as ``Authorization: Bearer`` on ``/v1/*`` when the engine requires one.
        t0: ``time.perf_counter()`` value that is time 0 (default: now).
        progress: called about once a second with ``(elapsed_s, records)``.
        num_requests: fixed work: send exactly this many requests (closed loop: the
            clients share them; open loop: this many Poisson arrivals) and wait until every
            one has finished (vLLM's ``benchmark_serving`` way).
    Returns:
        ``(records, t0)``: one :class:`RequestRecord` per request sent, in send order.
    """
    t0 = time.perf_counter() if t0 is None else t0
    records: list[RequestRecord] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = client_limits(max_connections=1024, max_keepalive_connections=256)
    timeout = httpx.Timeout(connect=10.0, read=None, write=30.0, pool=None)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, limits=limits, timeout=timeout) as http:

        def new_record() -> tuple[Prompt, RequestRecord]:
            now = time.perf_counter() - t0
            p = workload.next_prompt(now)
            rec = RequestRecord(index=len(records), workload=p.workload, source=p.source, sent_s=now)
            records.append(rec)
            return p, rec

        async def one(p: Prompt, rec: RequestRecord) -> None:
            await stream_request(http, p, model, max_tokens, rec, t0)

        def more() -> bool:
            if num_requests is not None:
                return len(records) < num_requests
            return time.perf_counter() - t0 < duration_s

        async def client_loop() -> None:
            while more():
                p, rec = new_record()
                await one(p, rec)
                if rec.error:  # do not spin on an engine that refuses requests
                    await asyncio.sleep(ERROR_BACKOFF_S)

        tasks: list[asyncio.Task] = []

        async def open_loop() -> None:
            if num_requests is not None:
                arrivals = poisson_arrivals(load.rate or 1.0, float("inf"), seed, limit=num_requests)
            else:
                arrivals = poisson_arrivals(load.rate or 1.0, duration_s, seed)
            for at in arrivals:
                delay = at - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                p, rec = new_record()
                tasks.append(asyncio.create_task(one(p, rec)))

        if load.concurrency is not None:
            tasks.extend(asyncio.create_task(client_loop()) for _ in range(load.concurrency))
        else:
            tasks.append(asyncio.create_task(open_loop()))

        async def ticker() -> None:
            while True:
                await asyncio.sleep(1.0)
                if progress:
                    progress(time.perf_counter() - t0, records)

        tick = asyncio.create_task(ticker())
        if num_requests is not None:
            deadline = t0 + duration_s
            while not (len(records) >= num_requests and all(t.done() for t in tasks)):
                if time.perf_counter() >= deadline:
                    break
                await asyncio.sleep(0.05)
        else:
            remaining = duration_s - (time.perf_counter() - t0)
            if remaining > 0:
                await asyncio.sleep(remaining)
        tick.cancel()
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, tick, return_exceptions=True)
    return records, t0
