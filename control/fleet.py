"""Fleet-wide views: every registered host at a glance, and series aggregated over hosts.

Per-host queries live in their own modules (``control.samples``, ``control.versions``,
``control.alerts``, ``control.cost``) and always take a host name; this module puts
them side by side.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from sqlalchemy import func, select

from .models import AlertEvent, CollectionGap, ConfigVersion, MetricSample
from .samples import SERIES_COLUMNS, choose_resolution, rows_for_hosts
from .store import Store, list_hosts
from .versions import APPLIED

#: How a column is aggregated over hosts: rates and counts add up, fractions average,
#: latencies take the worst host.
SUMMED = {"output_tokens_per_s", "output_tokens", "user_output_tokens", "prompt_tokens", "requests_finished",
          "running", "running_max", "waiting", "waiting_max", "busy_s", "covered_s", "num_drafts", "draft_tokens",
          "accepted_tokens", "max_num_seqs"}
MEANED = {"kv_cache_usage", "kv_cache_usage_max", "acceptance_rate", "k"}

_STATUS_COLUMNS = ("output_tokens_per_s", "ttft_p99_ms", "itl_p99_ms", "queue_p99_ms", "kv_cache_usage", "running",
                   "waiting", "acceptance_rate", "k", "mode", "config_version", "max_num_seqs")


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
            last = s.execute(select(MetricSample.t, MetricSample.covered_s,
                                    *[getattr(MetricSample, c) for c in _STATUS_COLUMNS])
                             .where(MetricSample.host_id == h.id, MetricSample.resolution_s == 1)
                             .order_by(MetricSample.t.desc()).limit(1)).first()
            gap_open = s.scalar(select(func.count()).select_from(CollectionGap).where(
                CollectionGap.host_id == h.id, CollectionGap.ended_at.is_(None)))
            alerts = s.scalar(select(func.count()).select_from(AlertEvent).where(
                AlertEvent.host_id == h.id, AlertEvent.ended_at.is_(None)))
            version = s.scalar(select(func.max(ConfigVersion.version)).where(
                ConfigVersion.host_id == h.id, ConfigVersion.status == APPLIED))
            sample = dict(last._mapping) if last else {}
            last_at = sample["t"] + sample["covered_s"] if sample else None
            out.append({
                "host": h.name, "url": h.url, "gpu_kind": h.gpu_kind, "usd_per_hour": h.usd_per_hour,
                "up": bool(last_at and now - last_at <= stale_s and not gap_open),
                "last_sample_at": last_at, "control_version": version, "open_alerts": alerts,
                **{c: sample.get(c) for c in _STATUS_COLUMNS},
            })
    return out


def fleet_series(store: Store, columns: Sequence[str], start: float, end: float | None = None,
                 resolution_s: int | None = None, max_points: int = 20000) -> dict[str, Any]:
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
    per_host = {n: {c: [None] * len(ts) for c in columns} for n in names.values()}
    for r in rows:
        for c in columns:
            per_host[names[r["host_id"]]][c][index[r["t"]]] = r[c]
    out: dict[str, Any] = {"resolution_s": res, "t": ts, "hosts": per_host}
    for c in columns:
        agg = []
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


# --------------------------------------------------------------------------- the Fleet page's table

#: Requests to engine hosts in flight at once when the Fleet page asks every host for its state.
STATE_WORKERS = 8


def fleet_overview(backend: Any | None = None, window_s: float = 60.0, now: float | None = None) -> Any:
    """All hosts at a glance, one row each (a pandas DataFrame, by host name): ``host``,
    ``state`` (UP, DOWN or the phase), ``mode``, ``k_current`` (tokens), ``running``,
    ``max_num_seqs``, ``waiting``, ``open_alerts``, ``output_tokens_per_s`` (mean over the
    last ``window_s`` s), ``ttft_p99_ms`` (the worst P99 over the last ``window_s`` s, ms),
    ``usd_per_hour`` (USD/hour), ``gpu_kind``, ``url``, ``error`` (why a host is DOWN).

    What it costs with N hosts: every host is asked for its state (``GET /control/state``,
    the dashboard's state timeout) with up to :data:`STATE_WORKERS` requests in flight,
    so unreachable hosts cost one timeout per :data:`STATE_WORKERS` of them, not one
    each; the figures come
    from one query for all hosts: a GROUP BY over the store's 1 s samples, or, in
    Prometheus mode, two PromQL queries (the token rate over the window, and the worst
    10 s-window TTFT P99 of each second in it, as the Live page's series). Any other
    backend (``control.views.set_backend``) is asked host by host, in parallel.

    Args:
        backend: the dashboard's store/engine access object (default: the one in force).
        window_s: the window of the figures (s).
        now: end of the window (unix s; default now).

    Raises:
        StoreError, MetricSourceError: the store or Prometheus cannot answer. A host that
        is down never raises: its row says DOWN and why.
    """
    import pandas as pd

    from . import views

    backend = backend if backend is not None else views._backend()
    now = time.time() if now is None else now
    hosts = sorted(backend.list_hosts(), key=lambda h: h.name)
    if not hosts:
        return pd.DataFrame([])
    since = now - window_s
    ask = backend.engine_state
    if isinstance(backend, views.StoreBackend):
        figures, alerts, clients = _store_figures(backend, hosts, since, now, window_s)
        ask = lambda name, timeout_s: (clients[name].state() if name in clients  # noqa: E731
                                       else backend.engine_state(name, timeout_s=timeout_s))
    else:
        figures = _figures_host_by_host(backend, hosts, since, now)
        open_alerts = backend.alerts(open_only=True)
        alerts = {}
        for a in open_alerts:
            alerts[a["host"]] = alerts.get(a["host"], 0) + 1
    statuses = _states(ask, hosts)
    rows = []
    for h in hosts:
        s = statuses[h.name]
        tokens, ttft = figures.get(h.name, (None, None))
        rows.append({
            "host": h.name, "state": s.label, "mode": s.mode, "k_current": s.k_current, "running": s.running,
            "max_num_seqs": s.max_num_seqs, "waiting": s.waiting, "open_alerts": int(alerts.get(h.name, 0)),
            "output_tokens_per_s": tokens, "ttft_p99_ms": ttft, "usd_per_hour": h.usd_per_hour,
            "gpu_kind": h.gpu_kind, "url": h.url, "error": s.error,
        })
    return pd.DataFrame(rows)


def _states(ask: Any, hosts: Sequence[Any]) -> dict[str, Any]:
    """Each host's :class:`control.views.HostStatus`, asked in parallel through
    ``ask(name, timeout_s)`` (the engine host's ``/control/state`` answer)."""
    from concurrent.futures import ThreadPoolExecutor

    from . import views

    def one(h: Any) -> Any:
        try:
            state = ask(h.name, timeout_s=views.STATE_TIMEOUT_S)
        except Exception as exc:  # down, refused, timeout, 401, 5xx: all shown as DOWN
            return views.HostStatus(name=h.name, url=h.url, up=False, error=views.describe_error(exc))
        return views.status_from_state(h.name, h.url, state)

    with ThreadPoolExecutor(max_workers=min(STATE_WORKERS, len(hosts)), thread_name_prefix="fleet-state") as pool:
        return dict(zip((h.name for h in hosts), pool.map(one, hosts)))


def _store_figures(backend: Any, hosts: Sequence[Any], since: float, until: float,
                   window_s: float) -> tuple[dict[str, tuple[float | None, float | None]], dict[str, int], dict[str, Any]]:
    """``({host: (output tokens/s, TTFT P99 ms)}, {host: open alerts}, {host: client})``
    in one query each, from the store (or Prometheus in Prometheus mode) behind a
    ``StoreBackend``; the clients (:class:`control.client.EngineClient`, no retries, the
    dashboard's state timeout) are made once per host, URL and token variable."""
    from sqlalchemy.orm import Session

    from .models import Host
    from .promsource import metrics_source

    with Session(backend.engine) as s:
        rows = s.execute(select(Host.id, Host.name, Host.url, Host.token_env).where(Host.removed_at.is_(None))).all()
        names = {r.id: r.name for r in rows}
        clients = {r.name: _client(r) for r in rows}
        alerts = {names[hid]: n for hid, n in s.execute(
            select(AlertEvent.host_id, func.count()).where(AlertEvent.ended_at.is_(None))
            .group_by(AlertEvent.host_id)).all() if hid in names}
        if metrics_source() == "prometheus":
            return _prometheus_figures(hosts, until, window_s), alerts, clients
        figures = {names[hid]: (tokens, ttft) for hid, tokens, ttft in s.execute(
            select(MetricSample.host_id, func.avg(MetricSample.output_tokens_per_s), func.max(MetricSample.ttft_p99_ms))
            .where(MetricSample.resolution_s == 1, MetricSample.t >= since, MetricSample.t <= until,
                   MetricSample.host_id.in_(list(names)))
            .group_by(MetricSample.host_id)).all() if hid in names}
    return figures, alerts, clients


_CLIENTS: dict[tuple[str, str, str], Any] = {}


def _client(host: Any) -> Any:
    """The Fleet page's client for a host row (``name``, ``url``, ``token_env``), kept
    for the process: one HTTP connection per host, reused from render to render."""
    from . import views
    from .client import EngineClient

    key = (host.name, host.url, host.token_env)
    c = _CLIENTS.get(key)
    if c is None:
        c = _CLIENTS[key] = EngineClient.for_host(host, need_token=False, timeout_s=views.STATE_TIMEOUT_S, retries=0)
    return c


def _prometheus_figures(hosts: Sequence[Any], end: float, window_s: float) -> dict[str, tuple[float | None, float | None]]:
    """Output tokens/s over the window and the worst 10 s-window TTFT P99 (ms) of each
    second in it, for every host, from the Prometheus server in force (two queries)."""
    import os

    from .promsource import ENV_URL, PrometheusSource, _num, instance_of, queries

    by_instance = {instance_of(h.url): h.name for h in hosts}
    src = PrometheusSource(os.environ[ENV_URL])
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


def _figures_host_by_host(backend: Any, hosts: Sequence[Any], since: float,
                          until: float) -> dict[str, tuple[float | None, float | None]]:
    """The same figures from any backend's ``stored_samples``, one host at a time (in parallel)."""
    from concurrent.futures import ThreadPoolExecutor

    from . import views

    def one(h: Any) -> tuple[float | None, float | None]:
        try:
            recent = views.samples_frame(backend.stored_samples(h.name, since=since, until=until))
        except Exception:
            return None, None
        if recent.empty:
            return None, None
        ttft = recent["ttft_p99_ms"].dropna()
        return float(recent["output_tokens_per_s"].mean()), (float(ttft.max()) if not ttft.empty else None)

    with ThreadPoolExecutor(max_workers=min(STATE_WORKERS, len(hosts)), thread_name_prefix="fleet-samples") as pool:
        return dict(zip((h.name for h in hosts), pool.map(one, hosts)))

