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
