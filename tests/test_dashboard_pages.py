"""Every dashboard page renders (Streamlit's AppTest, no browser) for a viewer and an
operator, against an in-memory backend: no exception, the right controls per role,
inline validation errors, a down host shown as DOWN."""

from __future__ import annotations

from pathlib import Path
import time
from datetime import datetime, timedelta, timezone

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from control import views
from control.auth import User

APP = str(Path(__file__).resolve().parent.parent / "dashboard" / "app.py")
PAGES = ["pages/live.py", "pages/control.py", "pages/history.py", "pages/fleet.py", "pages/alerts.py",
         "pages/cost.py", "pages/planner.py"]


class FakeBackend:
    """In-memory stand-in for the store and the engine hosts."""

    def __init__(self, now: float | None = None):
        self.now = now or time.time()
        self.down: set[str] = set()
        self.config = {"speculation": {"mode": "adaptive", "k": 0, "k_min": 0, "k_max": None, "table": None,
                                       "adaptive": {"margin": 0.05, "hysteresis": 0.03, "ema_alpha": 0.05,
                                                    "explore_every": 40},
                                       "threshold": {"interval_s": 10.0, "raise_above": 0.75, "lower_below": 0.6,
                                                     "off_below": 0.4, "k_low": 2, "k_high": 8}},
                       "batch": {"max_num_seqs": None, "max_num_batched_tokens": None},
                       "warmup": {"heartbeats": []}}
        self.version = 3
        self.applied: list[tuple[str, dict, str, str]] = []
        self.rolled: list[tuple[str, int, str, str]] = []

    def list_hosts(self):
        return [views.HostInfo("gpu-a", "http://a:8000", "H100", 2.5), views.HostInfo("gpu-b", "http://b:8000", "H100", 2.5)]

    def engine_state(self, name, timeout_s=1.5):
        if name in self.down:
            raise ConnectionError("connection refused")
        return {"config_version": self.version, "config": self.config,
                "speculation": {"mode": self.config["speculation"]["mode"], "k_current": 3, "k": 0, "k_min": 0,
                                "k_max": 8, "k_max_engine": 8},
                "batch": {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "running": 5, "waiting": 1},
                "limits": {"model": "m", "k_max": 8, "max_num_seqs": 8, "max_num_batched_tokens": 2048,
                           "max_model_len": 1024, "speculative_method": "ngram"},
                "controller": {"acceptance_per_position": [0.8, 0.6, 0.45, 0.3],
                               "predicted_goodput_tokens_per_s": {str(k): 100 + 10 * k - k * k for k in range(9)},
                               "expected_tokens_per_step": {str(k): 1 + 0.5 * k for k in range(9)},
                               "step_time_ms": {str(k): 20 + k for k in range(9)}},
                "engine": {"phase": "ready", "started_at": self.now - 3600},
                **({"router": self.router} if getattr(self, "router", None) else {})}

    def _samples(self, since, until=None, step=1.0):
        out = []
        t = max(since, self.now - 7 * 86400)
        end = until or self.now
        i = 0
        while t < end:
            k = 0 if (int(t) // 600) % 2 else 4
            load = 0.5 + 1.5 * ((int(t) // 60) % 5) / 4
            out.append({"t": t, "interval_s": step, "ttft_ms": {"p50": 40 + load * 10, "p95": 80, "p99": 120},
                        "itl_ms": {"p50": 12, "p95": 20, "p99": 30}, "e2e_ms": {"p50": 900 / (1 - load * 0.2)},
                        "output_tokens_per_s": 300 * load, "requests_finished": load * step, "kv_cache_usage": 0.4,
                        "running": 4, "waiting": 0, "acceptance_rate": 0.6 if k else None,
                        "acceptance_per_position": [0.8, 0.6, 0.4, 0.3] if k else None, "k": k, "mode": "adaptive",
                        "config_version": 3})
            t += step
            i += 1
        return out

    def stored_samples(self, name, since, until=None, resolution_s=None, columns=None):
        step = resolution_s or (1.0 if self.now - since <= 3600 else 60.0)
        return self._samples(since, until, step)

    def engine_samples(self, name, since, timeout_s=1.5):
        return self._samples(max(since, self.now - 600))

    def versions(self, host=None, since=None, until=None, limit=500):
        base = datetime.fromtimestamp(self.now, tz=timezone.utc)
        rows = []
        for v in range(1, self.version + 1):
            rows.append({"host": "gpu-a", "version": v, "created_at": base - timedelta(minutes=10 * (self.version - v)),
                         "author": "alice", "reason": f"change {v}", "outcome": "applied" if v != 2 else "failed",
                         "message": None if v != 2 else "K=12 is above K_max", "applied_at": None,
                         "diff": [{"field": "speculation.k", "old": v - 1, "new": v}], "config": self.config,
                         "source": "apply"})
        return [r for r in rows if host in (None, r["host"])]

    def apply(self, name, patch, author, reason):
        self.applied.append((name, patch, author, reason))
        self.version += 1
        return views.ChangeOutcome(True, self.version, "applied", [], self.version, 3)

    def rollback(self, name, version, author, reason):
        self.rolled.append((name, version, author, reason))
        self.version += 1
        return views.ChangeOutcome(True, self.version, "applied", [], self.version, 3)

    def alerts(self, open_only=False, host=None, since=None, limit=500):
        start = datetime.fromtimestamp(self.now - 900, tz=timezone.utc)
        rows = [{"id": 1, "host": "gpu-b", "rule": "kv_cache_high", "severity": "warning",
                 "message": "KV cache usage 93% > 90%", "value": 0.93, "started_at": start, "ended_at": None},
                {"id": 2, "host": "gpu-a", "rule": "host_down", "severity": "critical", "message": "host down",
                 "value": None, "started_at": start - timedelta(hours=5), "ended_at": start - timedelta(hours=4)}]
        return [r for r in rows if (not open_only or r["ended_at"] is None) and host in (None, r["host"])]

    def weekly_report(self, host=None, end=None, baseline="k0"):
        end = end or datetime.now(timezone.utc)
        start = end - timedelta(days=7)
        days = [(start + timedelta(days=i)).date() for i in range(7)]
        daily = pd.DataFrame([{"host": h, "day": d, "usd": 60.0, "output_tokens": 2e7 + i * 1e6,
                               "usd_per_million_tokens": 60.0 / (20 + i), "utilisation": 0.5 + 0.05 * i}
                              for h in ("gpu-a", "gpu-b") for i, d in enumerate(days)])
        summary = pd.DataFrame([{"host": h, "usd": 420.0, "output_tokens": 1.61e8, "usd_per_million_tokens": 2.61,
                                 "utilisation": 0.65, "baseline_usd_per_million_tokens": 3.1, "saving_usd": 66.0,
                                 "saving_frac": 0.157} for h in ("gpu-a", "gpu-b")]).reindex(
            columns=views.SUMMARY_COLUMNS)
        return views.WeeklyReport(start, end, summary, daily, "K = 0 (no speculation)", summary.to_csv().encode())


@pytest.fixture
def backend():
    import streamlit as st

    st.cache_data.clear()
    b = FakeBackend()
    views.set_backend(b)
    yield b
    views.set_backend(None)


def _app(user: User | None, page: str | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60)
    if user is not None:
        at.session_state["user"] = user
    at.run()
    if page:
        at.switch_page(page).run()
    return at


VIEWER = User("vic", "viewer")
OPERATOR = User("olga", "operator")


def _texts(at: AppTest) -> str:
    parts = [m.value for m in at.markdown] + [e.value for e in at.error] + [e.value for e in at.info]
    parts += [e.value for e in at.warning] + [e.value for e in at.success] + [e.value for e in at.caption]
    return "\n".join(str(p) for p in parts)


def test_login_page_before_login(backend, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECPILOT_USERS_FILE", str(tmp_path / "users.toml"))
    at = _app(None)
    assert not at.exception
    assert "No dashboard user is configured" in _texts(at)


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("user", [VIEWER, OPERATOR], ids=["viewer", "operator"])
def test_every_page_renders(backend, page, user):
    at = _app(user, page)
    assert not at.exception, at.exception
    assert "open alert" in _texts(at)  # the banner is on every page


def test_viewer_sees_no_control_forms(backend):
    at = _app(VIEWER, "pages/control.py")
    assert not at.exception
    assert "read only" in _texts(at)
    assert not [b for b in at.button if "Preview" in b.label or "Apply" in b.label]
    assert len(at.number_input) == 0 and len(at.text_input) == 0


def test_operator_invalid_k_shows_inline_error_and_applies_nothing(backend):
    at = _app(OPERATOR, "pages/control.py")
    at.selectbox(key="f_mode").set_value("fixed")
    at.number_input(key="f_k").set_value(12)
    at.text_input(key="f_reason_spec").set_value("try a deep K")
    at.button[[b.label for b in at.button].index("Preview change")].click().run()
    assert not at.exception
    assert "K=12 is above K_max" in _texts(at)
    assert backend.applied == []


def test_operator_change_needs_reason_then_preview_then_confirm(backend):
    at = _app(OPERATOR, "pages/control.py")
    at.selectbox(key="f_mode").set_value("fixed")
    at.number_input(key="f_k").set_value(4)
    at.button[[b.label for b in at.button].index("Preview change")].click().run()
    assert "a reason is required" in _texts(at)
    at.text_input(key="f_reason_spec").set_value("ticket 42: fixed K for the test")
    at.button[[b.label for b in at.button].index("Preview change")].click().run()
    assert not at.exception
    assert backend.applied == []
    assert "Review the change" in "\n".join(s.value for s in at.subheader)
    at.button(key="confirm_apply").click().run()
    assert not at.exception
    assert backend.applied and backend.applied[0][2] == "olga"
    assert backend.applied[0][1]["speculation"]["k"] == 4
    assert "Applied" in _texts(at)


def test_down_host_is_shown_as_down(backend):
    backend.down.add("gpu-a")
    at = _app(OPERATOR, "pages/live.py")
    assert not at.exception
    assert "DOWN" in _texts(at)
    at = _app(OPERATOR, "pages/control.py")
    assert not at.exception and "DOWN" in _texts(at)


def test_views_refuse_viewer_changes(backend):
    with pytest.raises(views.PermissionDenied):
        views.apply_change("gpu-a", {"speculation": {"k": 1}}, VIEWER, "a reason")
    with pytest.raises(views.PermissionDenied):
        views.rollback("gpu-a", 1, VIEWER, "a reason")
    with pytest.raises(views.ViewError, match="reason"):
        views.apply_change("gpu-a", {"speculation": {"k": 1}}, OPERATOR, " ")
    assert backend.applied == [] and backend.rolled == []


def test_preview_uses_the_engine_config_model(backend):
    state = backend.engine_state("gpu-a")
    p = views.preview_change(state["config"], state["limits"], {"speculation": {"mode": "fixed", "k": 5}})
    assert p.ok and {d["field"] for d in p.diff} == {"speculation.k", "speculation.mode"}
    p = views.preview_change(state["config"], state["limits"], {"speculation": {"k_min": 5, "k_max": 2}})
    assert not p.ok and "k_min=5 is above k_max=2" in " ".join(p.errors.values())
    p = views.preview_change(state["config"], state["limits"], {"batch": {"max_num_seqs": 64}})
    assert not p.ok and "batch.max_num_seqs" in p.errors
    p = views.preview_change(state["config"], state["limits"], {"speculation": {"k": -1}})
    assert not p.ok and "speculation.k" in p.errors


def test_request_count_and_mean_latency_from_stored_histogram():
    n, mean_ms = views._requests_in({"e2e": {"0.5:1.5": 3, "1.5:2.5": 1, "10.0:inf": 0}})
    assert n == 4 and mean_ms == pytest.approx(1000 * (3 * 1.0 + 2.0) / 4)
    assert views._requests_in(None) == (None, None)
    assert views._requests_in({"e2e": {}}) == (None, None)


def test_cost_printable_view_renders_static_tables(backend):
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["user"] = VIEWER
    at.session_state["cost_print"] = True
    at.run()
    at.switch_page("pages/cost.py").run()
    assert not at.exception
    assert any("weekly cost report" in t.value for t in at.title)
    assert len(at.table) == 1


def test_heartbeat_form_shows_model_errors(backend):
    at = _app(OPERATOR, "pages/control.py")
    at.text_input(key="f_hb_name").set_value("bad name!")
    at.text_input(key="f_reason_warmup").set_value("keep it warm at night")
    previews = [b for b in at.button if b.label == "Preview change"]
    previews[2].click().run()
    assert not at.exception
    text = _texts(at)
    assert "String should match pattern" in text  # name, inline, from HeartbeatSchedule
    at.text_input(key="f_hb_name").set_value("nightly")
    [b for b in at.button if b.label == "Preview change"][2].click().run()
    assert "set exactly one of 'interval_s' and 'cron'" in _texts(at)
    assert backend.applied == []
    at.number_input(key="f_hb_interval").set_value(300.0)
    [b for b in at.button if b.label == "Preview change"][2].click().run()
    assert "Review the change" in "\n".join(s.value for s in at.subheader)


def test_planner_display_points_are_binned_but_fit_uses_all():
    import numpy as np

    rates = np.linspace(0.1, 3.0, 1000)
    pts = pd.DataFrame({"k": 2, "rate_rps": rates, "latency_s": 1.0 / (1 - rates * 0.25),
                        "t_start": 0.0, "n_requests": 10})
    view = views.PlannerView(fits={}, problems={}, points=pts, days=7, window_s=60)
    shown = views.planner_points_for_display(view, max_per_k=50)
    assert len(shown) == 50 and shown["n"].sum() == 1000
    assert shown["rate_rps"].is_monotonic_increasing
    few = views.PlannerView(fits={}, problems={}, points=pts.head(10), days=7, window_s=60)
    assert len(views.planner_points_for_display(few, max_per_k=50)) == 10


def test_live_page_shows_a_dual_hosts_routing(backend):
    backend.router = {"mode": "auto", "p_speculative": 0.01, "resting": True,
                      "settings": {"probe_every_s": 20.0, "probe_s": 1.0, "p_probe": 0.1},
                      "probes": {"every_s": 80.0, "next_in_s": 31.2},
                      "tpot_ms": {"plain": 4.13, "speculative": 10.64}}
    at = _app(VIEWER, "pages/live.py")
    assert not at.exception, at.exception
    assert ("routing auto · speculative engine resting: probes of 1 s every 80 s at 10%, next in 31 s · "
            "TPOT plain 4.1 ms, speculative 10.6 ms") in _texts(at)


def test_routing_summary_says_the_share_when_not_resting_and_nothing_for_one_engine():
    assert views.routing_summary({}) is None
    r = {"mode": "auto", "p_speculative": 0.62, "resting": False, "settings": {"probe_every_s": 20.0},
         "tpot_ms": {"plain": 6.0, "speculative": None}}
    assert views.routing_summary(r) == "routing auto · 62% to the speculative engine · TPOT plain 6.0 ms"
    assert views.routing_summary({"mode": "plain", "p_speculative": 0.62}) == "routing plain"
    probing = {"mode": "auto", "p_speculative": 0.01, "resting": True, "probes": {"every_s": 20.0, "next_in_s": 0.0},
               "settings": {"probe_every_s": 20.0, "probe_s": 1.0, "p_probe": 0.1}}
    assert views.routing_summary(probing) == ("routing auto · speculative engine resting: probes of 1 s every "
                                              "20 s at 10% (probing now)")


def test_live_page_names_the_speculation_method_and_draft(backend):
    orig = backend.engine_state

    def with_draft(name, timeout_s=1.5):
        state = orig(name, timeout_s)
        state["limits"] = {**state["limits"], "speculative_method": "draft_model",
                           "draft_model": "/h/models/SmolLM2-135M-Instruct-draft-L8"}
        return state

    backend.engine_state = with_draft
    at = _app(VIEWER, "pages/live.py")
    assert not at.exception, at.exception
    assert "engine K_max 8, draft_model · draft SmolLM2-135M-Instruct-draft-L8" in _texts(at)
    status = views.status_from_state("a", "http://a", {"limits": {"speculative_method": "ngram"}})
    assert status.speculation == "ngram"
