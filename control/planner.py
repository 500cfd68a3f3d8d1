"""Capacity planner: the queueing latency model of Kong et al. (arXiv 2605.15051).

The outer view of speculative decoding under load. For a fixed draft length K the mean
request latency grows with the request rate as

    L(lambda) = C1 / (1 - lambda * C2)

with ``C1`` the mean latency at zero load (seconds) and ``C2`` the service time a request
costs the engine (seconds per request); ``1 / C2`` is the saturation rate (requests/s) at
which latency diverges. The effective batch follows from Little's law, ``B = lambda * L``
(requests in flight). Speculation lowers ``C1`` (fewer sequential steps per request) but
usually raises ``C2`` (drafts and verification cost compute), so the latency-optimal K at
low load is not the one at high load; the planner draws both.

Where the numbers come from: the collector stores per-second samples per host
(finished requests, end-to-end latency, K in force). :func:`points_from_samples` cuts
them into windows of constant K and turns each window into one measured point
``(request rate, mean latency)``; :func:`fit_latency_model` fits ``C1, C2`` to the points
of one K by least squares on latency (seconds); :func:`fit_per_k` does it for every K.
The dashboard's Planner page draws :meth:`LatencyFit.latency_s` against the request rate
with the measured points on top and answers what-if questions with :func:`what_if`.

Everything here is pure (numpy only) and unit-tested in ``tests/test_planner.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "PlannerError",
    "MeasuredPoint",
    "LatencyFit",
    "fit_latency_model",
    "fit_per_k",
    "points_from_samples",
    "what_if",
    "curve",
]


class PlannerError(ValueError):
    """Not enough (or unusable) measurements to fit the model; the message says why."""


@dataclass(frozen=True)
class MeasuredPoint:
    """One window of stored samples at a constant K.

    Attributes:
        k: draft length K in force for the whole window (tokens; 0 = no speculation).
        rate_rps: finished requests per second over the window (requests/s).
        latency_s: mean end-to-end request latency over the window (seconds).
        t_start: unix time of the window's first sample (seconds).
        n_requests: requests finished in the window.
    """

    k: int
    rate_rps: float
    latency_s: float
    t_start: float = 0.0
    n_requests: int = 0


@dataclass(frozen=True)
class LatencyFit:
    """``L = C1 / (1 - lambda * C2)`` fitted for one K.

    Attributes:
        k: draft length K (tokens).
        c1_s: mean latency at zero load (seconds).
        c2_s: service time per request (seconds/request); 0 when the load measured so
            far shows no queueing at all.
        n_points: measured points used.
        rmse_s: root-mean-square error of the fit on latency (seconds).
        max_rate_rps: highest measured request rate (requests/s): the fit is an
            extrapolation beyond it.
    """

    k: int
    c1_s: float
    c2_s: float
    n_points: int
    rmse_s: float
    max_rate_rps: float
    points: tuple[MeasuredPoint, ...] = field(default=(), repr=False, compare=False)

    @property
    def saturation_rps(self) -> float:
        """Request rate at which latency diverges, ``1 / C2`` (requests/s; inf if C2 = 0)."""
        return math.inf if self.c2_s <= 0 else 1.0 / self.c2_s

    def latency_s(self, rate_rps: float | np.ndarray) -> float | np.ndarray:
        """Predicted mean latency (seconds) at ``rate_rps`` (requests/s); inf at or past
        saturation."""
        lam = np.asarray(rate_rps, dtype=float)
        denom = 1.0 - lam * self.c2_s
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.where(denom > 0, self.c1_s / np.where(denom > 0, denom, 1.0), np.inf)
        return float(out) if out.ndim == 0 else out

    def effective_batch(self, rate_rps: float | np.ndarray) -> float | np.ndarray:
        """Requests in flight by Little's law, ``B = lambda * L`` (requests)."""
        lam = np.asarray(rate_rps, dtype=float)
        out = lam * np.asarray(self.latency_s(lam))
        return float(out) if out.ndim == 0 else out

    def utilisation(self, rate_rps: float) -> float:
        """Load factor ``lambda * C2`` (fraction 0..1 of the saturation rate)."""
        return float(rate_rps) * self.c2_s

    def max_rate_for_latency(self, latency_slo_s: float) -> float:
        """Highest request rate (requests/s) whose predicted mean latency stays within
        ``latency_slo_s`` seconds: ``(1 - C1/L) / C2``; 0 if even zero load misses it."""
        if latency_slo_s <= self.c1_s:
            return 0.0
        if self.c2_s <= 0:
            return math.inf
        return (1.0 - self.c1_s / latency_slo_s) / self.c2_s

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for tables: K, C1 (s), C2 (s), saturation (requests/s), points, RMSE (s)."""
        return {
            "k": self.k,
            "c1_s": self.c1_s,
            "c2_s": self.c2_s,
            "saturation_rps": self.saturation_rps,
            "n_points": self.n_points,
            "rmse_s": self.rmse_s,
            "max_rate_rps": self.max_rate_rps,
        }


def _best_c1(lam: np.ndarray, lat: np.ndarray, c2: float) -> tuple[float, float]:
    """For a fixed C2, the least-squares C1 (closed form) and the sum of squared errors."""
    g = 1.0 / (1.0 - lam * c2)
    c1 = float(np.dot(lat, g) / np.dot(g, g))
    c1 = max(c1, 1e-12)
    sse = float(np.sum((lat - c1 * g) ** 2))
    return c1, sse


def fit_latency_model(
    rates_rps: Sequence[float],
    latencies_s: Sequence[float],
    k: int = 0,
    min_points: int = 3,
    min_rate_spread: float = 0.2,
) -> LatencyFit:
    """Fit ``L = C1 / (1 - lambda * C2)`` to measured (request rate, mean latency) pairs.

    Least squares on latency (seconds) with ``C1 > 0`` and ``0 <= C2 < 1 / max(lambda)``
    (every measured point lies below saturation). For a fixed ``C2`` the best ``C1`` is
    closed-form, so the fit is a one-dimensional search over ``C2``: a grid followed by
    golden-section refinement. No SciPy needed, and no starting guess that can diverge.

    Args:
        rates_rps: request rates (requests/s), one per measured point.
        latencies_s: mean latencies (seconds) at those rates.
        k: the draft length the points were measured at (tokens), carried into the fit.
        min_points: fewest points accepted.
        min_rate_spread: the rates must span at least this fraction of the largest one
            ((max - min) / max); with a single load level C2 is not identifiable.
    Returns:
        The :class:`LatencyFit`.
    Raises:
        PlannerError: too few points, non-positive latencies, or too little spread in rate.
    """
    lam = np.asarray(rates_rps, dtype=float)
    lat = np.asarray(latencies_s, dtype=float)
    if lam.shape != lat.shape:
        raise PlannerError("rates and latencies differ in length")
    ok = np.isfinite(lam) & np.isfinite(lat) & (lam >= 0) & (lat > 0)
    lam, lat = lam[ok], lat[ok]
    if lam.size < min_points:
        raise PlannerError(f"K={k}: {lam.size} measured point(s), need at least {min_points}")
    lam_max = float(lam.max())
    if lam_max <= 0 or (lam_max - float(lam.min())) / lam_max < min_rate_spread:
        raise PlannerError(
            f"K={k}: the measured request rates ({lam.min():.3g}..{lam_max:.3g} requests/s) do not vary enough "
            "to separate zero-load latency from queueing; measure at more load levels"
        )
    hi = (1.0 - 1e-6) / lam_max
    grid = np.linspace(0.0, hi, 512)
    sses = np.array([_best_c1(lam, lat, c2)[1] for c2 in grid])
    i = int(np.argmin(sses))
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
    phi = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = b - phi * (b - a), a + phi * (b - a)
    f1, f2 = _best_c1(lam, lat, x1)[1], _best_c1(lam, lat, x2)[1]
    for _ in range(60):
        if f1 < f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - phi * (b - a)
            f1 = _best_c1(lam, lat, x1)[1]
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + phi * (b - a)
            f2 = _best_c1(lam, lat, x2)[1]
    candidates = [(sses[i], grid[i]), (f1, x1), (f2, x2)]
    _, c2 = min(candidates)
    c1, sse = _best_c1(lam, lat, float(c2))
    return LatencyFit(
        k=int(k),
        c1_s=c1,
        c2_s=float(c2),
        n_points=int(lam.size),
        rmse_s=math.sqrt(sse / lam.size),
        max_rate_rps=lam_max,
    )


def fit_per_k(points: Iterable[MeasuredPoint], **kwargs: Any) -> tuple[dict[int, LatencyFit], dict[int, str]]:
    """Fit the model separately for each K.

    Args:
        points: measured points (any order, any mix of K).
        **kwargs: passed to :func:`fit_latency_model`.
    Returns:
        ``(fits, problems)``: fits by K, and for each K that could not be fitted the reason.
    """
    by_k: dict[int, list[MeasuredPoint]] = {}
    for p in points:
        by_k.setdefault(int(p.k), []).append(p)
    fits: dict[int, LatencyFit] = {}
    problems: dict[int, str] = {}
    for k in sorted(by_k):
        pts = by_k[k]
        try:
            fit = fit_latency_model([p.rate_rps for p in pts], [p.latency_s for p in pts], k=k, **kwargs)
        except PlannerError as exc:
            problems[k] = str(exc)
            continue
        fits[k] = LatencyFit(**{**fit.__dict__, "points": tuple(pts)})
    return fits, problems


def _get(sample: Any, key: str) -> Any:
    if isinstance(sample, Mapping):
        return sample.get(key)
    return getattr(sample, key, None)


def _latency_ms(sample: Any) -> float | None:
    """Mean E2E latency of a sample (ms): ``e2e_ms_mean`` when stored, else the window P50."""
    for key in ("e2e_ms_mean", "e2e_mean_ms"):
        v = _get(sample, key)
        if v is not None:
            return float(v)
    v = _get(sample, "e2e_ms")
    if isinstance(v, Mapping):
        v = v.get("mean", v.get("p50"))
    if v is None:
        v = _get(sample, "e2e_p50_ms")
    if v is None:
        v = _get(sample, "e2e_ms_p50")
    return None if v is None else float(v)


def _finished(sample: Any) -> float:
    for key in ("requests_finished", "requests_per_s", "request_rate_rps"):
        v = _get(sample, key)
        if v is not None:
            return float(v)
    return 0.0


def points_from_samples(
    samples: Iterable[Any],
    window_s: float = 60.0,
    min_requests: int = 3,
    min_k_share: float = 0.8,
) -> list[MeasuredPoint]:
    """Cut stored samples into windows and turn each into a measured point.

    A sample is a mapping (or object) with ``t`` (unix seconds), ``k`` (K in force,
    tokens), finished requests in its interval (``requests_finished``, or a rate
    ``requests_per_s``) and an E2E latency (``e2e_ms_mean``, else ``e2e_ms`` as a
    number or ``{"p50": ...}``, else ``e2e_p50_ms``; milliseconds). Where only the
    median is stored it stands in for the mean (the model is then fitted on medians). Samples may be 1 s or
    downsampled (``interval_s`` per sample; default: the gap to the next sample,
    at most 1 h).

    Windows are consecutive ``window_s``-second spans; a window becomes a point when at
    least ``min_k_share`` of its samples ran at the same K and at least ``min_requests``
    requests finished in it. The rate is requests finished / seconds covered (requests/s)
    and the latency the request-weighted mean of the samples' latencies (seconds).

    Returns:
        Points, oldest first.
    """
    rows = []
    for s in samples:
        t = _get(s, "t")
        if t is None:
            continue
        t = t.timestamp() if hasattr(t, "timestamp") else float(t)
        rows.append((t, s))
    rows.sort(key=lambda r: r[0])
    if not rows:
        return []
    points: list[MeasuredPoint] = []
    bucket: list[tuple[float, Any, float]] = []
    bucket_start = rows[0][0]

    def close(items: list[tuple[float, Any, float]], start: float) -> None:
        if not items:
            return
        ks = [(_get(s, "k")) for _, s, _ in items]
        ks = [int(k) for k in ks if k is not None]
        if not ks:
            return
        k_mode = max(set(ks), key=ks.count)
        if ks.count(k_mode) < min_k_share * len(items):
            return
        covered = 0.0
        n_req = 0.0
        lat_weighted = 0.0
        lat_weight = 0.0
        for _, s, dt in items:
            k = _get(s, "k")
            if k is None or int(k) != k_mode:
                continue
            covered += dt
            n = _finished(s) * (dt if _get(s, "requests_finished") is None else 1.0)
            n_req += n
            lat = _latency_ms(s)
            if lat is not None and n > 0:
                lat_weighted += lat * n
                lat_weight += n
        if covered <= 0 or n_req < min_requests or lat_weight <= 0:
            return
        points.append(
            MeasuredPoint(
                k=k_mode,
                rate_rps=n_req / covered,
                latency_s=lat_weighted / lat_weight / 1000.0,
                t_start=start,
                n_requests=int(round(n_req)),
            )
        )

    for i, (t, s) in enumerate(rows):
        interval = _get(s, "interval_s")
        if interval is None:
            nxt = rows[i + 1][0] if i + 1 < len(rows) else t + 1.0
            interval = min(max(nxt - t, 1.0), 3600.0)
        if t >= bucket_start + window_s:
            close(bucket, bucket_start)
            bucket = []
            bucket_start = t
        bucket.append((t, s, float(interval)))
    close(bucket, bucket_start)
    return points


def curve(fit: LatencyFit, rate_max_rps: float, n: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Rates (requests/s) and predicted mean latencies (seconds) for drawing, from 0 to
    ``rate_max_rps`` or just under saturation, whichever is lower."""
    top = min(rate_max_rps, 0.98 * fit.saturation_rps)
    rates = np.linspace(0.0, max(top, 1e-9), n)
    return rates, np.asarray(fit.latency_s(rates))


def what_if(
    fits: Mapping[int, LatencyFit],
    rate_rps: float,
    latency_slo_s: float | None = None,
) -> list[dict[str, Any]]:
    """Predictions for every fitted K at one request rate.

    Args:
        fits: fits by K (from :func:`fit_per_k`).
        rate_rps: the request rate asked about (requests/s).
        latency_slo_s: optional mean-latency target (seconds).
    Returns:
        One row per K, sorted by K: ``k``, ``latency_s`` (predicted mean, inf when
        saturated), ``effective_batch`` (requests in flight), ``utilisation`` (0..1, or
        above 1 when saturated), ``saturation_rps``, ``max_rate_at_slo_rps`` (when a target
        is given), ``meets_slo``, ``best`` (lowest predicted latency among the rows).
    """
    rows = []
    for k in sorted(fits):
        f = fits[k]
        lat = float(f.latency_s(rate_rps))
        row = {
            "k": k,
            "latency_s": lat,
            "effective_batch": float(f.effective_batch(rate_rps)) if math.isfinite(lat) else math.inf,
            "utilisation": f.utilisation(rate_rps),
            "saturation_rps": f.saturation_rps,
            "extrapolated": rate_rps > f.max_rate_rps,
        }
        if latency_slo_s is not None:
            row["max_rate_at_slo_rps"] = f.max_rate_for_latency(latency_slo_s)
            row["meets_slo"] = lat <= latency_slo_s
        rows.append(row)
    finite = [r["latency_s"] for r in rows if math.isfinite(r["latency_s"])]
    best = min(finite) if finite else None
    for r in rows:
        r["best"] = best is not None and r["latency_s"] == best
    return rows
