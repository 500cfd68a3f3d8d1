"""Planner: Kong et al.'s latency model (arXiv 2605.15051) fitted per K from the stored
samples: predicted mean latency against request rate, saturation rate 1/C2, measured
points, and what-if questions."""

from __future__ import annotations

import math

import pandas as pd
import streamlit as st

from control import views
from dashboard import ui

ui.require_user()
ui.page_header("Planner", "Mean latency L = C1 / (1 − λ·C2) per draft length K (Kong et al., arXiv 2605.15051): "
                          "C1 is the latency at zero load, 1/C2 the request rate at which latency explodes. "
                          "Effective batch B = λ·L (Little's law).")

c = st.columns([2, 1, 1])
with c[0]:
    host = ui.host_picker("Host", key="plan_host")
with c[1]:
    days = st.selectbox("Samples from", [1, 7, 30], index=1, format_func=lambda d: f"last {d} days", key="plan_days")
with c[2]:
    window_s = st.selectbox("Point per", [30, 60, 300], index=1, format_func=lambda s: f"{s} s", key="plan_window")


@st.cache_data(ttl=60, show_spinner="Fitting the latency model…")
def _view(host: str, days: int, window_s: int) -> views.PlannerView:
    return views.planner_view(host, days=days, window_s=window_s)


try:
    pv = _view(host, days, window_s)
except Exception as exc:
    st.error(f"Planner unavailable: {views.describe_error(exc)}")
    st.stop()

for k, why in sorted(pv.problems.items()):
    st.caption(f"K={k} not fitted: {why}")
if not pv.fits:
    st.info("Not enough measurements to fit the model yet: each K needs requests served at three or more "
            "different load levels (windows of constant K with finished requests).")
    st.stop()

curves = views.planner_curves(pv)
shown = views.planner_points_for_display(pv)
fig = ui.new_fig()
for i, k in enumerate(sorted(pv.fits)):
    color = ui.K_COLORS[k % len(ui.K_COLORS)]
    cv = curves[curves["k"] == k]
    ui.line(fig, cv["rate_rps"], cv["latency_s"], f"K={k} model", color)
    pts = shown[shown["k"] == k]
    ui.points(fig, pts["rate_rps"], pts["latency_s"], f"K={k} measured", color, size=6, opacity=0.45)
    sat = pv.fits[k].saturation_rps
    if math.isfinite(sat):
        ui.vline(fig, sat, color, dash="dot", width=1)
        fig["layout"]["annotations"].append({"x": sat, "xref": "x", "y": 0.97 - 0.08 * i, "yref": "paper",
                                             "xanchor": "right", "text": f"K={k} saturates at {sat:.2f}/s",
                                             "showarrow": False, "font": {"size": 11, "color": color},
                                             "bgcolor": "rgba(255,255,255,0.85)"})
ymax = (max(float(pv.points["latency_s"].quantile(0.95)) * 1.6, 4 * min(f.c1_s for f in pv.fits.values()))
        if not pv.points.empty else None)
ui.base_layout(fig, "Predicted mean latency against request rate (dots: measured, binned by rate; "
                    "dotted: saturation 1/C2)",
               "mean latency (s)", x_title="request rate (requests/s)", height=420,
               y_range=[0, ymax] if ymax else None)
fig["layout"]["hovermode"] = "closest"
ui.show(fig, key="planner_curve")

fits = pd.DataFrame([f.as_dict() for f in pv.fits.values()])
st.dataframe(fits, hide_index=True, width="stretch", key="planner_fits", column_config={
    "k": st.column_config.NumberColumn("K", help="draft tokens"),
    "c1_s": st.column_config.NumberColumn("C1: latency at zero load (s)", format="%.3f"),
    "c2_s": st.column_config.NumberColumn("C2: service time (s/request)", format="%.4f"),
    "saturation_rps": st.column_config.NumberColumn("saturation 1/C2 (requests/s)", format="%.2f"),
    "n_points": st.column_config.NumberColumn("points"),
    "rmse_s": st.column_config.NumberColumn("fit error RMSE (s)", format="%.3f"),
    "max_rate_rps": st.column_config.NumberColumn("highest measured rate (requests/s)", format="%.2f"),
})

st.subheader("What if")
c = st.columns([1, 1, 3])
max_sat = max([f.saturation_rps for f in pv.fits.values() if math.isfinite(f.saturation_rps)] or [1.0])
rate = c[0].number_input("Request rate (requests/s)", min_value=0.0, value=round(0.5 * max_sat, 2), step=0.1,
                         key="whatif_rate")
slo = c[1].number_input("Mean latency target (s)", min_value=0.0, value=round(2 * min(f.c1_s for f in
                        pv.fits.values()), 2), step=0.1, key="whatif_slo")
rows = pd.DataFrame(views.planner.what_if(pv.fits, rate, slo or None))
best = rows[rows["best"]]
if not best.empty:
    b = best.iloc[0]
    st.markdown(f"At **{rate:g} requests/s** the lowest predicted mean latency is **K={int(b['k'])}**: "
                f"**{b['latency_s']:.2f} s**, {b['effective_batch']:.1f} requests in flight.")
else:
    st.warning(f"Every fitted K is saturated at {rate:g} requests/s.")
rows = rows.assign(latency_s=rows["latency_s"].where(rows["latency_s"].map(math.isfinite)),
                   utilisation=rows["utilisation"].clip(upper=9.99))
st.dataframe(rows.drop(columns=["best"]), hide_index=True, width="stretch", key="whatif_table", column_config={
    "k": st.column_config.NumberColumn("K"),
    "latency_s": st.column_config.NumberColumn("predicted mean latency (s)", format="%.2f",
                                               help="empty: saturated at this rate"),
    "effective_batch": st.column_config.NumberColumn("effective batch B (requests)", format="%.1f"),
    "utilisation": st.column_config.NumberColumn("load λ·C2", format="percent"),
    "saturation_rps": st.column_config.NumberColumn("saturation (requests/s)", format="%.2f"),
    "extrapolated": st.column_config.CheckboxColumn("beyond measured rates"),
    "max_rate_at_slo_rps": st.column_config.NumberColumn("max rate within target (requests/s)", format="%.2f"),
    "meets_slo": st.column_config.CheckboxColumn("meets target"),
})
