"""Capacity planner: mean latency against request rate, from what the engine measures.

Two models, one answer:

1. **The engine model** (the answer). The engine host's controller measures, online, the
   step time ``T(B, K)`` of a decode step with ``B`` running requests at draft length
   ``K`` (s) and the expected tokens per request per verification step ``E(K)``
   (Leviathan et al., arXiv 2211.17192; SmartSpec, arXiv 2406.14066); ``/control/state``
   reports both (``controller.step_time_ms_by_batch``, ``controller.expected_tokens_per_step``).
   A request that generates ``n`` output tokens needs ``n / E(K)`` steps, each of
   ``T(B, K)`` seconds, so its service demand per output token at batch ``B`` is
   ``T(B, K) / E(K)`` and its mean latency is

       L = t_pre + n * T(B, K) / E(K)                          (1)

   with ``t_pre`` the prefill time (s, the measured TTFT at low load). Little's law ties
   the batch to the request rate ``lambda`` (requests/s): ``B = lambda * L`` (requests in
   flight). (1) with ``B = lambda * L`` is a fixed point in ``L``; it is solved by
   walking ``B`` instead: for every batch size ``B`` (0 < B <= max_num_seqs), (1) gives
   ``L(B)`` and Little's law the rate that sustains it, ``lambda(B) = B / L(B)``. The curve
   ``(lambda(B), L(B))`` is latency against rate, without a prior sweep of rates. When
   ``T`` is linear in ``B``, ``T = a + b * B``, this is exactly Kong et al.'s form
   (arXiv 2605.15051), ``L = C1 / (1 - lambda * C2)`` with ``C1 = t_pre + n * a / E(K)``
   and ``C2 = n * b / E(K)``; the measured ``T`` need not be linear. The saturation rate
   is the largest ``lambda(B)`` with ``B`` within the running-sequence cap (requests
   beyond it queue without bound in this mean-value model): ``min(1/C2, lambda(cap))``
   for a linear ``T``. Adaptive mode takes, at every ``B``, the K the controller picks:
   the argmax of goodput ``B * E(K) / T(B, K)``, i.e. the argmin of ``T / E``, with K > 0
   only where it beats K = 0 by the configured margin.

   Limits of (1): prefill steps that share decode steps under load and queueing
   variance are not in it (a mean-value model); the fitted check below catches both.

2. **The fitted check.** Stored per-second samples are cut into windows of constant K
   (:func:`points_from_samples`); each window is a measured point (request rate, mean
   latency). Kong's ``L = C1 / (1 - lambda * C2)`` is fitted per K
   (:func:`fit_latency_model`). A fit whose relative RMSE is large or whose ``C2`` is not
   positive is "not enough data", with what to measure, never an answer.

:func:`plan` returns everything the Planner page shows (:class:`PlannerReport`); answers
at rates beyond the measured ones, or at batch sizes beyond the measured ones, are
marked as extrapolation. Everything here is pure (numpy only) and unit-tested in
``tests/test_planner.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "PlannerError",
    "SAMPLE_COLUMNS",
    "EngineModel",
    "Workload",
    "Curve",
    "FitCheck",
    "WhatIfRow",
    "PlannerReport",
    "engine_model_from_state",
    "workload_from_samples",
    "engine_curve",
    "check_fits",
    "plan",
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


# --------------------------------------------------------------------------- the engine model

#: Sample fields :func:`plan` reads (for a store query restricted to columns).
SAMPLE_COLUMNS = (
    "k",
    "e2e_p50_ms",
    "output_tokens",
    "user_output_tokens",
    "ttft_p50_ms",
    "waiting",
    "running",
    "max_num_seqs",
)
#: Decode request-steps a draft position needs before its acceptance counts as measured.
MIN_MEASURED_REQUEST_STEPS = 16
#: A fit whose RMSE exceeds this fraction of the mean measured latency is not an answer.
MAX_RELATIVE_RMSE = 0.25
#: Output tokens per request assumed when the samples do not tell.
DEFAULT_OUTPUT_TOKENS = 128.0
BENCH_HINT = "python -m bench run --url URL --workload chat --mode fixed:{k} --rate R --duration 60"


@dataclass(frozen=True)
class EngineModel:
    """What the engine host measures, as the planner uses it (from ``/control/state``).

    Attributes:
        batch_grid: batch sizes B (requests) at which T is tabulated, increasing.
        step_time_s: ``step_time_s[K][i]`` = T(batch_grid[i], K) (seconds).
        expected_tokens: E(K), tokens per request per verification step (>= 1).
        measured_k: depths whose draft positions 1..K have been measured (K = 0 always).
        unmeasured: K -> why it is not (positions never measured).
        measured_batch: ``(smallest, largest)`` decode batch sizes whose step times were
            measured (requests); beyond them T is extrapolated.
        max_num_seqs: cap on running requests in force (requests), or None when unknown.
        mode: speculation mode in force (``off``, ``fixed``, ``adaptive``...).
        k_fixed: the configured K of fixed mode (tokens).
        k_bounds: ``(k_min, k_max)`` the adaptive controller may choose from (tokens).
        margin: fraction by which a K > 0 must beat K = 0's goodput in adaptive mode (0..1).
    """

    batch_grid: tuple[int, ...]
    step_time_s: dict[int, tuple[float, ...]]
    expected_tokens: dict[int, float]
    measured_k: tuple[int, ...]
    unmeasured: dict[int, str]
    measured_batch: tuple[int, int]
    max_num_seqs: int | None
    mode: str | None
    k_fixed: int | None
    k_bounds: tuple[int, int]
    margin: float

    def step_time(self, k: int, batch: np.ndarray) -> np.ndarray:
        """T(B, K) in seconds at batch sizes ``batch`` (requests, may be fractional):
        linear between tabulated sizes, T(1) below one request, linear extrapolation past
        the last size."""
        b = np.maximum(np.asarray(batch, dtype=float), 1.0)
        grid = np.asarray(self.batch_grid, dtype=float)
        t = np.asarray(self.step_time_s[k], dtype=float)
        out = np.interp(b, grid, t)
        if grid.size >= 2:
            slope = (t[-1] - t[-2]) / (grid[-1] - grid[-2])
            out = np.where(b > grid[-1], t[-1] + slope * (b - grid[-1]), out)
        return out


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def engine_model_from_state(state: Mapping[str, Any] | None) -> EngineModel:
    """Read the engine model from an engine host's ``/control/state`` document.

    Args:
        state: the state JSON (``controller``, ``config``, ``batch``, ``limits``,
            ``speculation`` sections).
    Returns:
        The :class:`EngineModel`.
    Raises:
        PlannerError: the host gave no state, an engine host too old to tabulate T(B, K),
            or no decode step measured yet; the message says what to do.
    """
    if not state:
        raise PlannerError("the engine host did not answer: the engine model needs its live state (is it up?)")
    ctl = state.get("controller") or {}
    table = ctl.get("step_time_ms_by_batch")
    if not table:
        raise PlannerError(
            "this engine host does not report T(B, K) by batch size (older SpecPilot engine host); "
            "update it to get predictions from what it measures"
        )
    measured_batch = ctl.get("step_time_measured_batch")
    if not measured_batch:
        raise PlannerError("the engine has not timed a decode step yet: serve some traffic (any K) and come back")
    rows = sorted(((int(b), [float(x) / 1000.0 for x in ts]) for b, ts in table.items()), key=lambda r: r[0])
    n_k = min(len(ts) for _, ts in rows)
    e_raw = ctl.get("expected_tokens_per_step") or {}
    expected = {}
    for k in range(n_k):
        e = _num(e_raw.get(str(k), e_raw.get(k)))
        expected[k] = max(e if e is not None else 1.0, 1.0) if k else 1.0
    counts = list(ctl.get("acceptance_measured_request_steps") or [])
    measured, unmeasured = [0], {}
    for k in range(1, n_k):
        missing = [i + 1 for i in range(k) if i >= len(counts) or counts[i] < MIN_MEASURED_REQUEST_STEPS]
        if missing:
            where = f"position {missing[0]}" if len(missing) == 1 else f"positions {missing[0]}-{missing[-1]}"
            unmeasured[k] = (
                f"acceptance at draft {where} not measured yet: serve traffic at K={k} "
                f"(config apply --mode fixed --k {k}) or in adaptive mode, which explores"
            )
        else:
            measured.append(k)
    cfg = state.get("config") or {}
    spec_cfg = cfg.get("speculation") or {}
    spec = state.get("speculation") or {}
    batch = state.get("batch") or {}
    limits = state.get("limits") or {}
    cap = batch.get("max_num_seqs") or (cfg.get("batch") or {}).get("max_num_seqs") or limits.get("max_num_seqs")
    bounds = ctl.get("k_bounds") or [
        spec.get("k_min") or 0,
        spec.get("k_max") if spec.get("k_max") is not None else n_k - 1,
    ]
    lo, hi = int(bounds[0] or 0), min(int(bounds[1] if bounds[1] is not None else n_k - 1), n_k - 1)
    return EngineModel(
        batch_grid=tuple(b for b, _ in rows),
        step_time_s={k: tuple(ts[k] for _, ts in rows) for k in range(n_k)},
        expected_tokens=expected,
        measured_k=tuple(measured),
        unmeasured=unmeasured,
        measured_batch=(int(measured_batch[0]), int(measured_batch[1])),
        max_num_seqs=int(cap) if cap else None,
        mode=spec.get("mode") or spec_cfg.get("mode"),
        k_fixed=spec_cfg.get("k", spec.get("k")),
        k_bounds=(lo, max(lo, hi)),
        margin=float(((spec_cfg.get("adaptive") or {}).get("margin")) or 0.0),
    )


@dataclass(frozen=True)
class Workload:
    """The requests the prediction is for.

    Attributes:
        output_tokens: mean output tokens per request (tokens).
        prefill_s: time to the first token at low load (seconds), the ``t_pre`` of (1).
        max_rate_rps: highest request rate measured over a window (requests/s); 0 when none.
        notes: where each figure comes from (measured, assumed, given).
    """

    output_tokens: float
    prefill_s: float
    max_rate_rps: float
    notes: tuple[str, ...] = ()


def workload_from_samples(
    samples: Sequence[Any], window_s: float = 60.0, output_tokens: float | None = None, prefill_s: float | None = None
) -> Workload:
    """Mean output tokens per request, prefill time and the highest measured request rate
    from stored samples (fields as :func:`points_from_samples`, plus ``output_tokens`` /
    ``user_output_tokens`` (tokens), ``ttft_p50_ms`` (ms) and ``waiting`` (requests)).

    Args:
        output_tokens: use this instead of the measured mean (tokens per request).
        prefill_s: use this instead of the measured TTFT (seconds).
    Raises:
        PlannerError: a given value is not positive (output tokens) or negative (prefill).
    """
    notes = []
    if output_tokens is not None and not (output_tokens > 0 and math.isfinite(output_tokens)):
        raise PlannerError(f"output tokens per request must be a positive number, got {output_tokens!r}")
    if prefill_s is not None and not (prefill_s >= 0 and math.isfinite(prefill_s)):
        raise PlannerError(f"prefill time must be 0 s or more, got {prefill_s!r}")
    toks = reqs = 0.0
    ttfts = []
    for s in samples:
        n = _num(_get(s, "requests_finished"))
        if n is None:
            rps = _num(_get(s, "requests_per_s"))
            n = None if rps is None else rps * (_num(_get(s, "interval_s")) or 1.0)
        tok = _num(_get(s, "user_output_tokens"))
        tok = tok if tok is not None else _num(_get(s, "output_tokens"))
        if n and n > 0 and tok is not None:
            toks += tok
            reqs += n
        ttft = _num(_get(s, "ttft_p50_ms"))
        if ttft is not None and (_num(_get(s, "waiting")) or 0.0) <= 0.0 and n:
            ttfts.append(ttft)
    if output_tokens is None:
        if reqs > 0 and toks > 0:
            output_tokens = toks / reqs
            notes.append(f"{output_tokens:.0f} output tokens per request: measured ({reqs:.0f} requests)")
        else:
            output_tokens = DEFAULT_OUTPUT_TOKENS
            notes.append(f"{output_tokens:.0f} output tokens per request: assumed (no finished requests stored)")
    else:
        notes.append(f"{output_tokens:g} output tokens per request: given")
    if prefill_s is None:
        if ttfts:
            prefill_s = float(np.median(ttfts)) / 1000.0
            notes.append(f"prefill {prefill_s * 1000:.0f} ms: median TTFT of samples with no queue")
        else:
            prefill_s = 0.0
            notes.append("prefill 0 ms: assumed (no TTFT stored)")
    else:
        notes.append(f"prefill {prefill_s * 1000:g} ms: given")
    windows = points_from_samples(samples, window_s=window_s, min_requests=1, min_k_share=0.0)
    max_rate = max((p.rate_rps for p in windows), default=0.0)
    return Workload(
        output_tokens=float(output_tokens), prefill_s=float(prefill_s), max_rate_rps=float(max_rate), notes=tuple(notes)
    )


@dataclass(frozen=True)
class Curve:
    """Predicted mean latency against request rate for one K (or adaptive mode), from the
    engine model: points ``(rate_rps[i], latency_s[i])`` at batch ``batch[i]``.

    Attributes:
        label: ``"K=2"`` or ``"adaptive"``.
        k: the draft length (tokens); None for adaptive.
        batch: effective batch B = lambda * L (requests), increasing.
        rate_rps: request rate (requests/s), non-decreasing.
        latency_s: predicted mean latency (seconds).
        k_used: K in use at each point (tokens; adaptive: the controller's pick).
        saturation_rps: highest sustainable request rate (requests/s).
        zero_load_latency_s: mean latency of a lone request (seconds), C1.
        measured_batch_max: largest measured batch size (requests): beyond it, extrapolation.
    """

    label: str
    k: int | None
    batch: np.ndarray = field(repr=False)
    rate_rps: np.ndarray = field(repr=False)
    latency_s: np.ndarray = field(repr=False)
    k_used: np.ndarray = field(repr=False)
    saturation_rps: float
    zero_load_latency_s: float
    measured_batch_max: int

    def at_rate(self, rate_rps: float) -> tuple[float, float, int | None]:
        """``(latency_s, batch, k_used)`` at ``rate_rps`` (requests/s); latency and batch
        are inf at or past saturation."""
        if rate_rps < 0 or not math.isfinite(rate_rps):
            raise PlannerError(f"request rate must be 0 or more, got {rate_rps!r}")
        if rate_rps > self.saturation_rps:
            return math.inf, math.inf, None
        i = int(np.searchsorted(self.rate_rps, rate_rps, side="left"))
        if i <= 0:
            return float(self.latency_s[0]), float(self.batch[0]), int(self.k_used[0])
        if i >= self.rate_rps.size:
            i = self.rate_rps.size - 1
        r0, r1 = self.rate_rps[i - 1], self.rate_rps[i]
        w = 0.0 if r1 <= r0 else (rate_rps - r0) / (r1 - r0)
        lat = float(self.latency_s[i - 1] + w * (self.latency_s[i] - self.latency_s[i - 1]))
        b = float(self.batch[i - 1] + w * (self.batch[i] - self.batch[i - 1]))
        return lat, b, int(self.k_used[i])

    def max_rate_for_latency(self, latency_slo_s: float) -> float:
        """Highest request rate (requests/s) whose predicted mean latency stays within
        ``latency_slo_s`` seconds; 0 when even a lone request misses it."""
        ok = self.latency_s <= latency_slo_s
        return float(self.rate_rps[ok].max()) if ok.any() else 0.0


def _batch_points(cap: float, n: int = 600) -> np.ndarray:
    """Batch sizes from nearly idle (0.01) to ``cap`` requests: geometric (fine at small B)
    and linear (fine near the cap)."""
    cap = max(cap, 1.0)
    return np.unique(np.concatenate([np.geomspace(0.01, cap, n), np.linspace(1.0, cap, n // 3), [cap]]))


def engine_curve(model: EngineModel, workload: Workload, k: int | None) -> Curve:
    """Solve ``L = t_pre + n * T(B, K) / E(K)`` with ``B = lambda * L`` (module docstring)
    for one K, or for adaptive mode (``k=None``: at each B the K of least ``T / E`` among
    the measured depths within the controller's bounds, K > 0 only past the margin).

    Returns:
        The :class:`Curve` up to saturation (B up to max_num_seqs, else the largest
        tabulated batch size).
    Raises:
        PlannerError: ``k`` is not a depth the engine has.
    """
    if k is not None and k not in model.step_time_s:
        raise PlannerError(f"K={k} is beyond the engine's K_max ({max(model.step_time_s)})")
    cap = float(model.max_num_seqs or model.batch_grid[-1])
    b = _batch_points(cap)
    n, t_pre = workload.output_tokens, workload.prefill_s
    if k is not None:
        per_token = model.step_time(k, b) / model.expected_tokens[k]
        k_used = np.full(b.size, k)
    else:
        lo, hi = model.k_bounds
        ks = [kk for kk in model.measured_k if lo <= kk <= hi] or [0]
        demand = np.vstack([model.step_time(kk, b) / model.expected_tokens[kk] for kk in ks])
        if 0 in ks and len(ks) > 1:  # speculation must beat K = 0 by the margin
            i0 = ks.index(0)
            spec = np.array([kk > 0 for kk in ks])
            beats = demand * (1.0 + model.margin) <= demand[i0]
            demand_eff = np.where(spec[:, None] & ~beats, np.inf, demand)
        else:
            demand_eff = demand
        best = np.argmin(demand_eff, axis=0)
        per_token = demand[best, np.arange(b.size)]
        k_used = np.asarray(ks)[best]
    latency = t_pre + n * per_token
    rate = b / latency
    # the system at rate lambda settles at the smallest B that sustains it: keep the
    # increasing envelope of lambda(B), up to its maximum (saturation)
    top = int(np.argmax(rate))
    keep = np.concatenate([[True], np.diff(np.maximum.accumulate(rate[: top + 1])) > 0])
    idx = np.flatnonzero(keep)
    rate0 = np.concatenate([[0.0], rate[idx]])
    lat0 = np.concatenate([[latency[0]], latency[idx]])
    b0 = np.concatenate([[0.0], b[idx]])
    k0 = np.concatenate([[k_used[0]], k_used[idx]])
    return Curve(
        label="adaptive" if k is None else f"K={k}",
        k=k,
        batch=b0,
        rate_rps=rate0,
        latency_s=lat0,
        k_used=k0,
        saturation_rps=float(rate[top]),
        zero_load_latency_s=float(latency[0]),
        measured_batch_max=model.measured_batch[1],
    )


# --------------------------------------------------------------------------- the fitted check


@dataclass(frozen=True)
class FitCheck:
    """Kong's fit for one K, judged.

    Attributes:
        k: draft length (tokens).
        ok: the fit is usable as a check (enough points, positive C2, small error).
        fit: the fit, when one could be made (shown only when ``ok``).
        reason: why it is not enough data (empty when ok).
        advice: what to measure to get there (empty when ok).
        relative_rmse: fit RMSE over the mean measured latency (fraction), when fitted.
        engine_model_error: relative RMS difference between the engine model's latency
            and the measured points of this K (fraction), when the engine model has K.
        n_points: measured points of this K.
    """

    k: int
    ok: bool
    fit: LatencyFit | None
    reason: str = ""
    advice: str = ""
    relative_rmse: float | None = None
    engine_model_error: float | None = None
    n_points: int = 0


def _advice(k: int, curve: Curve | None, max_rate: float) -> str:
    if curve is not None and math.isfinite(curve.saturation_rps) and curve.saturation_rps > 0:
        rates = ", ".join(f"{f * curve.saturation_rps:.2g}" for f in (0.3, 0.6, 0.85))
        where = f"at 3+ rates, e.g. {rates} requests/s (up to near the predicted saturation)"
    elif max_rate > 0:
        rates = ", ".join(f"{f * max_rate:.2g}" for f in (0.5, 1.0, 2.0))
        where = f"at 3+ rates, e.g. {rates} requests/s"
    else:
        where = "at 3+ rates"
    return f"run `{BENCH_HINT.format(k=k)}` {where}"


def check_fits(
    points: Sequence[MeasuredPoint],
    curves: Mapping[int, Curve] | None = None,
    max_relative_rmse: float = MAX_RELATIVE_RMSE,
    **fit_kwargs: Any,
) -> dict[int, FitCheck]:
    """Fit Kong's model per K and judge each fit.

    A fit is "not enough data" when it cannot be made (too few points, one load level),
    when ``C2 <= 0`` (no queueing measured: the saturation rate is unknown, not
    infinite), or when its RMSE exceeds ``max_relative_rmse`` of the mean measured
    latency. Where the engine model has the K, its relative error at the measured points
    is given too.

    Args:
        points: measured points (any K).
        curves: engine-model curves by K, for advice and the cross-check.
        max_relative_rmse: threshold on RMSE / mean latency (fraction).
    Returns:
        K -> :class:`FitCheck`.
    """
    curves = curves or {}
    by_k: dict[int, list[MeasuredPoint]] = {}
    for p in points:
        by_k.setdefault(int(p.k), []).append(p)
    out: dict[int, FitCheck] = {}
    for k in sorted(by_k):
        pts = by_k[k]
        lat = np.array([p.latency_s for p in pts])
        max_rate = max(p.rate_rps for p in pts)
        curve = curves.get(k)
        model_err = None
        if curve is not None:
            pred = np.array([curve.at_rate(p.rate_rps)[0] for p in pts])
            fin = np.isfinite(pred)
            if fin.any():
                model_err = float(np.sqrt(np.mean(((pred[fin] - lat[fin]) / lat[fin]) ** 2)))
        advice = _advice(k, curve, max_rate)
        try:
            fit = fit_latency_model([p.rate_rps for p in pts], lat.tolist(), k=k, **fit_kwargs)
        except PlannerError as exc:
            out[k] = FitCheck(
                k, False, None, reason=str(exc), advice=advice, engine_model_error=model_err, n_points=len(pts)
            )
            continue
        fit = LatencyFit(**{**fit.__dict__, "points": tuple(pts)})
        rel = fit.rmse_s / float(lat.mean())
        reason = ""
        if fit.c2_s <= 0:
            reason = (
                f"K={k}: C2 = 0 (no queueing in the measured rates up to {fit.max_rate_rps:.2g} requests/s), "
                "so the saturation rate is unknown, not infinite"
            )
        elif rel > max_relative_rmse:
            reason = (
                f"K={k}: the fit's error (RMSE {fit.rmse_s:.2f} s, {rel:.0%} of the mean latency) is above "
                f"{max_relative_rmse:.0%}"
            )
        out[k] = FitCheck(
            k,
            not reason,
            fit,
            reason=reason,
            advice="" if not reason else advice,
            relative_rmse=rel,
            engine_model_error=model_err,
            n_points=len(pts),
        )
    return out


# --------------------------------------------------------------------------- the report


@dataclass(frozen=True)
class WhatIfRow:
    """One answer to "what if requests arrive at rate lambda".

    Attributes:
        label: ``"K=2"``, ``"adaptive"``.
        source: ``"engine model"`` or ``"fitted check"``.
        k: draft length (tokens; None for adaptive).
        latency_s: predicted mean latency (seconds; inf when saturated).
        effective_batch: requests in flight, B = lambda * L (requests; inf when saturated).
        k_used: the K in use at that load (tokens; adaptive: the controller's pick).
        saturation_rps: highest sustainable rate (requests/s).
        extrapolated: the rate is beyond the measured rates, or the batch beyond the
            measured batch sizes.
        max_rate_at_slo_rps: highest rate within the latency target (requests/s), when one is given.
        meets_slo: latency within the target, when one is given.
        best: lowest predicted latency among the engine model's rows.
    """

    label: str
    source: str
    k: int | None
    latency_s: float
    effective_batch: float
    k_used: int | None
    saturation_rps: float
    extrapolated: bool
    max_rate_at_slo_rps: float | None = None
    meets_slo: bool | None = None
    best: bool = False


@dataclass(frozen=True)
class PlannerReport:
    """Everything the Planner page shows for one host.

    Attributes:
        engine_model: the engine's measured model, or None (then ``engine_problem`` says why).
        engine_problem: "not enough data" for the engine model: why and what to do.
        workload: output tokens, prefill and measured rate range used.
        curves: engine-model curves, by label (``"K=0"``, ``"K=2"``, ``"adaptive"``).
        default_label: the curve of the config in force (adaptive, or fixed K).
        unmeasured: K -> why the engine model does not draw it.
        checks: Kong's fitted check per K (:class:`FitCheck`).
        points: measured points (request rate, mean latency) per window of constant K.
        rate_rps: the what-if request rate (requests/s).
        latency_slo_s: the what-if latency target (seconds), or None.
        what_if: answers at ``rate_rps``, engine model first.
    """

    engine_model: EngineModel | None
    engine_problem: str | None
    workload: Workload
    curves: dict[str, Curve]
    default_label: str | None
    unmeasured: dict[int, str]
    checks: dict[int, FitCheck]
    points: tuple[MeasuredPoint, ...]
    rate_rps: float
    latency_slo_s: float | None
    what_if: tuple[WhatIfRow, ...]

    @property
    def answer(self) -> WhatIfRow | None:
        """The engine-model row of the config in force at ``rate_rps`` (None without a model)."""
        for r in self.what_if:
            if r.source == "engine model" and r.label == self.default_label:
                return r
        return None


def plan(
    samples: Iterable[Any],
    state: Mapping[str, Any] | None,
    *,
    window_s: float = 60.0,
    rate_rps: float | None = None,
    latency_slo_s: float | None = None,
    output_tokens: float | None = None,
    prefill_s: float | None = None,
    max_relative_rmse: float = MAX_RELATIVE_RMSE,
) -> PlannerReport:
    """The planner's whole answer for one host.

    Args:
        samples: stored samples of the host (fields :data:`SAMPLE_COLUMNS` plus ``t``,
            ``interval_s``, ``requests_finished`` / ``requests_per_s``, ``e2e_ms_mean``).
        state: the host's ``/control/state`` document, or None when it is down.
        window_s: seconds of samples per measured point.
        rate_rps: the what-if request rate (requests/s); default half the saturation of
            the config in force (or the highest measured rate).
        latency_slo_s: an optional mean-latency target (seconds).
        output_tokens, prefill_s: override the measured workload (tokens per request, s).
        max_relative_rmse: threshold of the fitted check (fraction).
    Returns:
        :class:`PlannerReport`.
    Raises:
        PlannerError: a what-if value is invalid (negative rate, non-positive target or
            output tokens, negative prefill).
    """
    if latency_slo_s is not None and not (latency_slo_s > 0 and math.isfinite(latency_slo_s)):
        raise PlannerError(f"the latency target must be a positive number of seconds, got {latency_slo_s!r}")
    if rate_rps is not None and not (rate_rps >= 0 and math.isfinite(rate_rps)):
        raise PlannerError(f"the request rate must be 0 or more requests/s, got {rate_rps!r}")
    samples = list(samples)
    workload = workload_from_samples(samples, window_s=window_s, output_tokens=output_tokens, prefill_s=prefill_s)
    points = tuple(points_from_samples(samples, window_s=window_s))
    model, problem = None, None
    curves: dict[str, Curve] = {}
    default = None
    try:
        model = engine_model_from_state(state)
    except PlannerError as exc:
        problem = str(exc)
    by_k: dict[int, Curve] = {}
    if model is not None:
        for k in model.measured_k:
            by_k[k] = curves[f"K={k}"] = engine_curve(model, workload, k)
        if len(model.step_time_s) > 1:
            curves["adaptive"] = engine_curve(model, workload, None)
        if model.mode == "adaptive":
            default = "adaptive"
        elif model.mode == "off":
            default = "K=0"
        elif model.mode == "fixed" and f"K={model.k_fixed}" in curves:
            default = f"K={model.k_fixed}"
    checks = check_fits(points, by_k, max_relative_rmse=max_relative_rmse)
    if rate_rps is None:
        ref = curves.get(default or "") or curves.get("K=0")
        rate_rps = round(0.5 * ref.saturation_rps, 3) if ref else round(workload.max_rate_rps, 3)
    rows: list[WhatIfRow] = []
    measured_rate = workload.max_rate_rps
    for label, c in curves.items():
        lat, b, k_used = c.at_rate(rate_rps)
        rows.append(
            WhatIfRow(
                label=label,
                source="engine model",
                k=c.k,
                latency_s=lat,
                effective_batch=b,
                k_used=k_used,
                saturation_rps=c.saturation_rps,
                extrapolated=rate_rps > measured_rate * 1.05 or b > c.measured_batch_max,
                max_rate_at_slo_rps=c.max_rate_for_latency(latency_slo_s) if latency_slo_s else None,
                meets_slo=(lat <= latency_slo_s) if latency_slo_s else None,
            )
        )
    for k, chk in checks.items():
        if not chk.ok or chk.fit is None:
            continue
        f = chk.fit
        lat = float(f.latency_s(rate_rps))
        rows.append(
            WhatIfRow(
                label=f"K={k}",
                source="fitted check",
                k=k,
                latency_s=lat,
                effective_batch=float(f.effective_batch(rate_rps)) if math.isfinite(lat) else math.inf,
                k_used=k,
                saturation_rps=f.saturation_rps,
                extrapolated=rate_rps > f.max_rate_rps * 1.05,
                max_rate_at_slo_rps=f.max_rate_for_latency(latency_slo_s) if latency_slo_s else None,
                meets_slo=(lat <= latency_slo_s) if latency_slo_s else None,
            )
        )
    finite = [r.latency_s for r in rows if r.source == "engine model" and math.isfinite(r.latency_s)]
    best = min(finite) if finite else None
    rows = [
        WhatIfRow(**{**r.__dict__, "best": r.source == "engine model" and best is not None and r.latency_s == best})
        for r in rows
    ]
    return PlannerReport(
        engine_model=model,
        engine_problem=problem,
        workload=workload,
        curves=curves,
        default_label=default,
        unmeasured=dict(model.unmeasured) if model else {},
        checks=checks,
        points=points,
        rate_rps=float(rate_rps),
        latency_slo_s=latency_slo_s,
        what_if=tuple(rows),
    )
