"""Metric samples in the store: writing, chart series, downsampling with retention, and
collection gaps.

Resolutions: 1 s rows (one per scrape) are kept for the last hour; 60 s roll-ups for
30 days; 3600 s roll-ups beyond, for a year by default (:class:`Retention`). Roll-ups are
made as soon as a minute (hour) is complete, so every resolution covers the recent past
too and a chart can use the coarsest one that gives it enough points.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence, cast

from sqlalchemy import CursorResult, delete, func, insert, select, update

from .models import CollectionGap, Host, MetricSample
from .sampling import rollup
from .store import Store, active_host

RESOLUTIONS = (1, 60, 3600)
COLUMNS = tuple(c.name for c in MetricSample.__table__.columns if c.name not in ("host_id",))
#: Columns a chart may ask for (numbers per time).
SERIES_COLUMNS = tuple(c for c in COLUMNS if c not in ("resolution_s", "t", "hist"))


@dataclass(frozen=True)
class Retention:
    """How long each resolution is kept (s)."""

    raw_s: float = 3600.0
    minute_s: float = 30 * 86400.0
    hour_s: float = 365 * 86400.0

    def for_resolution(self, resolution_s: int) -> float:
        return {1: self.raw_s, 60: self.minute_s, 3600: self.hour_s}[resolution_s]


def insert_samples(store: Store, host_id: int, rows: Sequence[dict[str, Any]]) -> None:
    """Write sample rows of one host (dicts with ``MetricSample`` columns) in one transaction."""
    if not rows:
        return
    with store.writer() as s:
        s.execute(insert(MetricSample), [{"host_id": host_id, **_clean(r)} for r in rows])


def _clean(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k in COLUMNS}


def _as_dict(row: Any) -> dict[str, Any]:
    d = dict(row._mapping)
    covered = d.get("covered_s")
    if "requests_finished" in d:
        d["requests_per_s"] = (d["requests_finished"] / covered) if covered else None
    return d


def choose_resolution(
    start: float, end: float, now: float | None = None, max_points: int = 20000, retention: Retention = Retention()
) -> int:
    """The finest resolution (s) still kept at ``start`` that gives at most ``max_points``
    points over ``[start, end)``."""
    now = time.time() if now is None else now
    for r in RESOLUTIONS:
        if start >= now - retention.for_resolution(r) - r and (end - start) / r <= max_points:
            return r
    return RESOLUTIONS[-1]


def series(
    store: Store,
    host: str,
    columns: Sequence[str],
    start: float,
    end: float | None = None,
    resolution_s: int | None = None,
    max_points: int = 20000,
) -> dict[str, Any]:
    """A chart series of one host: ``{"resolution_s": r, "t": [unix s...], col: [...]}``.

    Args:
        columns: sample columns (see :data:`SERIES_COLUMNS`: ``output_tokens_per_s``
            tokens/s, ``ttft_p99_ms`` ms, ``kv_cache_usage`` fraction 0..1 ...).
        start, end: unix s (end default now); resolution_s: 1, 60, 3600 or None for
            :func:`choose_resolution`.
    Raises:
        UnknownHost; ValueError: unknown column.
    """
    bad = [c for c in columns if c not in SERIES_COLUMNS]
    if bad:
        raise ValueError(f"unknown sample column(s) {bad}; known: {', '.join(SERIES_COLUMNS)}")
    end = time.time() if end is None else end
    res = resolution_s or choose_resolution(start, end, max_points=max_points)
    cols = [MetricSample.t] + [getattr(MetricSample, c) for c in columns]
    with store.reader() as s:
        h = active_host(s, host)
        rows = s.execute(
            select(*cols)
            .where(
                MetricSample.host_id == h.id,
                MetricSample.resolution_s == res,
                MetricSample.t >= math.floor(start),
                MetricSample.t < end,
            )
            .order_by(MetricSample.t)
        ).all()
    out: dict[str, Any] = {"resolution_s": res, "t": [r[0] for r in rows]}
    for i, c in enumerate(columns, start=1):
        out[c] = [r[i] for r in rows]
    return out


def samples(
    store: Store, host: str, start: float, end: float | None = None, resolution_s: int = 1
) -> list[dict[str, Any]]:
    """Full sample rows (dicts, oldest first, with ``requests_per_s`` added) of one host.

    Raises:
        UnknownHost.
    """
    end = time.time() if end is None else end
    with store.reader() as s:
        h = active_host(s, host)
        rows = s.execute(
            select(*[getattr(MetricSample, c) for c in COLUMNS])
            .where(
                MetricSample.host_id == h.id,
                MetricSample.resolution_s == resolution_s,
                MetricSample.t >= math.floor(start),
                MetricSample.t < end,
            )
            .order_by(MetricSample.t)
        ).all()
    return [_as_dict(r) for r in rows]


def rows_for_hosts(
    store: Store, host_ids: Iterable[int], start: float, end: float, resolution_s: int, columns: Sequence[str]
) -> list[dict[str, Any]]:
    """Sample rows (``host_id`` + ``columns``) of several hosts, for reports."""
    cols = [MetricSample.host_id, MetricSample.t] + [getattr(MetricSample, c) for c in columns]
    with store.reader() as s:
        rows = s.execute(
            select(*cols)
            .where(
                MetricSample.host_id.in_(list(host_ids)),
                MetricSample.resolution_s == resolution_s,
                MetricSample.t >= math.floor(start),
                MetricSample.t < end,
            )
            .order_by(MetricSample.host_id, MetricSample.t)
        ).all()
    return [dict(r._mapping) for r in rows]


def latest_sample(store: Store, host: str) -> dict[str, Any] | None:
    """The newest 1 s sample of a host (None when there is none)."""
    with store.reader() as s:
        h = active_host(s, host)
        row = s.execute(
            select(*[getattr(MetricSample, c) for c in COLUMNS])
            .where(MetricSample.host_id == h.id, MetricSample.resolution_s == 1)
            .order_by(MetricSample.t.desc())
            .limit(1)
        ).first()
    return _as_dict(row) if row else None


# --------------------------------------------------------------------------- downsampling


def _rollup_host(store: Store, host_id: int, src: int, dst: int, until: int, chunk_buckets: int = 1440) -> int:
    with store.reader() as s:
        done = s.scalar(
            select(func.max(MetricSample.t)).where(MetricSample.host_id == host_id, MetricSample.resolution_s == dst)
        )
        first = s.scalar(
            select(func.min(MetricSample.t)).where(MetricSample.host_id == host_id, MetricSample.resolution_s == src)
        )
    if first is None:
        return 0
    start = done + dst if done is not None else (first // dst) * dst
    start = max(start, (first // dst) * dst)
    made = 0
    while start < until:
        stop = min(until, start + chunk_buckets * dst)
        with store.writer() as s:
            rows = s.execute(
                select(*[getattr(MetricSample, c) for c in COLUMNS])
                .where(
                    MetricSample.host_id == host_id,
                    MetricSample.resolution_s == src,
                    MetricSample.t >= start,
                    MetricSample.t < stop,
                )
                .order_by(MetricSample.t)
            ).all()
            buckets: dict[int, list[dict[str, Any]]] = {}
            for r in rows:
                d = dict(r._mapping)
                buckets.setdefault((d["t"] // dst) * dst, []).append(d)
            out = [rollup(b, dst, t) for t, b in sorted(buckets.items())]
            if out:
                s.execute(insert(MetricSample), [{"host_id": host_id, **_clean(r)} for r in out if r])
            made += len(out)
        start = stop
    return made


def downsample(
    store: Store, now: float | None = None, retention: Retention = Retention(), grace_s: float = 5.0
) -> dict[str, int]:
    """Roll complete minutes (hours) up into 60 s (3600 s) rows, then delete rows past
    their retention. Idempotent; run it every minute or so.

    Args:
        now: unix s (default the clock); grace_s: a bucket counts as complete
            ``grace_s`` seconds after its end (the last scrape may still be on its way).
    Returns:
        ``{"rolled_60": n, "rolled_3600": n, "deleted": n}``.
    """
    now = time.time() if now is None else now
    with store.reader() as s:
        host_ids = list(s.scalars(select(Host.id)))
    stats = {"rolled_60": 0, "rolled_3600": 0, "deleted": 0}
    for hid in host_ids:
        for src, dst in ((1, 60), (60, 3600)):
            until = int((now - grace_s) // dst) * dst
            stats[f"rolled_{dst}"] += _rollup_host(store, hid, src, dst, until)
    with store.writer() as s:
        for r in RESOLUTIONS:
            stats["deleted"] += (
                cast(
                    CursorResult[Any],
                    s.execute(
                        delete(MetricSample).where(
                            MetricSample.resolution_s == r, MetricSample.t < now - retention.for_resolution(r)
                        )
                    ),
                ).rowcount
                or 0
            )
        s.execute(delete(CollectionGap).where(CollectionGap.ended_at < now - retention.hour_s))
    return stats


# --------------------------------------------------------------------------- gaps


def open_gap(store: Store, host_id: int, started_at: float, reason: str) -> int:
    """Record that a host stopped answering at ``started_at`` (unix s); returns the gap id.
    An already open gap of the host is kept (and its id returned)."""
    with store.writer() as s:
        existing = s.scalar(
            select(CollectionGap.id).where(CollectionGap.host_id == host_id, CollectionGap.ended_at.is_(None))
        )
        if existing is not None:
            return existing
        gap = CollectionGap(host_id=host_id, started_at=started_at, reason=reason)
        s.add(gap)
        s.flush()
        return gap.id


def close_gap(store: Store, host_id: int, ended_at: float) -> int:
    """End the host's open gap at ``ended_at`` (unix s); returns how many were closed."""
    with store.writer() as s:
        res = s.execute(
            update(CollectionGap)
            .where(CollectionGap.host_id == host_id, CollectionGap.ended_at.is_(None))
            .values(ended_at=ended_at)
        )
        return cast(CursorResult[Any], res).rowcount or 0


def gaps(store: Store, host: str, start: float = 0.0, end: float | None = None) -> list[CollectionGap]:
    """A host's collection gaps overlapping ``[start, end)`` (unix s), oldest first.

    Raises:
        UnknownHost.
    """
    end = time.time() if end is None else end
    with store.reader() as s:
        h = active_host(s, host)
        return list(
            s.scalars(
                select(CollectionGap)
                .where(
                    CollectionGap.host_id == h.id,
                    CollectionGap.started_at < end,
                    (CollectionGap.ended_at.is_(None)) | (CollectionGap.ended_at >= start),
                )
                .order_by(CollectionGap.started_at)
            )
        )
