"""Talking to an engine host's control plane: switch speculation modes, sample K and
controller state while a run goes, read vLLM's speculative-decoding counters.

Mode strings (``--mode``), mapped to ``PUT /control/config`` bodies by :func:`mode_patch`:

==========================  ====================================================
``off``                     ``{"mode": "off"}`` (K = 0)
``fixed:K``                 static K tokens (``fixed:0`` is K = 0 in a speculative engine)
``adaptive[:LO-HI]``        the goodput controller, K in LO..HI (default 0..engine K_max),
                            with the per-request draft gate (``speculation.adaptive.per_request``)
``adaptive_step[:LO-HI]``   the same controller with one K per step for every request (the
                            per-request gate off), to measure what the gate does
``adaptive_pooled[:LO-HI]``  ``adaptive`` with the gate's pooled prior: a new request starts
                            at the acceptance pooled over its class's recent draft tokens
                            (``speculation.adaptive.prior``; ``adaptive`` and
                            ``adaptive_mixture`` use the mixture prior)
``adaptive_geometric[:LO-HI]``  ``adaptive`` with the gate's geometric gain: a draft's
                            expected tokens ``sum_j a^j``, not read against what the class's
                            drafts yielded (``speculation.adaptive.gain``; the others use the
                            calibrated gain)
``batch_table[:TABLE]``     vLLM's per-batch-size table; TABLE like ``1-2=6,3-8=4,9-1024=2``
                            (default :data:`DEFAULT_BATCH_TABLE`, each K clamped to the
                            engine's K_max)
``threshold``               the 10 s acceptance-threshold loop (bounds 2..8, clamped to the
                            engine's K_max)
``heuristic[:LO-HI]``       transformers' assisted-generation schedule (default 1..K_max)
``plain``                   no speculative config at all: needs an engine started with
                            ``--k-max 0`` (the plain-vLLM baseline); sets ``off``.
                            On the dual engine host: its plain engine (:func:`router_patch`)
==========================  ====================================================
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine_host.http_keepalive import client_limits

DEFAULT_BATCH_TABLE: list[list[int]] = [[1, 2, 6], [3, 8, 4], [9, 1024, 2]]


class BenchError(RuntimeError):
    """A benchmark cannot go on; the message says why (e.g. the engine refused a mode)."""


def _bounds(text: str, what: str) -> tuple[int, int]:
    try:
        lo, hi = text.split("-", 1)
        return int(lo), int(hi)
    except ValueError:
        raise BenchError(f"{what}: bounds must look like LO-HI (e.g. 0-8), got {text!r}") from None


def parse_batch_table(text: str) -> list[list[int]]:
    """``"1-2=6,3-8=4"`` -> ``[[1, 2, 6], [3, 8, 4]]`` (batch ranges inclusive, K in tokens)."""
    out = []
    for part in text.split(","):
        try:
            rng, k = part.split("=")
            lo, hi = _bounds(rng, "batch_table")
            out.append([lo, hi, int(k)])
        except ValueError:
            raise BenchError(f"batch_table: entries must look like START-END=K, got {part!r}") from None
    return out


def router_patch(mode: str) -> dict[str, Any]:
    """The ``PUT /control/config`` body for a mode on the dual engine host
    (``python -m engine_host.router``): ``plain`` sends every request to its plain engine,
    ``adaptive`` lets the router split traffic (``auto``), any other mode runs on its
    speculative engine alone, so static baselines are measured as on a single engine.

    Raises:
        BenchError: unknown or malformed mode string.
    """
    if mode.strip() == "plain":
        return {"routing": "plain"}
    patch = mode_patch(mode)
    patch["routing"] = "auto" if mode.strip().startswith("adaptive") else "speculative"
    return patch


def mode_patch(mode: str, k_max_engine: int | None = None) -> dict[str, Any]:
    """The ``PUT /control/config`` body for a mode string (see module docstring).

    Args:
        mode: the mode string.
        k_max_engine: the engine's K_max (tokens), where known: ``batch_table`` without a
            table then runs :data:`DEFAULT_BATCH_TABLE` with each K clamped to it (a table
            given in the mode string is sent as given, and refused by the engine if a K is
            above its K_max).

    Raises:
        BenchError: unknown or malformed mode string.
    """
    name, _, arg = mode.strip().partition(":")
    if name == "off" and not arg:
        spec: dict[str, Any] = {"mode": "off"}
    elif name == "plain" and not arg:
        spec = {"mode": "off"}
    elif name == "fixed":
        try:
            spec = {"mode": "fixed", "k": int(arg)}
        except ValueError:
            raise BenchError(f"mode {mode!r}: use fixed:K with K a number of tokens, e.g. fixed:4") from None
    elif name in ("adaptive", "adaptive_step", "adaptive_mixture", "adaptive_pooled", "adaptive_geometric"):
        lo, hi = _bounds(arg, mode) if arg else (0, None)
        params: dict[str, Any] = {"per_request": name != "adaptive_step"}
        params["prior"] = "pooled" if name == "adaptive_pooled" else "mixture"
        params["gain"] = "geometric" if name == "adaptive_geometric" else "calibrated"
        spec = {"mode": "adaptive", "k_min": lo, "k_max": hi, "adaptive": params}
    elif name == "heuristic":
        lo, hi = _bounds(arg, mode) if arg else (1, None)
        spec = {"mode": "heuristic", "k_min": lo, "k_max": hi}
    elif name == "threshold" and not arg:
        spec = {"mode": "threshold", "k_min": 0, "k_max": None}
    elif name == "batch_table":
        if arg:
            table = parse_batch_table(arg)
        else:
            cap = k_max_engine if k_max_engine is not None else max(k for _, _, k in DEFAULT_BATCH_TABLE)
            table = [[lo, hi, min(k, cap)] for lo, hi, k in DEFAULT_BATCH_TABLE]
        spec = {"mode": "batch_table", "table": table}
    else:
        raise BenchError(
            f"unknown mode {mode!r}: use off, fixed:K, adaptive[:LO-HI], adaptive_step[:LO-HI], adaptive_pooled[:LO-HI], "
            "batch_table[:TABLE], threshold, "
            "heuristic[:LO-HI] or plain"
        )
    return {"speculation": spec}


def is_static(mode: str) -> bool:
    """True for modes with one K throughout (``off``, ``fixed:K``)."""
    return mode == "off" or mode.startswith("fixed:")


def static_k(mode: str) -> int | None:
    """K (tokens) of a static mode, else None."""
    if mode == "off":
        return 0
    if mode.startswith("fixed:"):
        return int(mode.split(":", 1)[1])
    return None


def spec_counters(metrics_text: str) -> dict[str, Any]:
    """vLLM's speculative-decoding counters from Prometheus text (summed over engines).

    Returns:
        ``{"drafts", "draft_tokens", "accepted_tokens", "accepted_per_pos": [...]}``;
        zeros (and an empty list) on an engine without speculation.
    """
    names = {
        "vllm:spec_decode_num_drafts_total": "drafts",
        "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
    }
    out: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    per_pos: dict[int, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name in names:
                out[names[s.name]] += s.value
            elif s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                pos = int(s.labels.get("position", 0))
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
    out["accepted_per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return out


class EngineControl:
    """Async access to one engine host.

    Args:
        url: base URL of the engine host (``http://127.0.0.1:8000``).
        token: control bearer token (None: control calls fail with 401, runs
            without mode switching still work).
        timeout_s: timeout of each control call (s).
    """

    def __init__(self, url: str, token: str | None, timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout_s, limits=client_limits())

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self.http.aclose()

    async def served_model(self) -> str:
        """The first model id of ``GET /v1/models``."""
        r = await self.http.get("/v1/models")
        r.raise_for_status()
        data = r.json().get("data") or []
        if not data:
            raise BenchError(f"{self.url}/v1/models lists no model")
        return data[0]["id"]

    async def state(self) -> dict[str, Any]:
        """``GET /control/state``; ``{}`` from a bare vLLM server (``vllm serve``: no
        control plane, 404), which the harness measures in mode ``plain`` only."""
        r = await self.http.get("/control/state")
        if r.status_code == 404:
            return {}
        if r.status_code == 401:
            raise BenchError("the control token was refused (401): pass the engine host's token with --token-env")
        r.raise_for_status()
        return r.json()

    async def apply_mode(self, mode: str) -> dict[str, Any]:
        """Switch the engine to ``mode`` through ``PUT /control/config``.

        Returns:
            The engine's answer (``config_version``, ``k_current``, ``apply_latency_ms``...).
        Raises:
            BenchError: the engine refused it (422/409, with its message) or ``plain``
                on an engine that has a speculative config.
        """
        st = await self.state()
        k_engine = (st.get("speculation") or {}).get("k_max_engine") if st else None
        patch = mode_patch(mode, k_engine if isinstance(k_engine, int) else None)
        if not st:  # a bare vLLM server: nothing to switch
            if mode.strip() == "plain":
                return {}
            raise BenchError(
                f"mode {mode!r} needs an engine host (this server has no /control/state); "
                "a bare vLLM server runs mode 'plain' only"
            )
        if "router" in st:  # the dual engine host: route as the mode says
            patch = router_patch(mode)
        elif mode == "plain" and (st.get("speculation") or {}).get("k_max_engine"):
            raise BenchError(
                "mode 'plain' needs an engine started without speculation (--k-max 0) or the "
                f"dual engine host; this one has K_max={st['speculation']['k_max_engine']}"
            )
        r = await self.http.put("/control/config", json=patch)
        if r.status_code == 401:
            raise BenchError("the control token was refused (401): pass the engine host's token with --token-env")
        if r.status_code >= 400:
            try:
                msg = r.json().get("message") or r.text
            except ValueError:
                msg = r.text
            raise BenchError(f"the engine refused mode {mode!r} (HTTP {r.status_code}): {msg}")
        return r.json()

    async def counters(self) -> dict[str, Any]:
        """Speculative-decoding counters from ``GET /metrics`` (see :func:`spec_counters`)."""
        r = await self.http.get("/metrics")
        r.raise_for_status()
        return spec_counters(r.text)

    async def samples(self, since_unix_s: float) -> list[dict[str, Any]]:
        """Per-second samples after ``since_unix_s`` from ``GET /control/samples``."""
        r = await self.http.get("/control/samples", params={"since": since_unix_s})
        if r.status_code == 404:  # a bare vLLM server
            return []
        r.raise_for_status()
        return r.json().get("samples", [])


@dataclass
class StatePoint:
    """One poll of ``/control/state``: time (s from run start), K in force (tokens), queue."""

    t_s: float
    k: int | None
    mode: str | None
    running: int | None
    waiting: int | None


@dataclass
class StateSampler:
    """Polls ``/control/state`` every ``interval_s`` seconds while a run goes.

    Attributes:
        points: the polls, oldest first.
        first, last: the full first and last state documents.
    """

    control: EngineControl
    t0: float
    interval_s: float = 0.5
    points: list[StatePoint] = field(default_factory=list)
    first: dict[str, Any] | None = None
    last: dict[str, Any] | None = None
    errors: int = 0

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            t = time.perf_counter() - self.t0
            try:
                st = await self.control.state()
            except (httpx.HTTPError, BenchError, ValueError):
                self.errors += 1
            else:
                if self.first is None:
                    self.first = st
                self.last = st
                spec, batch = st.get("speculation") or {}, st.get("batch") or {}
                self.points.append(
                    StatePoint(
                        round(t, 3), spec.get("k_current"), spec.get("mode"), batch.get("running"), batch.get("waiting")
                    )
                )
            await asyncio.sleep(self.interval_s)


def steps_at_k_delta(first: dict[str, Any] | None, last: dict[str, Any] | None) -> list[int]:
    """Engine steps run at each K between two state documents (``controller.steps_at_k``)."""
    a = ((first or {}).get("controller") or {}).get("steps_at_k") or []
    b = ((last or {}).get("controller") or {}).get("steps_at_k") or []
    a = list(a) + [0] * (len(b) - len(a))
    return [int(y - x) for x, y in zip(a, b)]


def overhead_delta(first: dict[str, Any] | None, last: dict[str, Any] | None) -> dict[str, float] | None:
    """The scheduler hook's own time between two state documents (their ``overhead``:
    cumulative since the engine started): ``{"hook_seconds", "hook_cpu_seconds",
    "busy_seconds"}`` (s) of the interval and ``fraction`` / ``cpu_fraction``, the hook's
    wall and CPU time as a fraction 0..1 of the engine's busy time in it; with
    ``aside_steps`` and ``lean_steps`` (steps) where both documents count them: the steps
    the hook stood aside for and those it ran on its lean path in the interval. None where either
    document lacks the figures or the engine was not busy in between (or restarted: its
    counters went back)."""
    a, b = (first or {}).get("overhead") or {}, (last or {}).get("overhead") or {}
    try:
        d = {k: float(b[k]) - float(a[k]) for k in ("hook_seconds", "hook_cpu_seconds", "busy_seconds")}
    except (KeyError, TypeError, ValueError):
        return None
    busy = d["busy_seconds"]
    if busy <= 0 or d["hook_seconds"] < 0 or d["hook_cpu_seconds"] < 0:
        return None
    out: dict[str, float] = {
        **{k: round(v, 6) for k, v in d.items()},
        "fraction": d["hook_seconds"] / busy,
        "cpu_fraction": d["hook_cpu_seconds"] / busy,
    }
    # the steps the hook stood aside for and those on its lean path (engine hosts since host 50)
    for k in ("aside_steps", "lean_steps"):
        if isinstance(a.get(k), int) and isinstance(b.get(k), int) and b[k] >= a[k]:
            out[k] = b[k] - a[k]
    return out


def mean_k(steps_at_k: list[int]) -> float | None:
    """Step-weighted mean K (tokens) from a steps-at-K histogram."""
    n = sum(steps_at_k)
    return round(sum(k * c for k, c in enumerate(steps_at_k)) / n, 3) if n else None
