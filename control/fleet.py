"""Fleet-wide views: every registered host at a glance, and series aggregated over hosts.

Per-host queries live in their own modules (``control.samples``, ``control.versions``,
``control.alerts``, ``control.cost``) and always take a host name; this module puts
them side by side.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from sqlalchemy import func, select

from .models import AlertEvent, CollectionGap, ConfigVersion, Host, MetricSample
from .samples import SERIES_COLUMNS, choose_resolution, rows_for_hosts
from .store import Store, list_hosts
from .versions import APPLIED

#: How a column is aggregated over hosts: rates and counts add up, fractions average,
#: latencies take the worst host.
SUMMED = {
    "output_tokens_per_s",
    "output_tokens",
    "user_output_tokens",
    "prompt_tokens",
    "requests_finished",
    "running",
    "running_max",
    "waiting",
    "waiting_max",
    "busy_s",
    "covered_s",
    "num_drafts",
    "draft_tokens",
    "accepted_tokens",
    "max_num_seqs",
}
MEANED = {"kv_cache_usage", "kv_cache_usage_max", "acceptance_rate", "k"}

_STATUS_COLUMNS = (
    "output_tokens_per_s",
    "ttft_p99_ms",
    "itl_p99_ms",
    "queue_p99_ms",
    "kv_cache_usage",
    "running",
    "waiting",
    "acceptance_rate",
    "k",
    "mode",
    "config_version",
    "max_num_seqs",
)


def fleet_status(store: Store, now: float | None = None, stale_s: float = 5.0) -> list[dict[str, Any]]:
    """One row per registered host: ``host, url, gpu_kind, usd_per_hour, up`` (a sample
    newer than ``stale_s`` s and no open gap), ``last_sample_at`` (unix s),
    ``control_version`` (the last applied version), ``open_alerts``, and the latest 1 s
    sample's ``output_tokens_per_s, ttft_p99_ms, itl_p99_ms, queue_p99_ms,
    kv_cache_usage, running, waiting, acceptance_rate, k, mode, config_version`` (the
    engine's), ``max_num_seqs``.
    """
    now = time.time() if now is None else now
    hosts = list_hosts(store)
    out = []
    with store.reader() as s:
        for h in hosts:
            last = s.execute(
                select(MetricSample.t, MetricSample.covered_s, *[getattr(MetricSample, c) for c in _STATUS_COLUMNS])
                .where(MetricSample.host_id == h.id, MetricSample.resolution_s == 1)
                .order_by(MetricSample.t.desc())
                .limit(1)
            ).first()
            gap_open = s.scalar(
                select(func.count())
                .select_from(CollectionGap)
                .where(CollectionGap.host_id == h.id, CollectionGap.ended_at.is_(None))
            )
            alerts = s.scalar(
                select(func.count())
                .select_from(AlertEvent)
                .where(AlertEvent.host_id == h.id, AlertEvent.ended_at.is_(None))
            )
            version = s.scalar(
                select(func.max(ConfigVersion.version)).where(
                    ConfigVersion.host_id == h.id, ConfigVersion.status == APPLIED
                )
            )
            sample = dict(last._mapping) if last else {}
            last_at = sample["t"] + sample["covered_s"] if sample else None
            out.append(
                {
                    "host": h.name,
                    "url": h.url,
                    "gpu_kind": h.gpu_kind,
                    "usd_per_hour": h.usd_per_hour,
                    "up": bool(last_at and now - last_at <= stale_s and not gap_open),
                    "last_sample_at": last_at,
                    "control_version": version,
                    "open_alerts": alerts,
                    **{c: sample.get(c) for c in _STATUS_COLUMNS},
                }
            )
    return out


def fleet_series(
    store: Store,
    columns: Sequence[str],
    start: float,
    end: float | None = None,
    resolution_s: int | None = None,
    max_points: int = 20000,
) -> dict[str, Any]:
    """Series aggregated over all hosts: ``{"resolution_s", "t": [...], col: [...],
    "hosts": {name: {col: [...]}}}`` (per-host values aligned on ``t``, None where a
    host has no sample). Sums for rates and counts (tokens/s, running...), means for
    fractions (KV cache usage, acceptance), the maximum for latencies (ms).

    Raises:
        ValueError: unknown column.
    """
    bad = [c for c in columns if c not in SERIES_COLUMNS]
    if bad:
        raise ValueError(f"unknown sample column(s) {bad}")
    end = time.time() if end is None else end
    res = resolution_s or choose_resolution(start, end, max_points=max_points)
    hosts = list_hosts(store)
    names = {h.id: h.name for h in hosts}
    rows = rows_for_hosts(store, names, start, end, res, columns)
    ts = sorted({r["t"] for r in rows})
    index = {t: i for i, t in enumerate(ts)}
    per_host: dict[str, dict[str, list[Any]]] = {n: {c: [None] * len(ts) for c in columns} for n in names.values()}
    for r in rows:
        for c in columns:
            per_host[names[r["host_id"]]][c][index[r["t"]]] = r[c]
    out: dict[str, Any] = {"resolution_s": res, "t": ts, "hosts": per_host}
    for c in columns:
        agg: list[Any] = []
        for i in range(len(ts)):
            vals = [per_host[n][c][i] for n in per_host if per_host[n][c][i] is not None]
            if not vals:
                agg.append(None)
            elif c in SUMMED:
                agg.append(sum(vals))
            elif c in MEANED:
                agg.append(sum(vals) / len(vals))
            else:
                agg.append(max(vals))
        out[c] = agg
    return out


# --------------------------------------------------------------------------- the Fleet page's figures


def window_figures(store: Store, since: float, until: float) -> dict[str, tuple[float | None, float | None]]:
    """Every registered host's ``(output tokens/s, TTFT P99 ms)`` over ``since..until``
    (unix s): the mean user output tokens/s of its 1 s samples and the worst of their
    TTFT P99, in one GROUP BY over the store; in Prometheus mode two PromQL queries for
    all hosts (the token rate over the window, and the worst 10 s-window TTFT P99 of each
    second in it, as the Live page's series). Hosts without data are left out.

    Raises:
        StoreError, MetricSourceError: the store or Prometheus cannot answer.
    """
    from .promsource import metrics_source

    with store.reader() as s:
        rows = s.execute(select(Host.id, Host.name, Host.url).where(Host.removed_at.is_(None))).all()
        names = {r.id: r.name for r in rows}
        if metrics_source() == "prometheus":
            return _prometheus_figures({r.name: r.url for r in rows}, until, until - since)
        return {
            names[hid]: (tokens, ttft)
            for hid, tokens, ttft in s.execute(
                select(
                    MetricSample.host_id, func.avg(MetricSample.output_tokens_per_s), func.max(MetricSample.ttft_p99_ms)
                )
                .where(
                    MetricSample.resolution_s == 1,
                    MetricSample.t >= since,
                    MetricSample.t <= until,
                    MetricSample.host_id.in_(list(names)),
                )
                .group_by(MetricSample.host_id)
            ).all()
            if hid in names
        }


def open_alert_counts(store: Store) -> dict[str, int]:
    """Open alerts per registered host name (one query)."""
    with store.reader() as s:
        rows = s.execute(
            select(Host.name, func.count())
            .join(AlertEvent, AlertEvent.host_id == Host.id)
            .where(AlertEvent.ended_at.is_(None), Host.removed_at.is_(None))
            .group_by(Host.name)
        ).all()
    return {name: int(n) for name, n in rows}


def _prometheus_figures(
    urls: dict[str, str], end: float, window_s: float
) -> dict[str, tuple[float | None, float | None]]:
    """Output tokens/s over the window and the worst 10 s-window TTFT P99 (ms) of each
    second in it, for every host (``{name: url}``), from the Prometheus server in force
    (two queries)."""
    from engine_host import envs

    from .promsource import PrometheusSource, _num, instance_of, queries

    by_instance = {instance_of(url): name for name, url in urls.items()}
    src = PrometheusSource(envs.prometheus_url() or "")
    w = max(1, int(window_s))
    tokens_q = queries(list(by_instance), w)["output_tokens_per_s"]
    ttft_q = f"max by (instance) (max_over_time(({queries(list(by_instance), 10)['ttft_p99_ms']})[{w}s:1s]))"
    out: dict[str, list[float | None]] = {name: [None, None] for name in by_instance.values()}
    for i, q in enumerate((tokens_q, ttft_q)):
        for r in src._query(q, end):
            name = by_instance.get(r["metric"].get("instance"))
            if name is not None:
                out[name][i] = _num(r["value"][1])
    return {name: (v[0], v[1]) for name, v in out.items()}
