"""From scrapes to samples, and from samples to roll-ups (pure functions, no I/O).

:class:`SampleBuilder` turns consecutive ``/metrics`` scrapes of one host into 1 s sample
rows (the columns of ``control.models.MetricSample``; the figures are defined once, in
:mod:`engine_host.sample`, shared with the engine host's own ring buffer):

* throughput from counter deltas: output tokens (``vllm:generation_tokens_total``),
  user output tokens (``specpilot:user_generation_tokens_total``, warm-up and
  heartbeat requests left out), prompt tokens, finished requests, per second;
* TTFT / ITL / E2E / queue-time P50/P95/P99 (ms) over a trailing window
  (``window_s``, default 10 s) of histogram bucket deltas, so that the figures are
  windowed rather than lifetime;
* KV cache usage (fraction 0..1), running and waiting requests (gauges);
* acceptance rate (accepted / draft tokens, 0..1) over the same window, and per draft
  position j: accepted_j / draft_tokens_j;
* K in force, speculation mode, the engine's config version, the running-sequence cap.

A counter that goes down (engine restart) restarts the builder: no sample for that
scrape, the next one is measured from the new baseline.

:func:`rollup` merges rows of one bucket (60 s or 3600 s): sums for counts and seconds,
time-weighted means for gauges, maxima, exact percentiles from the merged histogram
buckets, acceptance from summed counts (per position: summed accepted_j / summed draft_tokens_j).
"""

from __future__ import annotations

from typing import Any, Iterable

from engine_host.sample import (
    LATENCY_COLUMNS,
    LATENCY_HISTOGRAMS,
    PERCENTILES,
    USER_LATENCY_HISTOGRAMS,
    Interval,
    SampleWindow,
    acceptance,
    latency_percentiles_ms,
    rows_total,
)

from .metrics_parse import Snapshot, bucket_delta, decode_buckets, encode_buckets, merge_buckets

HISTOGRAMS = LATENCY_HISTOGRAMS

GEN = "vllm:generation_tokens_total"
USER_GEN = "specpilot:user_generation_tokens_total"
PROMPT = "vllm:prompt_tokens_total"
FINISHED = "vllm:request_success_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
DRAFT_POS = "specpilot:spec_decode_num_draft_tokens_per_pos_total"
ENGINE_START = "specpilot:engine_start_time_seconds"

#: The metric families the collector reads (the rest of ``/metrics`` is skipped).
FAMILIES = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:generation_tokens",
        "vllm:prompt_tokens",
        "vllm:request_success",
        *HISTOGRAMS.values(),
        *USER_LATENCY_HISTOGRAMS.values(),
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "specpilot:spec_decode_num_draft_tokens_per_pos",
        "specpilot:speculation_k",
        "specpilot:speculation_mode_info",
        "specpilot:config_version",
        "specpilot:max_num_seqs",
        "specpilot:engine_start_time_seconds",
        "specpilot:ready",
        "specpilot:user_generation_tokens",
    }
)

#: Columns summed in roll-ups.
SUM_COLUMNS = (
    "covered_s",
    "busy_s",
    "output_tokens",
    "prompt_tokens",
    "requests_finished",
    "num_drafts",
    "draft_tokens",
    "accepted_tokens",
)
#: Gauge columns averaged (weighted by covered seconds) in roll-ups, with their maxima.
MEAN_COLUMNS = ("kv_cache_usage", "running", "waiting", "k")
MAX_COLUMNS = {"kv_cache_usage_max": "kv_cache_usage", "running_max": "running", "waiting_max": "waiting"}
__all__ = ["FAMILIES", "HISTOGRAMS", "LATENCY_COLUMNS", "PERCENTILES", "SampleBuilder", "rollup"]


def _positions(snap: Snapshot, name: str) -> list[float] | None:
    per = snap.by_label(name, "position")
    if not per:
        return None
    return [per[str(i)] for i in range(len(per)) if str(i) in per]


def _sub(a: float | None, b: float | None) -> float:
    return max(0.0, (a or 0.0) - (b or 0.0))


def _pos_delta(new: list[float] | None, old: list[float] | None) -> list[float] | None:
    if new is None:
        return None
    old = old or []
    return [_sub(n, old[i] if i < len(old) else 0.0) for i, n in enumerate(new)]


class SampleBuilder:
    """Builds 1 s sample rows from consecutive scrapes of one host.

    Each pair of scrapes gives an :class:`engine_host.sample.Interval` of counter and
    histogram-bucket deltas; :class:`engine_host.sample.SampleWindow` (shared with the
    engine host's ring buffer) makes the row. Latencies come from the engine host's
    user-only histograms (``specpilot:user_*_seconds``) when it serves them, else from
    vLLM's (which include warm-up and heartbeats).

    Args:
        window_s: trailing window (s) of the latency percentiles and acceptance rate.
    """

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self.prev: Snapshot | None = None
        self.prev_t: float | None = None
        self.engine_start: float | None = None
        self._window = SampleWindow(window_s)

    def reset(self) -> None:
        """Forget the baseline (after a gap or an engine restart)."""
        self.prev = self.prev_t = None
        self._window.reset()

    def feed(self, snap: Snapshot, t: float) -> dict[str, Any] | None:
        """Add a scrape taken at ``t`` (unix s).

        Returns:
            The sample row (:class:`engine_host.sample.Sample` as a dict) for the interval
            since the previous scrape (``t`` = start of the interval, rounded to the
            second), or None for the first scrape and after a counter reset.
        """
        start = snap.value(ENGINE_START)
        prev, prev_t = self.prev, self.prev_t
        restarted = start is not None and self.engine_start is not None and start != self.engine_start
        self.engine_start = start if start is not None else self.engine_start
        self.prev, self.prev_t = snap, t
        if prev is None or prev_t is None or restarted or t <= prev_t:
            self._window.reset()
            return None
        if (snap.value(GEN) or 0.0) < (prev.value(GEN) or 0.0):
            self._window.reset()
            return None
        hists = {}
        for kind, name in HISTOGRAMS.items():
            user = USER_LATENCY_HISTOGRAMS[kind]
            if snap.histogram(user):
                name = user
            hists[kind] = bucket_delta(snap.histogram(name), prev.histogram(name))
        user_new, user_old = snap.value(USER_GEN), prev.value(USER_GEN)
        finished = sum(snap.by_label(FINISHED, "finished_reason").values()) - sum(
            prev.by_label(FINISHED, "finished_reason").values()
        )
        modes = [m for m, v in snap.by_label("specpilot:speculation_mode_info", "mode").items() if v >= 1.0]
        iv = Interval(
            t=prev_t,
            covered_s=t - prev_t,
            output_tokens=_sub(snap.value(GEN), prev.value(GEN)),
            user_output_tokens=None if user_new is None or user_old is None else _sub(user_new, user_old),
            prompt_tokens=_sub(snap.value(PROMPT), prev.value(PROMPT)),
            requests_finished=max(0.0, finished),
            num_drafts=_sub(snap.value(DRAFTS), prev.value(DRAFTS)),
            draft_tokens=_sub(snap.value(DRAFT_TOKENS), prev.value(DRAFT_TOKENS)),
            accepted_tokens=_sub(snap.value(ACCEPTED), prev.value(ACCEPTED)),
            draft_tokens_per_pos=_pos_delta(_positions(snap, DRAFT_POS), _positions(prev, DRAFT_POS)),
            accepted_per_pos=_pos_delta(_positions(snap, ACCEPTED_POS), _positions(prev, ACCEPTED_POS)),
            hist=hists,
            kv_cache_usage=snap.value("vllm:kv_cache_usage_perc"),
            running=snap.value("vllm:num_requests_running"),
            waiting=snap.value("vllm:num_requests_waiting"),
            k=snap.value("specpilot:speculation_k"),
            mode=modes[0] if modes else None,
            config_version=_int(snap.value("specpilot:config_version")),
            max_num_seqs=_int(snap.value("specpilot:max_num_seqs")),
        )
        return self._window.add(iv).model_dump(exclude={"internal_output_tokens"})


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
    served = out["output_tokens"] if out["user_output_tokens"] is None else out["user_output_tokens"]
    out["output_tokens_per_s"] = round(served / covered, 3) if covered > 0 else None
    for col in MEAN_COLUMNS:
        pairs = [(r[col], r.get("covered_s") or 0.0) for r in rows if r.get(col) is not None]
        weight = sum(w for _, w in pairs)
        out[col] = round(sum(v * w for v, w in pairs) / weight, 4) if weight > 0 else None
    for col, src in MAX_COLUMNS.items():
        vals = [v for v in (r.get(col) if r.get(col) is not None else r.get(src) for r in rows) if v is not None]
        out[col] = max(vals) if vals else None
    hists = {kind: merge_buckets(decode_buckets((r.get("hist") or {}).get(kind)) for r in rows) for kind in HISTOGRAMS}
    out.update(latency_percentiles_ms(hists))
    out["hist"] = {kind: encode_buckets(b) for kind, b in hists.items() if b} or None
    out["accepted_per_pos"] = rows_total(rows, "accepted_per_pos") or None
    known = all(r.get("draft_tokens_per_pos") is not None or not r.get("draft_tokens") for r in rows)
    out["draft_tokens_per_pos"] = (rows_total(rows, "draft_tokens_per_pos") or None) if known else None
    out["acceptance_rate"], out["acceptance_per_position"] = acceptance(
        out["draft_tokens"], out["accepted_tokens"], out["draft_tokens_per_pos"], out["accepted_per_pos"]
    )
    last = rows[-1]
    for col in ("mode", "config_version", "max_num_seqs"):
        out[col] = last.get(col)
    return out
