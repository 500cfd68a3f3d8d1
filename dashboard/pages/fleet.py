"""Fleet: every registered engine host at a glance (state, K, load, alerts); pick one to
drill into its Live page."""

from __future__ import annotations

import streamlit as st

from control.views import common
from control.views import fleet as views
from dashboard import ui

ui.require_user()
ui.page_header("Fleet", "All registered engine hosts. Pick one to open its live view.")


@st.fragment(run_every="5s")
def fleet_panel() -> None:
    """The host table (refreshes every 5 s)."""
    try:
        df = views.fleet_overview(ui.store())
    except Exception as exc:
        st.error(f"Fleet unavailable: {common.describe_error(exc)}")
        return
    if df.empty:
        st.info("No engine host is registered yet: `python -m control hosts add NAME URL`.")
        return
    up = int((df["state"] == "UP").sum())
    down = int((df["state"] == "DOWN").sum())
    c = st.columns(4)
    c[0].metric("Hosts", len(df))
    c[1].metric("Up", up)
    c[2].metric("Down", down)
    c[3].metric("Open alerts", int(df["open_alerts"].sum()))
    table = df.assign(
        load=[f"{ui.fmt(r)} / {ui.fmt(m)}" for r, m in zip(df["running"], df["max_num_seqs"])],
        mode=df["mode"].fillna("—"),
        error=df["error"].fillna(""),
    )
    ui.dataframe(
        ui.color_cells(
            table[
                [
                    "host",
                    "state",
                    "mode",
                    "k_current",
                    "load",
                    "waiting",
                    "output_tokens_per_s",
                    "ttft_p99_ms",
                    "open_alerts",
                    "gpu_kind",
                    "usd_per_hour",
                    "error",
                ]
            ],
            "state",
            good=["UP"],
            bad=["DOWN"],
            formats={
                "k_current": "{:.0f}",
                "waiting": "{:.0f}",
                "output_tokens_per_s": "{:,.0f}",
                "ttft_p99_ms": "{:,.0f}",
                "usd_per_hour": "${:.2f}",
                "open_alerts": "{:d}",
            },
        ),
        hide_index=True,
        width="stretch",
        column_config={
            "k_current": st.column_config.NumberColumn("K now", help="draft tokens per step in force"),
            "load": st.column_config.TextColumn("running / cap"),
            "output_tokens_per_s": st.column_config.NumberColumn(
                "output (tokens/s)", format="%.0f", help="mean over the last minute"
            ),
            "ttft_p99_ms": st.column_config.NumberColumn(
                "TTFT P99 (ms)", format="%.0f", help="worst over the last minute"
            ),
            "open_alerts": st.column_config.NumberColumn("open alerts"),
            "gpu_kind": st.column_config.TextColumn("GPU"),
            "usd_per_hour": st.column_config.NumberColumn("USD/hour", format="$%.2f"),
            "error": st.column_config.TextColumn("why down", width="large"),
        },
        key="fleet_table",
    )


fleet_panel()

st.subheader("Drill into a host")
hosts = [h.name for h in ui.cached_hosts()]
if hosts:
    c = st.columns([2, 1, 1, 3])
    chosen = c[0].selectbox(
        "Host",
        hosts,
        key="fleet_pick",
        index=hosts.index(st.session_state["selected_host"]) if st.session_state.get("selected_host") in hosts else 0,
    )
    if c[1].button("Open live view", type="primary", key="fleet_open"):
        st.session_state["selected_host"] = chosen
        st.switch_page("pages/live.py")
    if c[2].button("Open control", key="fleet_control"):
        st.session_state["selected_host"] = chosen
        st.switch_page("pages/control.py")

st.subheader("Canary rollout")
with st.expander("Roll a change out: canary first, watched against the others, then the rest"):
    if hosts:
        with st.form("rollout_form"):
            c = st.columns(3)
            r_hosts = c[0].multiselect("Hosts (in order)", hosts, default=hosts, key="rollout_hosts")
            r_canary = c[1].selectbox("Canary", hosts, key="rollout_canary")
            r_watch = c[2].number_input("Watch (s)", min_value=1, value=600, step=60, key="rollout_watch")
            c = st.columns(3)
            r_mode = c[0].selectbox("Mode", ["fixed", "adaptive", "off"], key="rollout_mode")
            r_k = c[1].number_input("K (mode fixed)", min_value=0, value=2, step=1, key="rollout_k")
            r_guards = c[2].text_area(
                "Guards (one a line)",
                key="rollout_guards",
                value="ttft_p99_ms <= 1.1 * baseline\noutput_tokens_per_s >= 0.95 * baseline",
            )
            r_reason = st.text_input("Reason", key="rollout_reason")
            if st.form_submit_button("Start rollout", type="primary"):
                patch = {"speculation": {"mode": r_mode, **({"k": int(r_k)} if r_mode == "fixed" else {})}}
                try:
                    rid = views.start_rollout(
                        ui.store(),
                        ui.current_user(),
                        hosts=r_hosts,
                        canary=r_canary,
                        patch=patch,
                        watch_s=float(r_watch),
                        guards=r_guards.splitlines(),
                        reason=r_reason,
                    )
                    st.success(f"Rollout {rid} started: canary {r_canary} first.")
                except common.ViewError as exc:
                    st.error(common.describe_error(exc))


@st.fragment(run_every="5s")
def rollouts_panel() -> None:
    """Recent rollouts and where they stand (refreshes every 5 s)."""
    try:
        df = views.rollouts_frame(ui.store())
    except Exception as exc:
        st.error(f"Rollouts unavailable: {common.describe_error(exc)}")
        return
    if df.empty:
        st.caption("No rollout yet.")
        return
    ui.dataframe(
        ui.color_cells(df, "status", good=["succeeded"], bad=["rolled_back", "failed"]),
        hide_index=True,
        width="stretch",
        key="rollouts_table",
    )


rollouts_panel()
