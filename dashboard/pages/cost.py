"""Cost review: the weekly report from the control plane's cost model (USD per million
output tokens, utilisation, cost per day, saving against the baseline), CSV download and
a printable view."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone  # noqa: F401
from datetime import time as dtime

import pandas as pd
import streamlit as st

from control.views import common
from control.views import cost as views
from dashboard import ui

ui.require_user()
printable = st.session_state.get("cost_print", False)
if printable:
    # Printable view: no sidebar, no header, no widgets' chrome; the browser's Print (Ctrl-P) does the rest.
    st.markdown(
        "<style>[data-testid='stSidebar'], header, [data-testid='stToolbar'] {display: none !important;}"
        "@media print {[data-testid='stSelectbox'], [data-testid='stDateInput'], [data-testid='stTextInput'], "
        "[data-testid='stDownloadButton'], [data-testid='stCheckbox'] {display: none !important;}}"
        "</style>",
        unsafe_allow_html=True,
    )
else:
    ui.page_header("Cost review")

c = st.columns([2, 2, 2, 1.4, 1.4, 1], vertical_alignment="bottom")
with c[0]:
    host = ui.host_picker("Host", key="cost_host", allow_all=True)
with c[1]:
    end_day = st.date_input("Week ending (UTC)", value=datetime.now(timezone.utc).date(), key="cost_end")
end = min(datetime.combine(end_day + timedelta(days=1), dtime.min, tzinfo=timezone.utc), datetime.now(timezone.utc))
with c[2]:
    st.session_state.setdefault("cost_baseline", "k0")
    baseline = st.text_input(
        "Saving against",
        key="cost_baseline",
        help="k0: throughput measured at K = 0 (no speculation); version:N: while config version N was in force",
    ).strip()


# Short-lived cache (the same figures as `python -m control report weekly`): a new price or
# new samples show within 30 s, at once with Refresh.
@st.cache_data(ttl=30, show_spinner="Computing the weekly report…")
def _report(host: str | None, end: datetime, baseline: str) -> views.WeeklyReport:
    return views.weekly_report(ui.store(), host=host, end=end, baseline=baseline)


with c[5]:
    if st.button("Refresh", icon=":material/refresh:", key="cost_refresh", help="recompute the report now"):
        _report.clear()
try:
    rep = _report(host, end.replace(second=0, microsecond=0), baseline)
except Exception as exc:
    st.error(f"Report unavailable: {common.describe_error(exc)}")
    st.stop()

with c[3]:
    st.download_button(
        "Download CSV",
        rep.csv,
        file_name=f"specpilot-weekly-{rep.end:%Y-%m-%d}.csv",
        mime="text/csv",
        icon=":material/download:",
        key="cost_csv",
        on_click="ignore",
    )
with c[4]:
    st.toggle("Printable view", key="cost_print")

if printable:
    st.title("SpecPilot weekly cost report")
st.markdown(
    f"**Week {rep.start:%Y-%m-%d %H:%M} – {rep.end:%Y-%m-%d %H:%M} (UTC)** · {host or 'all hosts'} · "
    f"saving measured against: {rep.baseline}"
)

if rep.unpriced_hosts:
    st.warning(
        f"No price is set for {', '.join(rep.unpriced_hosts)}: its cost reads $0. Set a price with "
        f"`{views.SET_PRICE}`.",
        icon=":material/sell:",
    )
s = rep.summary
if s.empty:
    st.info("No host served tokens in this week.")
    st.stop()

usd = float(s["usd"].sum())
tokens = float(s["output_tokens"].sum())
saving = float(s["saving_usd"].sum()) if s["saving_usd"].notna().any() else None
util = float((s["utilisation"] * s["usd"]).sum() / usd) if usd else None
m = st.columns(4)
m[0].metric("Cost of the week", f"${usd:,.2f}")
m[1].metric("USD per million output tokens", f"${usd / tokens * 1e6:,.2f}" if tokens else "—")
m[2].metric(
    "Utilisation",
    ui.fmt(None if util is None else 100 * util, "%"),
    help="share of paid GPU time spent serving requests",
)
m[3].metric(
    "Saving vs baseline",
    "—" if saving is None else f"{'−' if saving < 0 else ''}${abs(saving):,.2f}",
    help="GPU time the week's tokens would have needed at the baseline's measured throughput, minus the "
    "time used, in USD; negative: the baseline would have been cheaper",
)

st.subheader("By host")
ui.dataframe(
    s,
    hide_index=True,
    width="stretch",
    key="cost_summary",
    column_config={
        "usd": st.column_config.NumberColumn("cost (USD)", format="dollar"),
        "output_tokens": st.column_config.NumberColumn("output tokens", format="localized"),
        "usd_per_million_tokens": st.column_config.NumberColumn("USD / M tokens", format="$%.3f"),
        "utilisation": st.column_config.ProgressColumn("utilisation", min_value=0.0, max_value=1.0, format="percent"),
        "baseline_usd_per_million_tokens": st.column_config.NumberColumn("baseline USD / M tokens", format="$%.3f"),
        "saving_usd": st.column_config.NumberColumn("saving (USD)", format="dollar"),
        "saving_frac": st.column_config.NumberColumn("saving", format="percent"),
        "busy_tokens_per_s": st.column_config.NumberColumn("busy throughput (tokens/s)", format="%.0f"),
        "acceptance_rate": st.column_config.NumberColumn("acceptance", format="percent"),
        "mean_k": st.column_config.NumberColumn("mean K", format="%.2f"),
        "uptime_h": st.column_config.NumberColumn("uptime (h)", format="%.1f"),
        "baseline_note": st.column_config.TextColumn("baseline measured over", width="large"),
    },
)

d = rep.daily
if not d.empty and not d["usd"].fillna(0).any() and d["output_tokens"].fillna(0).any():
    st.info(
        f"Tokens were served this week, but no price is set: set a price with `{views.SET_PRICE}`.",
        icon=":material/sell:",
    )
    st.stop()
if d.empty or not d["usd"].fillna(0).any():
    st.info(
        "No served time in this week's roll-ups yet: the collector rolls its 1-second samples up into "
        "1-minute figures every minute, and the report reads those.",
        icon=":material/hourglass_empty:",
    )
    st.stop()
left, right = st.columns(2)
with left:
    fig = ui.new_fig()
    for i, (h, g) in enumerate(d.groupby("host")):
        ui.bar(fig, g["day"].astype(str), g["usd"], h, ui.K_COLORS[(i + 1) % len(ui.K_COLORS)])
    ui.base_layout(fig, "Cost per day", "cost (USD)", x_title="day (UTC)")
    fig["layout"]["xaxis"]["type"] = "category"  # one bar or point per UTC day
    fig["layout"].update(barmode="stack", hovermode="x unified")
    ui.show(fig, key="cost_per_day")
with right:
    fig = ui.new_fig()
    for i, (h, g) in enumerate(d.groupby("host")):
        ui.line(
            fig,
            g["day"].astype(str),
            g["usd_per_million_tokens"],
            h,
            ui.K_COLORS[(i + 1) % len(ui.K_COLORS)],
            mode="lines+markers",
        )
    ui.base_layout(fig, "USD per million output tokens", "USD / M tokens", x_title="day (UTC)")
    fig["layout"]["xaxis"]["type"] = "category"  # one bar or point per UTC day
    ui.show(fig, key="usd_per_mtok")
left, right = st.columns(2)
with left:
    fig = ui.new_fig()
    for i, (h, g) in enumerate(d.groupby("host")):
        ui.line(
            fig,
            g["day"].astype(str),
            g["utilisation"] * 100,
            h,
            ui.K_COLORS[(i + 1) % len(ui.K_COLORS)],
            mode="lines+markers",
        )
    ui.base_layout(fig, "Utilisation", "busy (% of paid time)", x_title="day (UTC)", y_range=[0, 100])
    fig["layout"]["xaxis"]["type"] = "category"  # one bar or point per UTC day
    ui.show(fig, key="util")
with right:
    fig = ui.new_fig()
    ui.bar(fig, s["host"], s["usd_per_million_tokens"], "this week", "#0072B2")
    if "baseline_usd_per_million_tokens" in s:
        ui.bar(fig, s["host"], s["baseline_usd_per_million_tokens"], "baseline (measured throughput)", "#BBBBBB")
    ui.base_layout(fig, "Against the baseline", "USD / M tokens", x_title="host")
    fig["layout"].update(barmode="group", hovermode="closest")
    ui.show(fig, key="baseline")

if printable:  # a static table prints whole; the interactive one scrolls
    st.subheader("Daily figures")
    st.table(
        d.assign(
            usd=d["usd"].map("${:,.2f}".format),
            output_tokens=d["output_tokens"].map("{:,.0f}".format),
            usd_per_million_tokens=d["usd_per_million_tokens"].map(lambda v: "—" if pd.isna(v) else f"${v:,.3f}"),
            utilisation=d["utilisation"].map(lambda v: "—" if pd.isna(v) else f"{100 * v:.0f}%"),
        )
        .rename(
            columns={
                "day": "day (UTC)",
                "usd": "cost (USD)",
                "output_tokens": "output tokens",
                "usd_per_million_tokens": "USD / M tokens",
            }
        )
        .set_index("host")
    )
else:
    with st.expander("Daily figures"):
        ui.dataframe(
            d,
            hide_index=True,
            width="stretch",
            key="cost_daily",
            column_config={
                "day": st.column_config.DateColumn("day (UTC)"),
                "usd": st.column_config.NumberColumn("cost (USD)", format="dollar"),
                "output_tokens": st.column_config.NumberColumn("output tokens", format="localized"),
                "usd_per_million_tokens": st.column_config.NumberColumn("USD / M tokens", format="$%.3f"),
                "utilisation": st.column_config.NumberColumn("utilisation", format="percent"),
            },
        )
if printable:
    st.caption(f"Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC by SpecPilot. Print with Ctrl-P.")
