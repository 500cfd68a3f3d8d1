"""Alerts: open alerts first, then the past ones (with how long they lasted)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import streamlit as st

from control.views import alerts as views
from control.views import common
from dashboard import ui

ui.require_user()
ui.page_header(
    "Alerts",
    "Rules evaluated by the collector: acceptance under 50% for 5 min, KV cache over 90%, "
    "queue-time P99 over 500 ms, host down.",
)

c = st.columns([2, 2, 3])
with c[0]:
    host = ui.host_picker("Host", key="alerts_host", allow_all=True)
with c[1]:
    days = st.selectbox("Past alerts", [1, 7, 30], index=1, format_func=lambda d: f"last {d} days", key="alerts_days")

COLUMNS = {
    "host": st.column_config.TextColumn("host", width="small"),
    "severity": st.column_config.TextColumn("severity", width="small"),
    "rule": st.column_config.TextColumn("rule", width="medium"),
    "message": st.column_config.TextColumn("what", width="large"),
    "value": st.column_config.NumberColumn("value", format="%.3g"),
    "started_at": st.column_config.DatetimeColumn("started (UTC)", format="YYYY-MM-DD HH:mm:ss"),
    "ended_at": st.column_config.DatetimeColumn("ended (UTC)", format="YYYY-MM-DD HH:mm:ss"),
    "duration_min": st.column_config.NumberColumn("lasted (min)", format="%.1f"),
}


@st.fragment(run_every="5s")
def alerts_panel() -> None:
    """Open and past alerts (refresh every 5 s)."""
    try:
        df = views.alerts(ui.store(), host=host, since=datetime.now(timezone.utc) - timedelta(days=days))
        open_df = views.alerts(ui.store(), open_only=True, host=host)
    except Exception as exc:
        st.error(f"Alerts unavailable: {common.describe_error(exc)}")
        return
    st.subheader(f"Open ({len(open_df)})")
    if open_df.empty:
        st.success("No open alert.", icon=":material/check_circle:")
    else:
        ui.dataframe(
            ui.color_cells(
                open_df.assign(duration_min=open_df["duration_s"] / 60.0)[
                    ["host", "severity", "rule", "message", "value", "started_at", "duration_min"]
                ],
                "severity",
                good=[],
                bad=["critical"],
                formats={"value": "{:.3g}", "duration_min": "{:.1f}"},
            ),
            hide_index=True,
            width="stretch",
            column_config=COLUMNS,
            key="open_alerts",
        )
    past = df[~df["open"]] if not df.empty else df
    st.subheader(f"Past ({len(past)})")
    if past.empty:
        st.caption("No alert ended in this span.")
    else:
        ui.dataframe(
            past.assign(duration_min=past["duration_s"] / 60.0, message=past["message"].fillna("—"))[
                ["host", "severity", "rule", "message", "value", "started_at", "ended_at", "duration_min"]
            ],
            hide_index=True,
            width="stretch",
            column_config=COLUMNS,
            key="past_alerts",
        )


alerts_panel()


@st.fragment(run_every="5s")
def drift_panel() -> None:
    """Open config drifts with both sides, and the operator's two ways out."""
    try:
        rows = views.open_drifts(ui.store(), host)
    except Exception as exc:
        st.error(f"Config drift unavailable: {views.describe_error(exc)}")
        return
    if rows:
        st.subheader(f"Config drift ({len(rows)})")
    for d in rows:
        st.warning(d["summary"], icon=":material/sync_problem:")
        with st.form(f"drift_{d['id']}"):
            reason = st.text_input("Reason", key=f"drift_reason_{d['id']}")
            b = st.columns(2)
            how = (
                "reapply"
                if b[0].form_submit_button(f"Re-apply store version {d['store_version']}")
                else "adopt"
                if b[1].form_submit_button("Adopt the engine's config")
                else None
            )
        if how:
            try:
                st.success(views.resolve_drift(ui.store(), d["host"], how, ui.current_user(), reason))
            except Exception as exc:
                st.error(views.describe_error(exc))


drift_panel()
