"""From scrapes to samples, and from samples to roll-ups (pure functions, no I/O).

:class:`SampleBuilder` turns consecutive ``/metrics`` scrapes of one host into 1 s sample
rows (the columns of ``control.models.MetricSample``):

* throughput from counter deltas: output tokens (``vllm:generation_tokens_total``),
  user output tokens (``specpilot:user_generation_tokens_total``, warm-up and
  heartbeat requests left out), prompt tokens, finished requests, per second;
* TTFT / ITL / E2E / queue-time P50/P95/P99 (ms) over a trailing window
  (``window_s``, default 10 s) of histogram bucket deltas, so that the figures are
  windowed rather than lifetime;
* KV cache usage (fraction 0..1), running and waiting requests (gauges);
* acceptance rate (accepted / draft tokens, 0..1) over the same window, and per draft
  position j: accepted at j / drafts (vLLM's per-position definition);
* K in force, speculation mode, the engine's config version, the running-sequence cap.

A counter that goes down (engine restart) restarts the builder: no sample for that
scrape, the next one is measured from the new baseline.

:func:`rollup` merges rows of one bucket (60 s or 3600 s): sums for counts and seconds,
time-weighted means for gauges, maxima, exact percentiles from the merged histogram
buckets, acceptance from summed counts.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable

from .metrics_parse import Snapshot, bucket_delta, decode_buckets, encode_buckets, merge_buckets, quantile

HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
}
PERCENTILES = {"p50": 0.50, "p95": 0.95, "p99": 0.99}

GEN = "vllm:generation_tokens_total"
USER_GEN = "specpilot:user_generation_tokens_total"
PROMPT = "vllm:prompt_tokens_total"
FINISHED = "vllm:request_success_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
ENGINE_START = "specpilot:engine_start_time_seconds"

#: The metric families the collector reads (the rest of ``/metrics`` is skipped).
FAMILIES = frozenset({
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:generation_tokens", "vllm:prompt_tokens", "vllm:request_success",
    *HISTOGRAMS.values(),
    "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "specpilot:speculation_k", "specpilot:speculation_mode_info", "specpilot:config_version",
    "specpilot:max_num_seqs", "specpilot:engine_start_time_seconds", "specpilot:ready",
    "specpilot:user_generation_tokens",
})

#: Sample columns that are latency percentiles (ms).
LATENCY_COLUMNS = tuple(f"{kind}_{p}_ms" for kind in HISTOGRAMS for p in PERCENTILES)
#: Columns summed in roll-ups.
SUM_COLUMNS = ("covered_s", "busy_s", "output_tokens", "prompt_tokens", "requests_finished",
               "num_drafts", "draft_tokens", "accepted_tokens")
#: Gauge columns averaged (weighted by covered seconds) in roll-ups, with their maxima.
MEAN_COLUMNS = ("kv_cache_usage", "running", "waiting", "k")
MAX_COLUMNS = {"kv_cache_usage_max": "kv_cache_usage", "running_max": "running", "waiting_max": "waiting"}


def _positions(snap: Snapshot) -> list[float]:
    per = snap.by_label(ACCEPTED_POS, "position")
    return [per[str(i)] for i in range(len(per)) if str(i) in per]


def _sub(a: float | None, b: float | None) -> float:
    return max(0.0, (a or 0.0) - (b or 0.0))


def _latency_columns(hists: dict[str, dict]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for kind in HISTOGRAMS:
        buckets = hists.get(kind) or {}
        for p, q in PERCENTILES.items():
            v = quantile(q, buckets)
            out[f"{kind}_{p}_ms"] = None if v is None else round(v * 1000.0, 3)
    return out


def _acceptance(drafts: float, draft_tokens: float, accepted: float,
                per_pos: list[float]) -> tuple[float | None, list[float | None] | None]:
    rate = accepted / draft_tokens if draft_tokens > 0 else None
    per = [a / drafts for a in per_pos] if drafts > 0 and per_pos else None
    return (None if rate is None else round(rate, 4)), (None if per is None else [round(x, 4) for x in per])


class SampleBuilder:
    """Builds 1 s sample rows from consecutive scrapes of one host.

    Args:
        window_s: trailing window (s) of the latency percentiles and acceptance rate.
    """

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self.prev: Snapshot | None = None
        self.prev_t: float | None = None
        self.engine_start: float | None = None
        self._window: deque[tuple[float, dict[str, Any]]] = deque()

    def reset(self) -> None:
        """Forget the baseline (after a gap or an engine restart)."""
        self.prev = self.prev_t = None
        self._window.clear()

    def feed(self, snap: Snapshot, t: float) -> dict[str, Any] | None:
        """Add a scrape taken at ``t`` (unix s).

        Returns:
            The sample row for the interval since the previous scrape (``t`` = start of
            the interval, rounded to the second), or None for the first scrape and after
            a counter reset.
        """
        start = snap.value(ENGINE_START)
        prev, prev_t = self.prev, self.prev_t
        restarted = start is not None and self.engine_start is not None and start != self.engine_start
        self.engine_start = start if start is not None else self.engine_start
        self.prev, self.prev_t = snap, t
        if prev is None or prev_t is None or restarted or t <= prev_t:
            self._window.clear()
            return None
        if (snap.value(GEN) or 0.0) < (prev.value(GEN) or 0.0):
            self._window.clear()
            return None
        hists = {}
        for kind, name in HISTOGRAMS.items():
            hists[kind] = bucket_delta(snap.histogram(name), prev.histogram(name))
        pos_new, pos_old = _positions(snap), _positions(prev)
        acc_pos = [_sub(n, pos_old[i] if i < len(pos_old) else 0.0) for i, n in enumerate(pos_new)]
        covered = t - prev_t
        out_tokens = _sub(snap.value(GEN), prev.value(GEN))
        user_new, user_old = snap.value(USER_GEN), prev.value(USER_GEN)
        finished = sum(snap.by_label(FINISHED, "finished_reason").values()) - \
            sum(prev.by_label(FINISHED, "finished_reason").values())
        running = snap.value("vllm:num_requests_running")
        waiting = snap.value("vllm:num_requests_waiting")
        kv = snap.value("vllm:kv_cache_usage_perc")
        part = {
            "hist": hists,
            "drafts": _sub(snap.value(DRAFTS), prev.value(DRAFTS)),
            "draft_tokens": _sub(snap.value(DRAFT_TOKENS), prev.value(DRAFT_TOKENS)),
            "accepted": _sub(snap.value(ACCEPTED), prev.value(ACCEPTED)),
            "acc_pos": acc_pos,
        }
        self._window.append((t, part))
        while self._window and self._window[0][0] <= t - self.window_s:
            self._window.popleft()
        win = [p for _, p in self._window]
        merged = {kind: merge_buckets(p["hist"][kind] for p in win) for kind in HISTOGRAMS}
        n_pos = max((len(p["acc_pos"]) for p in win), default=0)
        win_pos = [sum(p["acc_pos"][i] for p in win if i < len(p["acc_pos"])) for i in range(n_pos)]
        rate, per_pos = _acceptance(sum(p["drafts"] for p in win), sum(p["draft_tokens"] for p in win),
                                    sum(p["accepted"] for p in win), win_pos)
        modes = [m for m, v in snap.by_label("specpilot:speculation_mode_info", "mode").items() if v >= 1.0]
        busy = (running or 0) > 0 or out_tokens > 0
        row: dict[str, Any] = {
            "resolution_s": 1,
            "t": int(round(prev_t)),
            "covered_s": round(covered, 3),
            "busy_s": round(covered, 3) if busy else 0.0,
            "output_tokens": out_tokens,
            "user_output_tokens": None if user_new is None or user_old is None else _sub(user_new, user_old),
            "prompt_tokens": _sub(snap.value(PROMPT), prev.value(PROMPT)),
            "requests_finished": max(0.0, finished),
            "output_tokens_per_s": round(out_tokens / covered, 3),
            **_latency_columns(merged),
            "kv_cache_usage": kv, "kv_cache_usage_max": kv,
            "running": running, "running_max": running,
            "waiting": waiting, "waiting_max": waiting,
            "num_drafts": part["drafts"], "draft_tokens": part["draft_tokens"], "accepted_tokens": part["accepted"],
            "acceptance_rate": rate,
            "accepted_per_pos": acc_pos or None,
            "acceptance_per_position": per_pos,
            "k": snap.value("specpilot:speculation_k"),
            "mode": modes[0] if modes else None,
            "config_version": _int(snap.value("specpilot:config_version")),
            "max_num_seqs": _int(snap.value("specpilot:max_num_seqs")),
            "hist": {kind: encode_buckets(b) for kind, b in hists.items() if b} or None,
        }
        return row


def _int(v: float | None) -> int | None:
    return None if v is None else int(v)


def rollup(rows: Iterable[dict[str, Any]], resolution_s: int, t: int) -> dict[str, Any] | None:
    """Merge sample rows of one bucket into one row at ``resolution_s`` starting at ``t``.

    Args:
        rows: sample rows (dicts with the ``MetricSample`` columns), any resolution
            finer than ``resolution_s``, oldest first.
    Returns:
        The roll-up row, or None when ``rows`` is empty.
    """
    rows = list(rows)
    if not rows:
        return None
    out: dict[str, Any] = {"resolution_s": resolution_s, "t": t}
    for col in SUM_COLUMNS:
        out[col] = sum(r.get(col) or 0.0 for r in rows)
    users = [r.get("user_output_tokens") for r in rows]
    out["user_output_tokens"] = None if all(u is None for u in users) else sum(u or 0.0 for u in users)
    covered = out["covered_s"]
    out["output_tokens_per_s"] = round(out["output_tokens"] / covered, 3) if covered > 0 else None
    for col in MEAN_COLUMNS:
        pairs = [(r[col], r.get("covered_s") or 0.0) for r in rows if r.get(col) is not None]
        weight = sum(w for _, w in pairs)
        out[col] = round(sum(v * w for v, w in pairs) / weight, 4) if weight > 0 else None
    for col, src in MAX_COLUMNS.items():
        vals = [r.get(col) if r.get(col) is not None else r.get(src) for r in rows]
        vals = [v for v in vals if v is not None]
        out[col] = max(vals) if vals else None
    hists = {kind: merge_buckets(decode_buckets((r.get("hist") or {}).get(kind)) for r in rows) for kind in HISTOGRAMS}
    out.update(_latency_columns(hists))
    out["hist"] = {kind: encode_buckets(b) for kind, b in hists.items() if b} or None
    n_pos = max((len(r.get("accepted_per_pos") or []) for r in rows), default=0)
    acc_pos = [sum((r.get("accepted_per_pos") or [])[i] for r in rows if i < len(r.get("accepted_per_pos") or []))
               for i in range(n_pos)]
    out["accepted_per_pos"] = acc_pos or None
    out["acceptance_rate"], out["acceptance_per_position"] = _acceptance(
        out["num_drafts"], out["draft_tokens"], out["accepted_tokens"], acc_pos)
    last = rows[-1]
    for col in ("mode", "config_version", "max_num_seqs"):
        out[col] = last.get(col)
    return out
