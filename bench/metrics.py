"""Latency percentiles, throughput and goodput of one benchmark run.

Definitions (client-side, from the streamed responses):

* **TTFT** (ms): request sent -> first chunk carrying at least one output token.
* **ITL** (ms, per token): a chunk that brings ``n`` new tokens ``g`` ms after the
  previous token-carrying chunk of the same request contributes ``n`` samples of
  ``g / n``. With speculative decoding one chunk can carry several tokens (one engine
  step), so per-chunk gaps would make deeper speculation look slower per "token".
* **chunk ITL** (ms): the raw gaps between token-carrying chunks (what vLLM's own
  ``benchmark_serving`` calls ITL), reported for comparison.
* **TPOT** (ms): per request, ``(E2E - TTFT) / (output tokens - 1)``.
* **E2E** (ms): request sent -> last chunk, for requests that finished inside the run.
* **output tokens/s**: output tokens *received* inside the measurement window
  divided by the window length (s). Requests still streaming when the window closes are
  cancelled; the tokens they delivered inside the window count.
* **goodput** (tokens/s): the same, counting only requests that meet the SLO: TTFT
  at most ``slo.ttft_ms`` and TPOT (measured so far) at most ``slo.tpot_ms``. A request
  cut by the window end is judged on what it delivered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

PERCENTILES = (50, 95, 99)


def percentiles(values: Iterable[float], qs: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """``{"p50", "p95", "p99", "mean", "n"}`` of ``values`` (same unit as the input).

    Linear interpolation between order statistics (numpy's default). Values that are
    not finite are dropped; with no values every statistic is None and ``n`` is 0.
    """
    arr = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    out: dict[str, float | None] = {f"p{q:g}": None for q in qs}
    if arr.size == 0:
        out.update(mean=None, n=0)
        return out
    for q, v in zip(qs, np.percentile(arr, list(qs))):
        out[f"p{q:g}"] = round(float(v), 3)
    out["mean"] = round(float(arr.mean()), 3)
    out["n"] = int(arr.size)
    return out


@dataclass
class RequestRecord:
    """What the client saw of one request (times in seconds from the run start).

    Attributes:
        index: issue order.
        workload: base workload of its prompt.
        source: where the prompt text comes from.
        sent_s: time the request was sent.
        chunks: ``(time_s, new_output_tokens)`` per chunk that carried tokens.
        done_s: time the stream ended (None when cancelled or failed).
        output_tokens: output tokens received (from the streamed usage).
        prompt_tokens: prompt tokens (from the streamed usage), when reported.
        error: error text when the request failed.
        cancelled: True when the window closed before the stream ended.
    """

    index: int
    workload: str
    source: str
    sent_s: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    done_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None
    cancelled: bool = False

    @property
    def ttft_ms(self) -> float | None:
        """Time to first token (ms), None before the first token."""
        return (self.chunks[0][0] - self.sent_s) * 1000.0 if self.chunks else None

    @property
    def e2e_ms(self) -> float | None:
        """End-to-end latency (ms) of a finished request, else None."""
        return (self.done_s - self.sent_s) * 1000.0 if self.done_s is not None and not self.error else None

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first (ms), None with fewer than 2 tokens."""
        if len(self.chunks) < 1 or self.output_tokens < 2:
            return None
        last = self.done_s if self.done_s is not None else self.chunks[-1][0]
        return (last - self.chunks[0][0]) * 1000.0 / (self.output_tokens - 1)

    def itl_samples_ms(self) -> list[float]:
        """Per-token inter-token latencies (ms): each chunk's gap spread over its tokens."""
        out: list[float] = []
        for (t0, _), (t1, n) in zip(self.chunks, self.chunks[1:]):
            if n > 0:
                out.extend([(t1 - t0) * 1000.0 / n] * n)
        return out

    def chunk_gaps_ms(self) -> list[float]:
        """Gaps between token-carrying chunks (ms)."""
        return [(t1 - t0) * 1000.0 for (t0, _), (t1, _) in zip(self.chunks, self.chunks[1:])]

    def tokens_within(self, start_s: float, end_s: float) -> int:
        """Output tokens received in ``[start_s, end_s]``."""
        return sum(n for t, n in self.chunks if start_s <= t <= end_s)

    def to_json(self) -> dict[str, Any]:
        """Compact JSON form (chunk times rounded to 0.1 ms)."""
        return {
            "index": self.index,
            "workload": self.workload,
            "source": self.source,
            "sent_s": round(self.sent_s, 4),
            "done_s": None if self.done_s is None else round(self.done_s, 4),
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "ttft_ms": _r(self.ttft_ms),
            "tpot_ms": _r(self.tpot_ms),
            "e2e_ms": _r(self.e2e_ms),
            "chunks": len(self.chunks),
            "error": self.error,
            "cancelled": self.cancelled,
        }


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


@dataclass(frozen=True)
class SLO:
    """Service-level objective used for goodput.

    Attributes:
        ttft_ms: highest acceptable time to first token (ms).
        tpot_ms: highest acceptable mean time per output token (ms).
    """

    ttft_ms: float = 2000.0
    tpot_ms: float = 100.0

    def met_by(self, r: RequestRecord) -> bool:
        """True when ``r`` delivered a token within ``ttft_ms`` and its TPOT is within ``tpot_ms``."""
        ttft = r.ttft_ms
        if ttft is None or ttft > self.ttft_ms or r.error:
            return False
        tpot = r.tpot_ms
        return tpot is None or tpot <= self.tpot_ms


def throughput(records: Sequence[RequestRecord], window_s: float, start_s: float = 0.0) -> float:
    """Output tokens/s received in ``[start_s, start_s + window_s]``."""
    if window_s <= 0:
        return 0.0
    return sum(r.tokens_within(start_s, start_s + window_s) for r in records) / window_s


def goodput(records: Sequence[RequestRecord], window_s: float, slo: SLO, start_s: float = 0.0) -> float:
    """Output tokens/s received in the window from requests that meet ``slo``."""
    return throughput([r for r in records if slo.met_by(r)], window_s, start_s)


def makespan_s(records: Sequence[RequestRecord]) -> float:
    """Seconds from the run's start to the last token or completion of any request
    (the denominator of fixed-work throughput)."""
    end = 0.0
    for r in records:
        if r.done_s is not None:
            end = max(end, r.done_s)
        if r.chunks:
            end = max(end, r.chunks[-1][0])
    return end


def tokens_per_second_series(records: Sequence[RequestRecord], window_s: float, bin_s: float = 1.0) -> list[float]:
    """Output tokens/s received per ``bin_s`` bin over ``[0, window_s)`` (client-side)."""
    n = max(1, int(math.ceil(window_s / bin_s)))
    bins = [0.0] * n
    for r in records:
        for t, k in r.chunks:
            i = int(t // bin_s)
            if 0 <= i < n:
                bins[i] += k
    return [round(b / bin_s, 3) for b in bins]


def summarize(records: Sequence[RequestRecord], window_s: float, slo: SLO, start_s: float = 0.0) -> dict[str, Any]:
    """All client-side figures of one run.

    Tokens count from every request (inside ``[start_s, start_s + window_s]``); latency
    figures come from requests sent at or after ``start_s`` (after any warm-up).

    Returns:
        ``ttft_ms``, ``itl_ms``, ``chunk_itl_ms``, ``tpot_ms``, ``e2e_ms`` (each
        ``{"p50","p95","p99","mean","n"}`` in ms), ``output_tokens_per_s``,
        ``goodput_tokens_per_s``, ``goodput_fraction`` (goodput / throughput, 0..1),
        ``requests`` counts and ``window_s``.
    """
    counted = [r for r in records if r.sent_s >= start_s]  # latency: requests sent inside the window
    itl: list[float] = []
    gaps: list[float] = []
    for r in counted:
        itl.extend(r.itl_samples_ms())
        gaps.extend(r.chunk_gaps_ms())
    thr = throughput(records, window_s, start_s)  # tokens: every request, inside the window
    good = goodput(records, window_s, slo, start_s)
    finished = [r for r in counted if r.done_s is not None and not r.error]
    return {
        "window_s": round(window_s, 3),
        "requests": {
            "sent": len(records),
            "finished": len(finished),
            "cancelled_at_end": sum(1 for r in records if r.cancelled),
            "failed": sum(1 for r in records if r.error),
            "meeting_slo": sum(1 for r in records if slo.met_by(r)),
        },
        "output_tokens": sum(r.tokens_within(start_s, start_s + window_s) for r in records),
        "output_tokens_per_s": round(thr, 3),
        "goodput_tokens_per_s": round(good, 3),
        "goodput_fraction": round(good / thr, 4) if thr > 0 else None,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "ttft_ms": percentiles(r.ttft_ms for r in counted),
        "itl_ms": percentiles(itl),
        "chunk_itl_ms": percentiles(gaps),
        "tpot_ms": percentiles(r.tpot_ms for r in counted),
        "e2e_ms": percentiles(r.e2e_ms for r in finished),
        "errors": _top_errors(records),
        "tokens_per_chunk": round(
            sum(n for r in counted for _, n in r.chunks) / max(1, sum(len(r.chunks) for r in counted)), 3
        ),
    }


def _top_errors(records: Sequence[RequestRecord], n: int = 3) -> list[dict[str, Any]]:
    counts: dict[str, int] = {}
    for r in records:
        if r.error:
            counts[r.error] = counts.get(r.error, 0) + 1
    return [{"error": e, "count": c} for e, c in sorted(counts.items(), key=lambda x: -x[1])[:n]]


def acceptance_from_counters(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Acceptance figures from two scrapes of vLLM's speculative-decoding counters.

    Args:
        before, after: ``{"drafts", "draft_tokens", "accepted_tokens", "accepted_per_pos": [..]}``
            (counter values, see :func:`bench.engine_control.spec_counters`).
    Returns:
        ``acceptance_rate`` (accepted / draft tokens, fraction 0..1, None without drafts),
        ``mean_acceptance_length`` (1 + accepted / drafts, tokens per verification),
        the deltas, and ``acceptance_per_position`` (accepted at position i / drafts, 0..1).
    """
    d = {k: float(after.get(k, 0.0)) - float(before.get(k, 0.0)) for k in ("drafts", "draft_tokens", "accepted_tokens")}
    pos_after = list(after.get("accepted_per_pos") or [])
    pos_before = list(before.get("accepted_per_pos") or []) + [0.0] * len(pos_after)
    pos = [a - b for a, b in zip(pos_after, pos_before)]
    return {
        "drafts": d["drafts"],
        "draft_tokens": d["draft_tokens"],
        "accepted_tokens": d["accepted_tokens"],
        "acceptance_rate": round(d["accepted_tokens"] / d["draft_tokens"], 4) if d["draft_tokens"] > 0 else None,
        "mean_acceptance_length": round(1.0 + d["accepted_tokens"] / d["drafts"], 4) if d["drafts"] > 0 else None,
        "accepted_per_position": pos,
        "acceptance_per_position": [round(p / d["drafts"], 4) for p in pos] if d["drafts"] > 0 else [],
    }


def poisson_arrivals(rate_per_s: float, duration_s: float, seed: int = 0, limit: int | None = None) -> list[float]:
    """Arrival times (s from start, ascending, all < ``duration_s``) of a Poisson process,
    at most ``limit`` of them.

    Inter-arrival gaps are exponential with mean ``1 / rate_per_s`` seconds, drawn from
    ``numpy.random.default_rng(seed)``: the same arguments give the same times.
    """
    if rate_per_s <= 0:
        raise ValueError("rate_per_s must be > 0")
    if duration_s <= 0:
        return []
    rng = np.random.default_rng(seed)
    out: list[float] = []
    t = 0.0
    while limit is None or len(out) < limit:
        t += float(rng.exponential(1.0 / rate_per_s))
        if t >= duration_s:
            return out
        out.append(t)
    return out
