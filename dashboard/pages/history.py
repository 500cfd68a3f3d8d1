"""History: every config version with author, reason, time, diff and outcome; filter by
host and time; roll back to any version (operators, with a reason)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from datetime import time as dtime

import pandas as pd
import streamlit as st

from control.views import common
from control.views import history as views
from dashboard import ui

user = ui.require_user()
ui.page_header(
    "History",
    "Config versions, newest first. A rollback applies an earlier version again as a new version with its own reason.",
)

c = st.columns([2, 2, 3])
with c[0]:
    host = ui.host_picker("Host", key="hist_host", allow_all=True)
with c[1]:
    span = st.selectbox(
        "Created",
        ["last 24 hours", "last 7 days", "last 30 days", "all time", "between dates"],
        index=1,
        key="hist_span",
    )
since = until = None
now = datetime.now(timezone.utc)
if span == "between dates":
    with c[2]:
        d = st.date_input("From – to (UTC)", value=(now.date() - timedelta(days=7), now.date()), key="hist_dates")
    if isinstance(d, tuple) and len(d) == 2:
        since = datetime.combine(d[0], dtime.min, tzinfo=timezone.utc)
        until = datetime.combine(d[1], dtime.max, tzinfo=timezone.utc)
elif span != "all time":
    since = (
        now
        - {"last 24 hours": timedelta(days=1), "last 7 days": timedelta(days=7), "last 30 days": timedelta(days=30)}[
            span
        ]
    )


@st.cache_data(ttl=3, show_spinner=False)
def _history(host: str | None, since: datetime | None, until: datetime | None):
    return views.history(ui.store(), host=host, since=since, until=until)


try:
    df = _history(host, since, until)
except Exception as exc:
    st.error(f"History unavailable: {common.describe_error(exc)}")
    st.stop()

last = st.session_state.pop("hist_outcome", None)
if last:
    h, v, outcome = last
    if outcome.applied:
        st.success(
            f"Rolled back {h}: the config of v{v} is in force again as version {outcome.version}.",
            icon=":material/check_circle:",
        )
    else:
        st.error(
            f"Rollback of {h} to v{v} not applied: {outcome.message}. The engine stays on its last good config.",
            icon=":material/cancel:",
        )

if df.empty:
    st.info("No config version in this span.")
    st.stop()

table = df.assign(change=df["diff_text"].str.replace("\n", " · "))
ui.dataframe(
    ui.color_cells(
        table[["host", "version", "created_at", "author", "reason", "source", "outcome", "change", "message"]],
        "outcome",
        good=["applied"],
        bad=["failed"],
    ),
    hide_index=True,
    width="stretch",
    column_config={
        "version": st.column_config.NumberColumn("version", format="v%d", width="small"),
        "created_at": st.column_config.DatetimeColumn("created (UTC)", format="YYYY-MM-DD HH:mm:ss"),
        "author": st.column_config.TextColumn("author", width="small"),
        "reason": st.column_config.TextColumn("reason", width="medium"),
        "outcome": st.column_config.TextColumn("outcome", width="small"),
        "source": st.column_config.TextColumn("kind", width="small"),
        "change": st.column_config.TextColumn("change (old → new)", width="large"),
        "message": st.column_config.TextColumn("engine's message", width="medium"),
    },
    key="history_table",
)


@st.cache_data(ttl=5, show_spinner=False)
def _runs(host: str | None, since: datetime | None):
    return views.heartbeat_runs(ui.store(), host=host, since=since)


with st.expander("Warm-up and heartbeat runs (skips included)"):
    try:
        runs = _runs(host, since)
    except Exception as exc:
        st.error(f"Runs unavailable: {common.describe_error(exc)}")
    else:
        if runs.empty:
            st.caption("No warm-up or heartbeat run in this span.")
        else:
            ui.dataframe(
                ui.color_cells(
                    runs,
                    "outcome",
                    good=["ok"],
                    bad=["failed", "error"],
                    formats={"duration_s": "{:.2f}", "ttft_s": "{:.3f}", "output_tokens": "{:.0f}", "k": "{:.0f}"},
                ),
                hide_index=True,
                width="stretch",
                key="runs_table",
                column_config={
                    "started_at": st.column_config.DatetimeColumn("started (UTC)", format="YYYY-MM-DD HH:mm:ss"),
                    "schedule": st.column_config.TextColumn("heartbeat"),
                    "duration_s": st.column_config.NumberColumn("took (s)"),
                    "ttft_s": st.column_config.NumberColumn("TTFT (s)"),
                    "output_tokens": st.column_config.NumberColumn("tokens"),
                    "detail": st.column_config.TextColumn("detail", width="large"),
                },
            )

st.subheader("Version details")
# Options are (host, version) keys, not row positions: a new version arriving between two
# reruns must never shift the selection onto another version.
keys = [f"{r.host}|{r.version}" for r in df.itertuples()]
labels = {
    f"{r.host}|{r.version}": f"{r.host} v{r.version} · {r.created_at:%Y-%m-%d %H:%M} · {r.author} · {r.outcome}"
    for r in df.itertuples()
}
key = st.selectbox("Version", keys, format_func=lambda k: labels[k], key="hist_version")
sel_host, sel_version = key.rsplit("|", 1)
row = df[(df["host"] == sel_host) & (df["version"] == int(sel_version))].iloc[0]
left, right = st.columns(2)
with left:
    message = row["message"] if isinstance(row["message"], str) and row["message"] else None
    st.markdown(
        f"**Reason:** {row['reason'] or '—'}  \n**Author:** {row['author'] or '—'}  \n"
        f"**Kind:** {row['source'] or '—'}  \n"
        f"**Outcome:** {row['outcome']}" + (f"  \n**Engine's message:** {message}" if message else "")
    )
    st.code(row["diff_text"] or "(no change against the previous version)", language=None)
with right:
    with st.expander("Full config of this version"):
        st.json(row["config"] or {})

if not user.can("rollback"):
    st.caption("Viewers cannot roll back.")
    st.stop()

try:
    in_force, rb_diff = views.rollback_diff(ui.store(), row["host"], int(row["version"]))
except Exception as exc:
    in_force, rb_diff = None, None
    st.warning(f"The config in force cannot be read: {common.describe_error(exc)}")
# The reason survives a refused submit (a missing tick): the form does not clear itself.
with st.form("rollback_form", clear_on_submit=False):
    st.markdown(f"**Roll {row['host']} back to v{row['version']}** (applied again as a new version)")
    if rb_diff is not None:
        against = "the config in force" if in_force is None else f"v{in_force}, the config in force"
        if rb_diff:
            st.caption(f"What changes against {against}:")
            ui.dataframe(
                pd.DataFrame(
                    [
                        {
                            "setting": d["field"],
                            "now": json.dumps(d.get("old")),
                            "after the rollback": json.dumps(d.get("new")),
                        }
                        for d in rb_diff
                    ]
                ),
                hide_index=True,
                width="stretch",
                key="rollback_diff",
            )
        else:
            st.caption(f"Nothing changes: v{row['version']} has the same config as {against}.")
    reason = st.text_input("Reason (required)", key="rb_reason")
    confirm = st.checkbox(f"I confirm: put the config of v{row['version']} in force on {row['host']}", key="rb_confirm")
    submitted = st.form_submit_button("Roll back", type="primary")
if submitted:
    if not confirm:
        st.error("Tick the confirmation first.", icon=":material/error:")
    else:
        try:
            outcome = views.rollback(ui.store(), row["host"], int(row["version"]), user, reason)
        except common.ViewError as exc:
            st.error(str(exc), icon=":material/error:")
        except Exception as exc:
            st.error(f"Rollback failed: {common.describe_error(exc)}", icon=":material/error:")
        else:
            _history.clear()
            st.session_state["hist_outcome"] = (row["host"], int(row["version"]), outcome)
            for k in ("rb_reason", "rb_confirm"):
                st.session_state.pop(k, None)
            st.rerun()
