"""Every dashboard page renders (Streamlit's AppTest, no browser) for a viewer and an
operator, against an in-memory backend: no exception, the right controls per role,
inline validation errors, a down host shown as DOWN."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from control import auth
from control import versions as versions_mod
from control.auth import User
from control.views import common
from control.views import control as control_views
from control.views import history as history_views
from control.views import live as live_views
from control.views import planner as planner_views
from tests.support import FakeEngineHost

APP = str(Path(__file__).resolve().parent.parent / "dashboard" / "app.py")
PAGES = [
    "pages/live.py",
    "pages/control.py",
    "pages/history.py",
    "pages/fleet.py",
    "pages/alerts.py",
    "pages/cost.py",
    "pages/planner.py",
]


class StateEngine(FakeEngineHost):
    """The control plane's stand-in engine host (real HTTP, real config validation) with
    the parts of ``/control/state`` the Live page draws: running requests and the
    controller's estimates; ``extra``, ``extra_spec`` and ``extra_limits`` are merged into
    the state."""

    def __init__(self, token: str):
        super().__init__(token=token)
        self.extra: dict = {}
        self.extra_limits: dict = {}
        self.extra_spec: dict = {}
        self.config["speculation"]["mode"] = "adaptive"
        self.controller = {
            "acceptance_per_position": [0.8, 0.6, 0.45, 0.3],
            "predicted_goodput_tokens_per_s": {str(k): 100 + 10 * k - k * k for k in range(9)},
            "expected_tokens_per_step": {str(k): 1 + 0.5 * k for k in range(9)},
            "step_time_ms": {str(k): 20 + k for k in range(9)},
        }

    def _state(self):
        s = super()._state()
        s["speculation"].update({"k_current": 3, **self.extra_spec})
        s["batch"].update({"running": 5, "waiting": 1})
        s["limits"].update(self.extra_limits)
        s["controller"] = self.controller
        s.update(self.extra)
        return s


class Stack:
    """A real SQLite store (seeded with samples, versions and alerts) and two stand-in
    engine hosts, ``gpu-a`` and ``gpu-b``."""

    def __init__(self, home: Path):
        from bench.bench_dashboard import seed_store

        self.url = f"sqlite:///{home / 'specpilot.db'}"
        self.engines = {"gpu-a": StateEngine("token-a").start(), "gpu-b": StateEngine("token-b").start()}
        seed_store(
            self.url,
            [
                ("gpu-a", self.engines["gpu-a"].url, "DASH_TOKEN_A"),
                ("gpu-b", self.engines["gpu-b"].url, "DASH_TOKEN_B"),
            ],
            days=0.3,
        )
        self.store = common.open_store(self.url)

    @property
    def puts(self) -> list:
        return self.engines["gpu-a"].puts

    def stop(self) -> None:
        for e in self.engines.values():
            e.stop()


@pytest.fixture
def backend(tmp_path, monkeypatch):
    import streamlit as st

    monkeypatch.setenv("SPECPILOT_HOME", str(tmp_path))
    monkeypatch.setenv("SPECPILOT_DB_URL", f"sqlite:///{tmp_path / 'specpilot.db'}")
    monkeypatch.setenv("SPECPILOT_USERS_FILE", str(tmp_path / "users.toml"))
    monkeypatch.setenv("DASH_TOKEN_A", "token-a")
    monkeypatch.setenv("DASH_TOKEN_B", "token-b")
    auth.add_user("vic", "viewer", "viewer-password")
    auth.add_user("olga", "operator", "operator-password")
    st.cache_data.clear()
    st.cache_resource.clear()
    b = Stack(tmp_path)
    yield b
    b.stop()
    st.cache_data.clear()
    st.cache_resource.clear()


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
    monkeypatch.setenv("SPECPILOT_USERS_FILE", str(tmp_path / "nobody.toml"))
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
    assert backend.puts == []


def test_operator_change_needs_reason_then_preview_then_confirm(backend):
    at = _app(OPERATOR, "pages/control.py")
    at.selectbox(key="f_mode").set_value("fixed")
    at.number_input(key="f_k").set_value(4)
    at.button[[b.label for b in at.button].index("Preview change")].click().run()
    assert "a reason is required" in _texts(at)
    at.text_input(key="f_reason_spec").set_value("ticket 42: fixed K for the test")
    at.button[[b.label for b in at.button].index("Preview change")].click().run()
    assert not at.exception
    assert backend.puts == []
    assert "Review the change" in "\n".join(s.value for s in at.subheader)
    at.button(key="confirm_apply").click().run()
    assert not at.exception
    newest = versions_mod.history(backend.store, "gpu-a")[0]
    assert newest.author == "olga" and newest.config["speculation"]["k"] == 4
    assert backend.puts and backend.puts[-1]["speculation"]["k"] == 4
    assert "Applied" in _texts(at)


def test_down_host_is_shown_as_down(backend):
    backend.engines["gpu-a"].stop()
    at = _app(OPERATOR, "pages/live.py")
    assert not at.exception
    assert "DOWN" in _texts(at)
    at = _app(OPERATOR, "pages/control.py")
    assert not at.exception and "DOWN" in _texts(at)


def test_views_refuse_viewer_changes(backend):
    before = len(versions_mod.history(backend.store, "gpu-a"))
    with pytest.raises(common.PermissionDenied):
        control_views.apply_change(backend.store, "gpu-a", {"speculation": {"k": 1}}, VIEWER, "a reason")
    with pytest.raises(common.PermissionDenied):
        history_views.rollback(backend.store, "gpu-a", 1, VIEWER, "a reason")
    with pytest.raises(common.ViewError, match="reason"):
        control_views.apply_change(backend.store, "gpu-a", {"speculation": {"k": 1}}, OPERATOR, " ")
    assert backend.puts == [] and len(versions_mod.history(backend.store, "gpu-a")) == before


def test_preview_uses_the_engine_config_model(backend):
    state = backend.engines["gpu-a"]._state()
    p = control_views.preview_change(state["config"], state["limits"], {"speculation": {"mode": "fixed", "k": 5}})
    assert p.ok and {d["field"] for d in p.diff} == {"speculation.k", "speculation.mode"}
    p = control_views.preview_change(state["config"], state["limits"], {"speculation": {"k_min": 5, "k_max": 2}})
    assert not p.ok and "k_min=5 is above k_max=2" in " ".join(p.errors.values())
    p = control_views.preview_change(state["config"], state["limits"], {"batch": {"max_num_seqs": 64}})
    assert not p.ok and "batch.max_num_seqs" in p.errors
    p = control_views.preview_change(state["config"], state["limits"], {"speculation": {"k": -1}})
    assert not p.ok and "speculation.k" in p.errors


def test_request_count_and_mean_latency_from_stored_histogram():
    n, mean_ms = common.requests_in({"e2e": {"0.5:1.5": 3, "1.5:2.5": 1, "10.0:inf": 0}})
    assert n == 4 and mean_ms == pytest.approx(1000 * (3 * 1.0 + 2.0) / 4)
    assert common.requests_in(None) == (None, None)
    assert common.requests_in({"e2e": {}}) == (None, None)


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
    assert "use only letters, digits and _ . - (no spaces)" in text  # name, inline, in words
    assert "String should match pattern" not in text
    at.text_input(key="f_hb_name").set_value("nightly")
    [b for b in at.button if b.label == "Preview change"][2].click().run()
    assert "set exactly one of 'interval_s' and 'cron'" in _texts(at)
    assert backend.puts == []
    at.number_input(key="f_hb_interval").set_value(300.0)
    [b for b in at.button if b.label == "Preview change"][2].click().run()
    assert "Review the change" in "\n".join(s.value for s in at.subheader)


def test_planner_display_points_are_binned_but_fit_uses_all():
    import numpy as np

    rates = np.linspace(0.1, 3.0, 1000)
    pts = pd.DataFrame(
        {"k": 2, "rate_rps": rates, "latency_s": 1.0 / (1 - rates * 0.25), "t_start": 0.0, "n_requests": 10}
    )
    view = planner_views.PlannerView(fits={}, problems={}, points=pts, days=7, window_s=60)
    shown = planner_views.planner_points_for_display(view, max_per_k=50)
    assert len(shown) == 50 and shown["n"].sum() == 1000
    assert shown["rate_rps"].is_monotonic_increasing
    few = planner_views.PlannerView(fits={}, problems={}, points=pts.head(10), days=7, window_s=60)
    assert len(planner_views.planner_points_for_display(few, max_per_k=50)) == 10


def test_live_page_shows_a_dual_hosts_routing(backend):
    backend.engines["gpu-a"].extra["router"] = {
        "mode": "auto",
        "p_speculative": 0.01,
        "resting": True,
        "settings": {"probe_every_s": 20.0, "probe_s": 1.0, "p_probe": 0.1},
        "probes": {"every_s": 80.0, "next_in_s": 31.2},
        "tpot_ms": {"plain": 4.13, "speculative": 10.64},
    }
    at = _app(VIEWER, "pages/live.py")
    assert not at.exception, at.exception
    assert (
        "routing auto · speculative engine resting: probes of 1 s every 80 s at 10%, next in 31 s · "
        "TPOT plain 4.1 ms, speculative 10.6 ms"
    ) in _texts(at)


def test_routing_summary_says_the_share_when_not_resting_and_nothing_for_one_engine():
    assert live_views.routing_summary({}) is None
    r = {
        "mode": "auto",
        "p_speculative": 0.62,
        "resting": False,
        "settings": {"probe_every_s": 20.0},
        "tpot_ms": {"plain": 6.0, "speculative": None},
    }
    assert live_views.routing_summary(r) == "routing auto · 62% to the speculative engine · TPOT plain 6.0 ms"
    assert live_views.routing_summary({"mode": "plain", "p_speculative": 0.62}) == "routing plain"
    probing = {
        "mode": "auto",
        "p_speculative": 0.01,
        "resting": True,
        "probes": {"every_s": 20.0, "next_in_s": 0.0},
        "settings": {"probe_every_s": 20.0, "probe_s": 1.0, "p_probe": 0.1},
    }
    assert live_views.routing_summary(probing) == (
        "routing auto · speculative engine resting: probes of 1 s every 20 s at 10% (probing now)"
    )


def test_live_page_names_the_speculation_method_and_draft(backend):
    backend.engines["gpu-a"].extra_limits.update(
        {"speculative_method": "draft_model", "draft_model": "/h/models/SmolLM2-135M-Instruct-draft-L8"}
    )
    at = _app(VIEWER, "pages/live.py")
    assert not at.exception, at.exception
    assert "engine K_max 8, draft_model · draft SmolLM2-135M-Instruct-draft-L8" in _texts(at)
    status = common.status_from_state("a", "http://a", {"limits": {"speculative_method": "ngram"}})
    assert status.speculation == "ngram"


def _frame_with(at: AppTest, column: str) -> pd.DataFrame:
    """The first table on the page with that column (AppTest does not expose table keys)."""
    for d in at.dataframe:
        v = d.value
        data = v.data if hasattr(v, "data") else v
        if column in data.columns:
            return data
    raise AssertionError(f"no table with a column {column!r}")


def _click(at: AppTest, label: str) -> None:
    at.button[[b.label for b in at.button].index(label)].click().run()


def _apply_fixed_k(at: AppTest, k: int) -> None:
    at.selectbox(key="f_mode").set_value("fixed")
    at.number_input(key="f_k").set_value(k)
    at.text_input(key="f_reason_spec").set_value("ticket 7: fixed K on an idle engine")
    _click(at, "Preview change")
    at.button(key="confirm_apply").click().run()


def test_confirmation_shows_the_k_for_the_next_step_on_an_idle_engine(backend):
    backend.engines["gpu-a"].extra_spec.update({"k_current": 0})  # idle: no step ran since the change
    at = _app(OPERATOR, "pages/control.py")
    _apply_fixed_k(at, 4)
    assert not at.exception
    text = _texts(at)
    assert "K in force: 4." in text and "K in force: 0" not in text
    # An engine that reports the next step's K is believed as it is.
    backend.engines["gpu-a"].extra_spec.update({"k_next": 2})
    at = _app(OPERATOR, "pages/control.py")
    _apply_fixed_k(at, 5)
    assert "K in force: 2." in _texts(at)


def test_k_in_force_falls_back_by_mode_when_the_engine_does_not_report_it():
    assert common.k_in_force({"mode": "fixed", "k": 3, "k_current": 0}) == 3
    assert common.k_in_force({"mode": "off", "k": 3, "k_current": 0}) == 0
    assert common.k_in_force({"mode": "adaptive", "k_current": 5}) == 5
    assert common.k_in_force({"mode": "adaptive", "k_current": 5, "k_next": 6}) == 6
    assert common.k_in_force({"k_current": 0}, {"speculation": {"mode": "fixed", "k": 7}}) == 7


def test_a_removed_user_cannot_apply_from_an_open_tab(backend):
    at = _app(OPERATOR, "pages/control.py")
    auth.remove_user("olga")  # python -m dashboard users remove olga, while the tab stays open
    _apply_fixed_k(at, 4)
    assert not at.exception
    assert "no longer exists" in _texts(at)
    assert backend.puts == []
    with pytest.raises(common.PermissionDenied, match="no longer exists"):
        history_views.rollback(backend.store, "gpu-a", 1, OPERATOR, "a reason")


def test_a_demoted_user_cannot_apply(backend):
    auth.add_user("olga", "viewer", "operator-password", replace=True)
    with pytest.raises(common.PermissionDenied, match="olga is a viewer"):
        control_views.apply_change(backend.store, "gpu-a", {"speculation": {"k": 1}}, OPERATOR, "a reason")
    assert backend.puts == []


def test_history_lists_heartbeat_runs_with_skips(backend):
    from control import store as store_mod
    from control import warmup

    h = store_mod.get_host(backend.store, "gpu-a")
    now = time.time()
    warmup.record_runs(
        backend.store,
        h.id,
        now - 100,
        [
            {
                "id": 1,
                "kind": "heartbeat",
                "schedule": "nightly",
                "started_at": now - 60,
                "duration_s": 0.4,
                "ttft_s": 0.05,
                "output_tokens": 8,
                "k": 2,
                "outcome": "ok",
            },
            {
                "id": 2,
                "kind": "heartbeat",
                "schedule": "nightly",
                "started_at": now - 30,
                "outcome": "skipped",
                "detail": "not idle for 30 s",
            },
        ],
    )
    runs = history_views.heartbeat_runs(backend.store, "gpu-a")
    assert list(runs["outcome"]) == ["skipped", "ok"] and runs.iloc[0]["detail"] == "not idle for 30 s"
    at = _app(VIEWER, "pages/history.py")
    assert not at.exception
    table = _frame_with(at, "schedule")
    assert {"ok", "skipped"} <= set(table["outcome"])


def test_rollback_shows_the_diff_and_a_missing_tick_keeps_the_reason(backend):
    at = _app(OPERATOR, "pages/history.py")
    at.selectbox(key="hist_host").set_value("gpu-a").run()
    versions = versions_mod.history(backend.store, "gpu-a")
    assert len(versions) >= 2
    target = versions[-1].version  # the oldest: a different K from the one in force
    at.selectbox(key="hist_version").set_value(f"gpu-a|{target}").run()
    diff = _frame_with(at, "after the rollback")
    assert "speculation.k" in set(diff["setting"])
    at.text_input(key="rb_reason").set_value("back to the old K after the incident")
    _click(at, "Roll back")
    assert not at.exception
    assert "Tick the confirmation first." in _texts(at)
    assert at.text_input(key="rb_reason").value == "back to the old K after the incident"
    assert backend.puts == []


def test_cost_review_says_when_no_price_is_set_and_takes_a_new_price_at_once(backend):
    from control import store as store_mod

    for name in ("gpu-a", "gpu-b"):
        store_mod.add_host(
            backend.store,
            name,
            backend.engines[name].url,
            usd_per_hour=0.0,
            token_env="DASH_TOKEN_A" if name == "gpu-a" else "DASH_TOKEN_B",
            update=True,
        )
    at = _app(VIEWER, "pages/cost.py")
    assert not at.exception
    text = _texts(at)
    assert "set a price with" in text.lower() and "No served time" not in text
    store_mod.add_host(
        backend.store, "gpu-a", backend.engines["gpu-a"].url, usd_per_hour=4.0, token_env="DASH_TOKEN_A", update=True
    )
    _click(at, "Refresh")
    assert not at.exception
    cost = next(m for m in at.metric if m.label == "Cost of the week").value
    assert cost != "$0.00"
    assert "gpu-a" not in next(w.value for w in at.warning if "No price" in w.value)


def test_live_header_shows_the_control_planes_version_and_the_engines_as_a_detail(backend):
    newest = versions_mod.history(backend.store, "gpu-a")[0].version
    backend.engines["gpu-a"].version = 1  # a restarted engine counts from 1 again
    at = _app(VIEWER, "pages/live.py")
    assert not at.exception
    text = _texts(at)
    assert f"config **v{newest}**" in text
    assert "engine's own counter says v1" in text
    assert "step loop runs on CPU" not in text  # not pinned (the CPU build)
    backend.engines["gpu-a"].core_cpu = 14  # a GPU engine host with --core-cpu auto
    assert "The engine core's step loop runs on CPU 14 of its own." in _texts(_app(VIEWER, "pages/live.py"))


def test_controller_prior_is_not_shown_as_a_measured_acceptance():
    series = common.samples_frame([])
    df = live_views.acceptance_table(
        series, {"acceptance_per_position": [0.5, 0.5, 0.5], "acceptance_measured": [False, False, False]}
    )
    assert df["estimated"].isna().all()
    df = live_views.acceptance_table(series, {"acceptance_per_position": [0.7, None, None]})
    assert df["estimated"].iloc[0] == 0.7 and df["estimated"].iloc[1:].isna().all()
    assert df["after_full"].isna().all() and df["otherwise"].isna().all()  # an engine without run states
    df = live_views.acceptance_table(
        series,
        {
            "acceptance_per_position": [0.3, 0.2, None],
            "acceptance_by_run_state": {
                "after_full_acceptance_per_position": [0.9, 0.8, None],
                "otherwise_acceptance_per_position": [0.1, 0.05, None],
            },
        },
    )
    assert list(df["after_full"][:2]) == [0.9, 0.8] and list(df["otherwise"][:2]) == [0.1, 0.05]
    assert df["after_full"].isna().iloc[2]


def test_why_k_marks_the_best_k_within_the_range_the_controller_may_choose():
    g = live_views.goodput_table({"predicted_goodput_tokens_per_s": {"0": 50, "2": 90, "4": 120, "6": 110}})
    assert live_views.best_k(g) == 4
    assert live_views.best_k(g, k_min=5, k_max=8) == 6


@pytest.mark.parametrize("page", ["pages/cost.py", "pages/history.py", "pages/fleet.py"])
def test_tables_show_a_dash_not_none_in_empty_cells(backend, page):
    at = _app(OPERATOR, page)
    assert not at.exception, at.exception
    assert at.dataframe, f"{page} shows no table"
    assert all(d.proto.placeholder == "—" for d in at.dataframe), [d.proto.placeholder for d in at.dataframe]
