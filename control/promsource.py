"""Prometheus as the control plane's metric source, beside the embedded collector.

A fleet's operators usually run Prometheus already. With ``--metrics-source prometheus
--prometheus-url URL`` (or ``SPECPILOT_METRICS_SOURCE=prometheus`` and
``SPECPILOT_PROMETHEUS_URL``) the control plane reads the windowed figures its views
need from that server (PromQL over its HTTP API, through ``prometheus-api-client``)
instead of its own store. The embedded collector stays the default.

Both sources give the same figures over a window ``[end - window_s, end]``:

* counts (output tokens, finished requests, drafted and accepted tokens) are the
  counter's value at ``end`` minus its value at ``end - window_s`` (what the collector's
  1 s deltas add up to); PromQL ``m - m offset W`` (the whole value for a series born
  in the window), or ``increase(m[W])`` when the counter went down inside the window
  (an engine restart);
* rates (tokens/s) are those counts divided by ``window_s``;
* latency percentiles (ms) are ``histogram_quantile`` over the bucket counts added in
  the window (linear interpolation inside a bucket, as :func:`control.metrics_parse.quantile`);
* acceptance rate (fraction 0..1) is accepted / drafted tokens in the window;
* KV cache usage (fraction 0..1), running and waiting requests are means over the
  scrapes in the window; K and the engine's config version are the last values.

A host is matched to its Prometheus series by the ``instance`` label, which is the
``host:port`` of the host's registered URL (Prometheus' default for a static target).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlparse

from engine_host import envs

from .metrics_parse import decode_buckets, merge_buckets, quantile
from .sampling import HISTOGRAMS, PERCENTILES
from .store import ControlError

ENV_SOURCE = envs.METRICS_SOURCE
ENV_URL = envs.PROMETHEUS_URL
SOURCES = ("embedded", "prometheus")

#: The figures both sources give for a window (units in the names; fractions 0..1).
FIGURES = (
    "output_tokens",
    "output_tokens_per_s",
    "requests_finished",
    "requests_per_s",
    *(f"{kind}_{p}_ms" for kind in HISTOGRAMS for p in PERCENTILES),
    "draft_tokens",
    "accepted_tokens",
    "acceptance_rate",
    "kv_cache_usage",
    "running",
    "waiting",
    "k",
    "config_version",
)


class MetricSourceError(ControlError):
    """The metric source is misconfigured or cannot answer (message fit for a user)."""


def metrics_source() -> str:
    """The metric source in force: ``embedded`` (default) or ``prometheus``.

    Raises:
        MetricSourceError: an unknown source, or ``prometheus`` without a URL.
    """
    src = envs.metrics_source()
    if src not in SOURCES:
        raise MetricSourceError(f"{ENV_SOURCE}={src!r} is not a metric source; use one of {', '.join(SOURCES)}")
    if src == "prometheus" and not envs.prometheus_url():
        raise MetricSourceError(f"metric source prometheus needs a server URL ({ENV_URL} or --prometheus-url)")
    return src


def configure(source: str | None, url: str | None) -> None:
    """Set the metric source for this process and the processes it starts (command line).

    Raises:
        MetricSourceError: as :func:`metrics_source`.
    """
    if source:
        os.environ[ENV_SOURCE] = source
    if url:
        os.environ[ENV_URL] = url
    metrics_source()


def instance_of(url: str) -> str:
    """The Prometheus ``instance`` label of an engine host URL (``host:port``).

    Raises:
        ValueError: the URL has no host.
    """
    u = urlparse(url)
    if not u.hostname:
        raise ValueError(f"not an engine host URL: {url!r}")
    port = u.port or (443 if u.scheme == "https" else 80)
    return f"{u.hostname}:{port}"


def _delta(metric: str, sel: str, w: int) -> str:
    """PromQL: what counter ``metric`` added over the last ``w`` s (per series): the
    difference of its values; its whole value when the series appeared in the window (a
    label value seen for the first time counts from 0, as the collector does);
    ``increase()`` when it went down (an engine restart)."""
    m = f"{metric}{{{sel}}}"
    return f"(({m} - {m} offset {w}s) >= 0 or ({m} unless {m} offset {w}s) or increase({m}[{w}s]))"


def _quote(values: Iterable[str]) -> str:
    import re

    # a regular expression inside a PromQL string: the regex's backslashes are escaped again
    return "|".join(re.escape(v) for v in values).replace("\\", "\\\\").replace('"', '\\"')


def queries(instances: Sequence[str], window_s: int) -> dict[str, str]:
    """PromQL per figure for ``instances`` over a ``window_s`` (s) window; every result
    is one series per ``instance``.

    Raises:
        ValueError: no instance, or a window under 1 s.
    """
    if not instances:
        raise ValueError("no instance to query")
    w = int(window_s)
    if w < 1:
        raise ValueError(f"the window must be at least 1 s, got {window_s}")
    sel = f'instance=~"{_quote(instances)}"'
    q: dict[str, str] = {
        "output_tokens": f"sum by (instance) {_delta('vllm:generation_tokens_total', sel, w)}",
        "requests_finished": f"sum by (instance) {_delta('vllm:request_success_total', sel, w)}",
        "draft_tokens": f"sum by (instance) {_delta('vllm:spec_decode_num_draft_tokens_total', sel, w)}",
        "accepted_tokens": f"sum by (instance) {_delta('vllm:spec_decode_num_accepted_tokens_total', sel, w)}",
        "kv_cache_usage": f"avg by (instance) (avg_over_time(vllm:kv_cache_usage_perc{{{sel}}}[{w}s]))",
        "running": f"sum by (instance) (avg_over_time(vllm:num_requests_running{{{sel}}}[{w}s]))",
        "waiting": f"sum by (instance) (avg_over_time(vllm:num_requests_waiting{{{sel}}}[{w}s]))",
        "k": f"max by (instance) (specpilot:speculation_k{{{sel}}})",
        "config_version": f"max by (instance) (specpilot:config_version{{{sel}}})",
    }
    q["output_tokens_per_s"] = f"{q['output_tokens']} / {w}"
    q["requests_per_s"] = f"{q['requests_finished']} / {w}"
    q["acceptance_rate"] = f"{q['accepted_tokens']} / ({q['draft_tokens']} > 0)"
    for kind, metric in HISTOGRAMS.items():
        buckets = f"sum by (instance, le) {_delta(metric + '_bucket', sel, w)}"
        for p, qq in PERCENTILES.items():
            # no observations in the window: NaN in PromQL, left out (None) like the store
            q[f"{kind}_{p}_ms"] = f"(histogram_quantile({qq}, {buckets}) * 1000) >= 0"
    return q


def _num(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) or math.isinf(x) else x


class PrometheusSource:
    """Windowed figures of engine hosts from a Prometheus server.

    Args:
        url: the server's base URL (``http://prometheus:9090``).
        timeout_s: per query (s).

    Raises:
        MetricSourceError (from the methods): the server cannot be reached or refuses a query.
    """

    def __init__(self, url: str, timeout_s: float = 10.0):
        from prometheus_api_client import PrometheusConnect

        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.prom = PrometheusConnect(url=self.url, disable_ssl=True, timeout=timeout_s)

    def _query(self, expr: str, at: float) -> list[dict[str, Any]]:
        try:
            return self.prom.custom_query(expr, params={"time": f"{at:.3f}"})
        except Exception as exc:  # the client raises requests' and its own errors
            raise MetricSourceError(f"Prometheus at {self.url} did not answer {expr[:80]!r}: {exc}") from exc

    def _query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        try:
            return self.prom.custom_query_range(
                expr,
                start_time=datetime.fromtimestamp(start, tz=timezone.utc),
                end_time=datetime.fromtimestamp(end, tz=timezone.utc),
                step=f"{step_s:g}s",
            )
        except Exception as exc:
            raise MetricSourceError(f"Prometheus at {self.url} did not answer {expr[:80]!r}: {exc}") from exc

    def window(
        self, instances: Sequence[str], end: float | None = None, window_s: int = 60, figures: Sequence[str] = FIGURES
    ) -> dict[str, dict[str, float | None]]:
        """:data:`FIGURES` of each instance over ``[end - window_s, end]`` (unix s):
        ``{instance: {figure: value or None}}`` (None: no data, e.g. no request finished)."""
        end = time.time() if end is None else end
        qs = queries(instances, window_s)
        out: dict[str, dict[str, float | None]] = {i: {f: None for f in figures} for i in instances}
        for f in figures:
            for r in self._query(qs[f], end):
                inst = r["metric"].get("instance")
                if inst in out:
                    out[inst][f] = _num(r["value"][1])
        return out

    def series(
        self,
        instances: Sequence[str],
        start: float,
        end: float,
        step_s: float = 1.0,
        window_s: int = 10,
        figures: Sequence[str] = FIGURES,
    ) -> dict[str, dict[str, Any]]:
        """Chart series: ``{instance: {"t": [unix s...], figure: [...]}}``, one point per
        ``step_s`` s, each the figure over the ``window_s`` s before it."""
        qs = queries(instances, window_s)
        n = int((end - start) // step_s) + 1
        ts = [start + i * step_s for i in range(n)]
        index = {round(t, 3): i for i, t in enumerate(ts)}
        out: dict[str, dict[str, Any]] = {i: {"t": ts, **{f: [None] * n for f in figures}} for i in instances}
        for f in figures:
            for r in self._query_range(qs[f], start, end, step_s):
                inst = r["metric"].get("instance")
                if inst not in out:
                    continue
                for t, v in r["values"]:
                    i = index.get(round(float(t), 3))
                    if i is not None:
                        out[inst][f][i] = _num(v)
        return out

    def samples(
        self, instance: str, start: float, end: float, step_s: float = 1.0, window_s: int = 10
    ) -> list[dict[str, Any]]:
        """Sample-like rows (``t``, ``interval_s`` and :data:`FIGURES`) of one instance,
        oldest first, for the views that read stored samples."""
        s = self.series([instance], start, end, step_s=step_s, window_s=window_s)[instance]
        rows = []
        for i, t in enumerate(s["t"]):
            row = {
                "t": t,
                "interval_s": step_s,
                "covered_s": step_s,
                "e2e_ms_mean": None,
                **{f: s[f][i] for f in FIGURES},
            }
            if row["output_tokens"] is None and row["k"] is None:
                continue  # no scrape there (host down or not yet scraped)
            rows.append(row)
        return rows


def store_window(store: Any, host: str, end: float, window_s: int = 60) -> dict[str, float | None]:
    """:data:`FIGURES` of one host over ``[end - window_s, end]`` (unix s) from the
    embedded store's 1 s samples (the collector's view of the same counters).

    Raises:
        UnknownHost.
    """
    from .samples import samples

    rows = samples(store, host, end - window_s, end, resolution_s=1)
    w = float(window_s)
    out: dict[str, float | None] = {f: None for f in FIGURES}
    if not rows:
        return out
    total = lambda c: sum(r.get(c) or 0.0 for r in rows)
    out["output_tokens"] = tokens = total("output_tokens")
    out["output_tokens_per_s"] = tokens / w
    out["requests_finished"] = finished = total("requests_finished")
    out["requests_per_s"] = finished / w
    out["draft_tokens"], out["accepted_tokens"] = drafted, accepted = total("draft_tokens"), total("accepted_tokens")
    out["acceptance_rate"] = accepted / drafted if drafted else None
    for kind in HISTOGRAMS:
        merged = merge_buckets(decode_buckets((r.get("hist") or {}).get(kind)) for r in rows)
        for p, q in PERCENTILES.items():
            v = quantile(q, merged)
            out[f"{kind}_{p}_ms"] = None if v is None else v * 1000.0
    for c in ("kv_cache_usage", "running", "waiting"):
        vals = [r[c] for r in rows if r.get(c) is not None]
        out[c] = sum(vals) / len(vals) if vals else None
    for c in ("k", "config_version"):
        vals = [r[c] for r in rows if r.get(c) is not None]
        out[c] = float(vals[-1]) if vals else None
    return out


def host_window(store: Any, host: str, end: float | None = None, window_s: int = 60) -> dict[str, float | None]:
    """:data:`FIGURES` of one host over the last ``window_s`` s from the metric source in
    force (:func:`metrics_source`).

    Raises:
        UnknownHost, MetricSourceError.
    """
    from .store import get_host

    end = time.time() if end is None else end
    if metrics_source() == "prometheus":
        inst = instance_of(get_host(store, host).url)
        return PrometheusSource(envs.prometheus_url() or "").window([inst], end, window_s)[inst]
    return store_window(store, host, end, window_s)


def prometheus_samples(
    url: str, since: float, until: float, step_s: int = 1, window_s: int | None = None
) -> list[dict[str, Any]]:
    """Sample-like rows of the engine host at ``url`` from the Prometheus server in
    ``$SPECPILOT_PROMETHEUS_URL``, one per ``step_s`` s (the views' stored-samples shape:
    ``t``, ``interval_s``, ``requests_per_s`` and :data:`FIGURES`); each over the
    ``window_s`` s before it (default: ``step_s``, at least 10 s for percentiles).

    Raises:
        MetricSourceError: no URL set or the server cannot answer.
    """
    prom_url = envs.prometheus_url()
    if not prom_url:
        raise MetricSourceError(f"metric source prometheus needs a server URL ({ENV_URL} or --prometheus-url)")
    step = max(1, int(step_s))
    n_max = 11000  # Prometheus refuses more than 11,000 points per series
    if (until - since) / step > n_max:
        since = until - n_max * step
    return PrometheusSource(prom_url).samples(
        instance_of(url), math.floor(since), math.floor(until), step_s=step, window_s=window_s or max(step, 10)
    )
