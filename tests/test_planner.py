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
    samples = [
        {"t": t0 + 60 * i, "interval_s": 60, "k": 3, "requests_per_s": 0.5, "e2e_ms_mean": 700.0} for i in range(10)
    ]
    pts = points_from_samples(samples, window_s=300)
    assert len(pts) == 2
    assert pts[0].rate_rps == pytest.approx(0.5)
    assert pts[0].latency_s == pytest.approx(0.7)


def test_curve_stops_before_saturation():
    fit = LatencyFit(k=1, c1_s=1.0, c2_s=0.5, n_points=3, rmse_s=0.0, max_rate_rps=1.0)
    rates, lat = curve(fit, 10.0, n=50)
    assert rates[-1] < 2.0 and np.all(np.isfinite(lat))
    assert lat[0] == pytest.approx(1.0)


# --------------------------------------------------------------------------- the engine model

from control.planner import (  # noqa: E402
    Workload,
    check_fits,
    engine_curve,
    engine_model_from_state,
    plan,
)

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def _state(
    t0_ms=20.0, t1_ms=2.0, accept=0.6, k_max=4, mode="adaptive", k=0, cap=16, measured_positions=None, margin=0.05
):
    """A /control/state document whose controller measured T(B, K) = t0 + t1 * B * (1 + K)
    (ms) and r_i = accept**i."""
    e = {str(kk): 1.0 + sum(accept**i for i in range(1, kk + 1)) for kk in range(k_max + 1)}
    table = {str(b): [t0_ms + t1_ms * b * (1 + kk) for kk in range(k_max + 1)] for b in GRID}
    n_meas = k_max if measured_positions is None else measured_positions
    return {
        "config": {
            "speculation": {"mode": mode, "k": k, "adaptive": {"margin": margin}},
            "batch": {"max_num_seqs": None},
        },
        "speculation": {"mode": mode, "k": k, "k_min": 0, "k_max": k_max},
        "batch": {"max_num_seqs": cap},
        "limits": {"max_num_seqs": cap},
        "controller": {
            "step_time_ms_by_batch": table,
            "expected_tokens_per_step": e,
            "acceptance_measured_request_steps": [500] * n_meas + [0] * (k_max - n_meas),
            "step_time_measured_batch": [1, 7],
            "k_bounds": [0, k_max],
        },
    }


def test_engine_curve_with_a_linear_step_time_is_kongs_closed_form():
    # L = t_pre + n T(B)/E with T = a + b B and B = lambda L gives L = C1 / (1 - lambda C2),
    # C1 = t_pre + n a / E, C2 = n b / E (module docstring)
    model = engine_model_from_state(_state(cap=10_000))
    wl = Workload(output_tokens=100.0, prefill_s=0.05, max_rate_rps=1.0)
    for k in (0, 2):
        e = model.expected_tokens[k]
        a, b = 0.020, 0.002 * (1 + k)
        c1, c2 = 0.05 + 100 * a / e, 100 * b / e
        curve = engine_curve(model, wl, k)
        # a lone request runs at batch 1: T(1) = a + b
        assert curve.zero_load_latency_s == pytest.approx(0.05 + 100 * (a + b) / e, rel=1e-3)
        for lam in (0.5 / c2, 0.7 / c2, 0.9 / c2):  # B >= 1 at these rates: the closed form holds
            lat, batch, _ = curve.at_rate(lam)
            assert lat == pytest.approx(c1 / (1 - lam * c2), rel=0.02)
            assert batch >= 1 and batch == pytest.approx(lam * lat, rel=0.02)  # Little's law
        assert curve.saturation_rps == pytest.approx(1 / c2, rel=0.05)  # the cap is far away


def test_the_running_cap_bounds_saturation_and_nothing_is_predicted_past_it():
    # The case: a host that serves about 0.5 requests/s was "predicted" 8 s with
    # 401 requests in flight at 50 requests/s. With max_num_seqs = 8 the engine model
    # saturates at the rate 8 running requests sustain, and says so past it.
    model = engine_model_from_state(_state(cap=8, t0_ms=40.0, t1_ms=20.0))
    wl = Workload(output_tokens=200.0, prefill_s=0.3, max_rate_rps=0.5)
    curve = engine_curve(model, wl, 0)
    at_cap = 8 / (0.3 + 200 * (0.040 + 0.020 * 8))  # lambda(B = cap)
    assert curve.saturation_rps == pytest.approx(at_cap, rel=1e-3)
    lat, batch, _ = curve.at_rate(50.0)
    assert math.isinf(lat) and math.isinf(batch)
    assert curve.batch.max() <= 8


def _bad_fit_samples(k=2, n=16, seed=0):
    """16 windows at K=2 whose latency does not grow with the rate (pure noise): the fit
    gives C2 = 0 and a large error."""
    rng = np.random.default_rng(seed)
    t0 = 1_700_000_000
    out = []
    for w in range(n):
        rate = 0.1 + 0.05 * (w % 8)
        lat_ms = float(rng.uniform(2000, 14000))
        for i in range(60):
            out.append(
                {
                    "t": t0 + 60 * w + i,
                    "k": k,
                    "requests_per_s": rate,
                    "e2e_ms_mean": lat_ms,
                    "interval_s": 1.0,
                    "output_tokens": 120 * rate,
                    "ttft_p50_ms": 300.0,
                    "waiting": 0,
                }
            )
    return out


def test_a_bad_fit_is_not_enough_data_with_what_to_do_never_an_answer():
    rep = plan(_bad_fit_samples(), _state(mode="fixed", k=2), rate_rps=50.0)
    chk = rep.checks[2]
    assert not chk.ok and chk.n_points == 16
    assert "C2 = 0" in chk.reason or "error" in chk.reason
    assert "python -m bench run" in chk.advice and "fixed:2" in chk.advice and "3+ rates" in chk.advice
    assert not [r for r in rep.what_if if r.source == "fitted check"]
    # the engine model answers instead, and says 50 requests/s is past saturation
    ans = rep.answer
    assert ans is not None and ans.label == "K=2" and math.isinf(ans.latency_s) and ans.extrapolated


def test_large_relative_error_alone_is_not_enough_data():
    rates = np.array([0.2, 0.4, 0.6, 0.8, 1.0, 1.2])
    lat = 1.0 / (1 - rates * 0.5) * np.array([1.0, 1.6, 0.6, 1.5, 0.7, 1.4])
    pts = [MeasuredPoint(k=3, rate_rps=float(r), latency_s=float(v)) for r, v in zip(rates, lat)]
    chk = check_fits(pts)[3]
    assert chk.fit is not None and chk.fit.c2_s > 0
    assert not chk.ok and "above 25%" in chk.reason and chk.relative_rmse > 0.25
    good = [MeasuredPoint(k=3, rate_rps=float(r), latency_s=float(1.0 / (1 - r * 0.5))) for r in rates]
    assert check_fits(good)[3].ok


def test_adaptive_mode_gets_a_curve_from_the_controllers_choice():
    rep = plan([], _state(mode="adaptive", accept=0.8, t0_ms=30.0, t1_ms=1.0, cap=64))
    assert rep.default_label == "adaptive" and rep.engine_problem is None
    ad = rep.curves["adaptive"]
    # a lone request gets a deep K (verification is cheap next to t0), a full batch less or none
    assert ad.k_used[0] >= 3
    assert ad.k_used[-1] < ad.k_used[0]
    for label in ("K=0", "K=4"):  # never worse than the fixed depths it chooses from
        assert ad.zero_load_latency_s <= rep.curves[label].zero_load_latency_s + 1e-9
    assert ad.saturation_rps >= rep.curves["K=4"].saturation_rps - 1e-9
    assert rep.answer is not None and rep.answer.label == "adaptive" and math.isfinite(rep.answer.latency_s)


def test_unmeasured_depths_are_named_not_drawn():
    rep = plan([], _state(measured_positions=2))
    assert set(rep.curves) == {"K=0", "K=1", "K=2", "adaptive"}
    assert "position 3" in rep.unmeasured[3] and "positions 3-4" in rep.unmeasured[4]
    assert "--k 4" in rep.unmeasured[4]


def test_a_down_host_or_an_old_engine_is_not_enough_data_for_the_engine_model():
    rep = plan([], None)
    assert rep.engine_model is None and "did not answer" in rep.engine_problem and rep.what_if == ()
    old = _state()
    del old["controller"]["step_time_ms_by_batch"]
    assert "does not report T(B, K)" in plan([], old).engine_problem
    fresh = _state()
    fresh["controller"]["step_time_measured_batch"] = None
    assert "serve some traffic" in plan([], fresh).engine_problem


def test_answers_beyond_measured_rates_or_batches_are_marked_extrapolation():
    samples = [
        {
            "t": 1_700_000_000 + i,
            "k": 0,
            "requests_per_s": 0.5,
            "interval_s": 1.0,
            "e2e_ms_mean": 900.0,
            "output_tokens": 50.0,
            "ttft_p50_ms": 100.0,
            "waiting": 0,
        }
        for i in range(120)
    ]
    low = plan(samples, _state(mode="fixed", k=0), rate_rps=0.4)
    assert low.workload.output_tokens == pytest.approx(100.0)
    assert low.workload.prefill_s == pytest.approx(0.1)
    assert low.workload.max_rate_rps == pytest.approx(0.5)
    assert low.answer.label == "K=0" and not low.answer.extrapolated
    high = plan(samples, _state(mode="fixed", k=0), rate_rps=2.0)
    assert high.answer.extrapolated


def test_planner_answer_from_a_real_controllers_state():
    # the contract between engine_host.controller and the planner: a controller that
    # learned T(B, K) and E(K) from (simulated) steps gives a curve without any sweep
    from engine_host.config import SpeculationConfig
    from engine_host.controller import SpeculationController, StepObservation

    ctl = SpeculationController(4, SpeculationConfig(mode="fixed", k=2))
    for step in range(400):
        b = 1 + step % 8
        hist = [int(b * 0.7), int(b * 0.49), 0, 0]
        ctl.observe(StepObservation(b, 2, 2 * b, hist[0] + hist[1], hist, 0.02 + 0.001 * b * 3, True, float(step)))
    state = {
        "controller": ctl.snapshot(),
        "config": {"speculation": {"mode": "fixed", "k": 2}},
        "speculation": {"mode": "fixed"},
        "batch": {"max_num_seqs": 8},
    }
    rep = plan([], state, output_tokens=100, prefill_s=0.05)
    assert rep.engine_problem is None and rep.default_label == "K=2"
    assert set(rep.unmeasured) == {3, 4}
    c = rep.curves["K=2"]
    e2 = rep.engine_model.expected_tokens[2]
    assert 1.3 < e2 < 2.2  # r_1 + r_2 measured from the (truncated) accepted counts
    assert c.zero_load_latency_s == pytest.approx(0.05 + 100 * 0.023 / e2, rel=0.15)  # T(1, 2) = 23 ms
    assert 0 < c.saturation_rps < 8 / (100 * 0.02 / e2)


def test_what_if_values_are_checked():
    with pytest.raises(PlannerError, match="request rate"):
        plan([], _state(), rate_rps=-1.0)
    with pytest.raises(PlannerError, match="latency target"):
        plan([], _state(), latency_slo_s=0.0)
    with pytest.raises(PlannerError, match="output tokens"):
        plan([], _state(), output_tokens=0)


# --------------------------------------------------------------------------- the page


def _store_with_bad_fit(url: str, engine_url: str, now: float) -> None:
    """One host, ``gpu-a``, with 16 one-minute rows at K=2 whose mean latency does not grow
    with the rate (the issue's case: C2 = 0, a large error)."""
    from sqlalchemy import insert
    from sqlalchemy.orm import Session

    from control import db
    from control.models import Host, MetricSample

    rng = np.random.default_rng(0)
    engine = db.open_engine(url)
    with Session(engine) as s, s.begin():
        h = Host(name="gpu-a", url=engine_url, token_env="PLAN_TOKEN", gpu_kind="cpu", created_at=now - 86400)
        s.add(h)
        s.flush()
        rows = []
        for w in range(16):
            rate, e2e = 0.1 + 0.05 * (w % 8), float(rng.uniform(2.0, 14.0))
            n = rate * 60
            rows.append(
                {
                    "host_id": h.id,
                    "resolution_s": 60,
                    "t": int(now) // 60 * 60 - 60 * (16 - w),
                    "covered_s": 60.0,
                    "busy_s": 30.0,
                    "output_tokens": 120 * n,
                    "user_output_tokens": 120 * n,
                    "prompt_tokens": 200 * n,
                    "requests_finished": n,
                    "ttft_p50_ms": 300.0,
                    "waiting": 0.0,
                    "running": 1.0,
                    "k": 2.0,
                    "mode": "fixed",
                    "max_num_seqs": 8,
                    "hist": {"e2e": {f"{0.99 * e2e!r}:{1.01 * e2e!r}": n}},
                }
            )
        s.execute(insert(MetricSample), rows)
    engine.dispose()


def _planner_page(tmp_path, monkeypatch, state):
    """The Planner page (Streamlit's AppTest) on a real SQLite store and a stand-in engine
    host answering ``state`` (None: the host is down)."""
    import time
    from pathlib import Path

    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from control.auth import User
    from tests.support import FakeEngineHost

    fake = FakeEngineHost(token="plan-token")
    if state is not None:
        full = _merged(fake._state(), state)  # a whole /control/state body: the client checks the contract
        fake._state = lambda: full
        fake.start()
    url = f"sqlite:///{tmp_path / 'specpilot.db'}"
    monkeypatch.setenv("SPECPILOT_HOME", str(tmp_path))
    monkeypatch.setenv("SPECPILOT_DB_URL", url)
    monkeypatch.delenv("SPECPILOT_DB", raising=False)
    monkeypatch.setenv("PLAN_TOKEN", "plan-token")
    _store_with_bad_fit(url, fake.url, time.time())
    st.cache_data.clear()
    st.cache_resource.clear()
    try:
        page = Path(__file__).resolve().parent.parent / "dashboard" / "pages" / "planner.py"
        at = AppTest.from_file(str(page), default_timeout=60)
        at.session_state["user"] = User("vic", "viewer")
        at.run()
    finally:
        if state is not None:
            fake.stop()
        st.cache_data.clear()
        st.cache_resource.clear()
    assert not at.exception, at.exception
    return at


def _merged(base: dict, over: dict) -> dict:
    """``base`` with ``over``'s keys laid over it, nested dicts merged key by key."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _page_text(at) -> str:
    parts = [m.value for m in at.markdown] + [w.value for w in at.warning] + [c.value for c in at.caption]
    return "\n".join(str(p) for p in parts + [e.value for e in at.error])


def test_planner_page_shows_not_enough_data_on_a_bad_fit_and_the_engine_answer(tmp_path, monkeypatch):
    at = _planner_page(tmp_path, monkeypatch, _state(mode="fixed", k=2, cap=8))
    text = _page_text(at)
    assert "Fitted check K=2: not enough data" in text and "python -m bench run" in text, text
    assert "the config in force (**K=2**)" in text
    assert "Infinity" not in text and "inf" not in text.split()


def test_planner_page_with_the_host_down_says_not_enough_data(tmp_path, monkeypatch):
    at = _planner_page(tmp_path, monkeypatch, None)
    text = _page_text(at)
    assert "Engine model: not enough data" in text and "did not answer" in text, text


# --------------------------------------------------------------------------- on the real engine


@pytest.mark.engine
def test_real_engine_state_gives_an_answer_and_no_data_beyond_measured_positions(engine_host, control, restore_config):
    import httpx

    before = control.get("/control/state").json()["controller"]["acceptance_measured_request_steps"]
    assert control.put("/control/config", json={"speculation": {"mode": "fixed", "k": 2}}).status_code == 200
    prompt = (
        "Copy this list exactly, then copy it again: red apple, green pear, yellow banana, purple plum, "
        "orange mango, red apple, green pear, yellow banana, purple plum, orange mango, red apple,"
    )
    for _ in range(2):
        r = httpx.post(
            engine_host.url + "/v1/completions",
            timeout=120,
            json={"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 48, "temperature": 0},
        )
        assert r.status_code == 200, r.text
    state = control.get("/control/state").json()
    ctl = state["controller"]
    counts = ctl["acceptance_measured_request_steps"]
    # served traffic at K = 2 measured positions 1-2 only (the start-up warm-up measures none)
    assert counts[0] > before[0] and counts[1] > before[1] and counts[2:] == before[2:], (before, counts)
    acc = ctl["acceptance_per_position"]
    assert all((n == 0) == (a is None) for n, a in zip(counts, acc)), (counts, acc)  # no data, not the prior
    metrics = httpx.get(engine_host.url + "/metrics", timeout=10).text  # None positions are left out, not a 500
    assert 'specpilot:acceptance_per_position{position="1"}' in metrics
    rep = plan([], state, output_tokens=48, prefill_s=0.05)
    assert rep.engine_problem is None, rep.engine_problem
    assert rep.default_label == "K=2" and {"K=0", "K=2"} <= set(rep.curves)
    c = rep.curves["K=2"]
    assert 0 < c.saturation_rps < math.inf and 0 < c.zero_load_latency_s < 60
    assert rep.answer is not None and rep.answer.label == "K=2"
