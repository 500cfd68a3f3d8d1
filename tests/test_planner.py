"""Unit tests of the capacity planner (Kong et al. latency model, control/planner.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from control.planner import (
    LatencyFit,
    MeasuredPoint,
    PlannerError,
    curve,
    fit_latency_model,
    fit_per_k,
    points_from_samples,
    what_if,
)


def _model(c1: float, c2: float, rates: np.ndarray) -> np.ndarray:
    return c1 / (1.0 - rates * c2)


def test_fit_recovers_c1_c2_from_exact_points():
    rates = np.array([0.1, 0.5, 1.0, 2.0, 3.0, 3.5])
    lat = _model(0.8, 0.25, rates)
    fit = fit_latency_model(rates, lat, k=4)
    assert fit.k == 4
    assert fit.c1_s == pytest.approx(0.8, rel=1e-4)
    assert fit.c2_s == pytest.approx(0.25, rel=1e-4)
    assert fit.saturation_rps == pytest.approx(4.0, rel=1e-4)
    assert fit.rmse_s < 1e-6
    assert fit.max_rate_rps == pytest.approx(3.5)


def test_fit_with_noise_stays_close():
    rng = np.random.default_rng(7)
    rates = np.linspace(0.2, 3.2, 25)
    lat = _model(1.2, 0.28, rates) * (1.0 + rng.normal(0, 0.03, rates.size))
    fit = fit_latency_model(rates, lat)
    assert fit.c1_s == pytest.approx(1.2, rel=0.08)
    assert fit.saturation_rps == pytest.approx(1 / 0.28, rel=0.08)


def test_no_queueing_gives_c2_zero_and_infinite_saturation():
    rates = np.array([0.1, 0.2, 0.4, 0.8])
    fit = fit_latency_model(rates, np.full(4, 0.5))
    assert fit.c2_s == pytest.approx(0.0, abs=1e-9)
    assert math.isinf(fit.saturation_rps)
    assert fit.latency_s(100.0) == pytest.approx(0.5)


def test_prediction_little_law_and_saturation():
    fit = LatencyFit(k=2, c1_s=1.0, c2_s=0.5, n_points=3, rmse_s=0.0, max_rate_rps=1.0)
    assert fit.latency_s(0.0) == pytest.approx(1.0)
    assert fit.latency_s(1.0) == pytest.approx(2.0)
    assert fit.effective_batch(1.0) == pytest.approx(2.0)  # B = lambda * L
    assert math.isinf(fit.latency_s(2.0))
    assert math.isinf(fit.latency_s(3.0))
    assert fit.utilisation(1.0) == pytest.approx(0.5)
    assert fit.max_rate_for_latency(2.0) == pytest.approx(1.0)
    assert fit.max_rate_for_latency(0.5) == 0.0
    arr = fit.latency_s(np.array([0.0, 1.0, 2.5]))
    assert arr[0] == pytest.approx(1.0) and arr[1] == pytest.approx(2.0) and math.isinf(arr[2])


def test_refuses_too_few_points_and_a_single_load_level():
    with pytest.raises(PlannerError, match="need at least 3"):
        fit_latency_model([0.1, 0.2], [1.0, 1.1])
    with pytest.raises(PlannerError, match="do not vary enough"):
        fit_latency_model([1.0, 1.01, 0.99, 1.0], [1.0, 1.1, 1.0, 1.05])


def test_bad_values_are_dropped():
    rates = [0.1, 0.5, float("nan"), 1.0, -1.0, 2.0]
    lat = [0.81, 0.9, 1.0, 1.1, 1.0, 0.0]
    fit = fit_latency_model(rates, lat)
    assert fit.n_points == 3


def test_fit_per_k_separates_depths_and_reports_problems():
    pts = []
    for k, (c1, c2) in {0: (1.5, 0.2), 4: (0.9, 0.3)}.items():
        for lam in (0.2, 0.8, 1.5, 2.5, 3.0):
            pts.append(MeasuredPoint(k=k, rate_rps=lam, latency_s=float(_model(c1, c2, np.array(lam)))))
    pts.append(MeasuredPoint(k=8, rate_rps=1.0, latency_s=1.0))
    fits, problems = fit_per_k(pts)
    assert set(fits) == {0, 4}
    assert fits[0].c1_s == pytest.approx(1.5, rel=1e-3)
    assert fits[4].c2_s == pytest.approx(0.3, rel=1e-3)
    assert len(fits[4].points) == 5
    assert 8 in problems and "need at least" in problems[8]
    # Kong et al.: speculation wins at low load, loses near its (lower) saturation rate.
    rows = {r["k"]: r for r in what_if(fits, 0.2)}
    assert rows[4]["best"] and not rows[0]["best"]
    rows = {r["k"]: r for r in what_if(fits, 3.4, latency_slo_s=5.0)}
    assert math.isinf(rows[4]["latency_s"]) and rows[0]["best"]
    assert rows[0]["latency_s"] == pytest.approx(1.5 / (1 - 3.4 * 0.2), rel=1e-3)
    assert rows[0]["meets_slo"] is True and rows[4]["meets_slo"] is False
    assert rows[4]["max_rate_at_slo_rps"] == pytest.approx((1 - 0.9 / 5.0) / 0.3, rel=1e-3)
    assert rows[4]["extrapolated"] is True


def test_points_from_per_second_samples():
    samples = []
    t0 = 1_700_000_000
    # 120 s at K=0 with 1 request/s and 800 ms latency, then 120 s at K=4 with 2 requests/s, 500 ms.
    for i in range(120):
        samples.append({"t": t0 + i, "k": 0, "requests_finished": 1, "e2e_ms": {"p50": 800.0}})
    for i in range(120, 240):
        samples.append({"t": t0 + i, "k": 4, "requests_finished": 2, "e2e_ms": {"p50": 500.0}})
    pts = points_from_samples(samples, window_s=60)
    assert [p.k for p in pts] == [0, 0, 4, 4]
    assert pts[0].rate_rps == pytest.approx(1.0)
    assert pts[0].latency_s == pytest.approx(0.8)
    assert pts[2].rate_rps == pytest.approx(2.0)
    assert pts[2].n_requests == 120


def test_points_skip_idle_and_mixed_windows():
    t0 = 1_700_000_000
    idle = [{"t": t0 + i, "k": 2, "requests_finished": 0, "e2e_ms": None} for i in range(60)]
    mixed = [{"t": t0 + 60 + i, "k": i % 3, "requests_finished": 2, "e2e_ms_p50": 400.0} for i in range(60)]
    assert points_from_samples(idle + mixed, window_s=60) == []


def test_points_from_downsampled_rate_samples():
    t0 = 1_700_000_000
    samples = [{"t": t0 + 60 * i, "interval_s": 60, "k": 3, "requests_per_s": 0.5, "e2e_ms_mean": 700.0}
               for i in range(10)]
    pts = points_from_samples(samples, window_s=300)
    assert len(pts) == 2
    assert pts[0].rate_rps == pytest.approx(0.5)
    assert pts[0].latency_s == pytest.approx(0.7)


def test_curve_stops_before_saturation():
    fit = LatencyFit(k=1, c1_s=1.0, c2_s=0.5, n_points=3, rmse_s=0.0, max_rate_rps=1.0)
    rates, lat = curve(fit, 10.0, n=50)
    assert rates[-1] < 2.0 and np.all(np.isfinite(lat))
    assert lat[0] == pytest.approx(1.0)
