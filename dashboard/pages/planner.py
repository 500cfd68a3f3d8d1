"""Planner: mean latency against request rate per draft length K and for adaptive mode,
predicted from what the engine measures (T(B, K), E(K), Little's law; Kong et al.,
arXiv 2605.15051), with Kong's fit of measured points as a check. Everything shown
comes from :func:`control.planner.plan`; this page only lays it out."""

from __future__ import annotations

import math

import pandas as pd
import streamlit as st

from control.views import common
from control.views import planner as planner_views
from dashboard import ui

ui.require_user()
ui.page_header(
    "Planner",
    "Mean latency against request rate, predicted from what the engine measures: a request "
    "of n output tokens needs n/E(K) steps of T(B, K) seconds, and B = λ·L requests are in "
    "flight (Little's law; Kong et al., arXiv 2605.15051). Kong's L = C1 / (1 − λ·C2), fitted "
    "to measured points, is the check.",
)

c = st.columns([2, 1, 1])
with c[0]:
    host = ui.host_picker("Host", key="plan_host")
with c[1]:
    days = st.selectbox("Samples from", [1, 7, 30], index=1, format_func=lambda d: f"last {d} days", key="plan_days")
with c[2]:
    window_s = st.selectbox("Point per", [30, 60, 300], index=1, format_func=lambda s: f"{s} s", key="plan_window")


@st.cache_data(ttl=30, show_spinner="Reading samples and the engine's model…")
def _inputs(url: str | None, host: str, days: int, window_s: int) -> tuple[list[dict], dict | None, str | None]:
    return planner_views.planner_inputs(ui.store(), host, days=days, window_s=window_s)


try:
    samples, state, down = _inputs(common.db_url(), host, days, window_s)
    measured = planner_views.workload_from_samples(samples, window_s=window_s)
except Exception as exc:
    st.error(f"Planner unavailable: {common.describe_error(exc)}")
    st.stop()

st.subheader("What if")
c = st.columns(4)
rate = c[0].number_input(
    "Request rate (requests/s)",
    min_value=0.0,
    value=None,
    step=0.1,
    key="whatif_rate",
    placeholder="half of saturation",
    help="empty: half the saturation rate of the config in force",
)
slo = c[1].number_input(
    "Mean latency target (s)", min_value=0.0, value=None, step=0.1, key="whatif_slo", placeholder="none"
)
n_out = c[2].number_input(
    "Output tokens per request",
    min_value=1.0,
    value=float(round(measured.output_tokens)),
    step=16.0,
    key="whatif_tokens",
    help="default: the measured mean",
)
prefill_ms = c[3].number_input(
    "Prefill time (ms)",
    min_value=0.0,
    value=float(round(measured.prefill_s * 1000.0)),
    step=10.0,
    key="whatif_prefill",
    help="default: median TTFT of samples with no queue",
)
try:
    rep = planner_views.planner_report(
        samples,
        state,
        window_s=window_s,
        rate_rps=rate,
        latency_slo_s=slo or None,
        output_tokens=n_out,
        prefill_s=prefill_ms / 1000.0,
    )
except planner_views.PlannerError as exc:
    st.error(str(exc))
    st.stop()
st.caption(
    "Workload: "
    + " · ".join(measured.notes)
    + (f" · highest measured rate {measured.max_rate_rps:.2f} requests/s" if measured.max_rate_rps else "")
)

# -- the answer
ans = rep.answer
if rep.engine_problem:
    st.warning(f"Engine model: not enough data. {rep.engine_problem}" + (f" ({down})" if down else ""))
elif ans is not None:
    extra = " · **extrapolation**: beyond the measured rates or batch sizes" if ans.extrapolated else ""
    if math.isfinite(ans.latency_s):
        k_note = f", K={ans.k_used}" if ans.k is None and ans.k_used is not None else ""
        st.markdown(
            f"At **{rep.rate_rps:g} requests/s** the config in force (**{ans.label}**) gives a predicted "
            f"mean latency of **{ans.latency_s:.2f} s** with **{ans.effective_batch:.1f}** requests in "
            f"flight{k_note}; it saturates at **{ans.saturation_rps:.2f} requests/s**.{extra}"
        )
    else:
        st.markdown(
            f"At **{rep.rate_rps:g} requests/s** the config in force (**{ans.label}**) is **saturated**: "
            f"it sustains at most **{ans.saturation_rps:.2f} requests/s** (requests would queue without "
            f"bound).{extra}"
        )
for k, why in sorted(rep.unmeasured.items()):
    st.caption(f"K={k} not drawn: {why}.")
bad = [chk for chk in rep.checks.values() if not chk.ok]
for chk in bad:
    st.warning(
        f"Fitted check K={chk.k}: not enough data. {chk.reason.removeprefix(f'K={chk.k}: ')}. What to do: {chk.advice}."
    )

# -- the chart
fig = ui.new_fig()
labels = list(rep.curves)
for label in labels:
    cv = rep.curves[label]
    color = "#D55E00" if cv.k is None else ui.K_COLORS[cv.k % len(ui.K_COLORS)]
    lim = measured.max_rate_rps * 1.05
    inside = cv.rate_rps <= lim
    width = 3.0 if label == rep.default_label else 2.0
    ui.line(fig, cv.rate_rps[inside], cv.latency_s[inside], f"{label} (engine model)", color, width=width)
    if (~inside).any():  # beyond the measured rates: dotted, one point of overlap
        j = max(int(inside.sum()) - 1, 0)
        ui.line(
            fig,
            cv.rate_rps[j:],
            cv.latency_s[j:],
            f"{label} extrapolated",
            color,
            dash="dot",
            width=width,
            showlegend=False,
        )
    if math.isfinite(cv.saturation_rps):
        ui.vline(fig, cv.saturation_rps, color, dash="dot", width=1)
for chk in rep.checks.values():
    color = ui.K_COLORS[chk.k % len(ui.K_COLORS)]
    pts = [p for p in rep.points if p.k == chk.k]
    ui.points(
        fig,
        [p.rate_rps for p in pts],
        [p.latency_s for p in pts],
        f"K={chk.k} measured",
        color,
        size=6,
        opacity=0.45,
        showlegend=True,
    )
    if chk.ok and chk.fit is not None:
        r, lat = planner_views.curve(chk.fit, 1.1 * max(chk.fit.max_rate_rps, 1e-6))
        ui.line(fig, r, lat, f"K={chk.k} fitted check", color, dash="dash", width=1.5)
finite = [float(cv.latency_s.max()) for cv in rep.curves.values()] + [p.latency_s for p in rep.points]
ymax = 1.15 * max(finite) if finite else None
ui.base_layout(
    fig,
    "Predicted mean latency against request rate (solid: engine model, dotted: beyond the measured "
    "rates, dashed: fitted check, dots: measured; vertical lines: saturation)",
    "mean latency (s)",
    x_title="request rate (requests/s)",
    height=440,
    y_range=[0, ymax] if ymax else None,
)
fig["layout"]["hovermode"] = "closest"
if not rep.curves and not rep.points:
    ui.note(fig, "nothing to draw yet: no engine model and no measured points")
ui.show(fig, key="planner_curve")

# -- the tables
rows = pd.DataFrame(
    [
        {
            "label": r.label,
            "source": r.source,
            "latency_s": r.latency_s if math.isfinite(r.latency_s) else None,
            "effective_batch": r.effective_batch if math.isfinite(r.effective_batch) else None,
            "k_used": r.k_used,
            "saturation_rps": r.saturation_rps if math.isfinite(r.saturation_rps) else None,
            "extrapolated": r.extrapolated,
            "max_rate_at_slo_rps": r.max_rate_at_slo_rps,
            "meets_slo": r.meets_slo,
            "best": r.best,
        }
        for r in rep.what_if
    ]
)
if not rows.empty:
    ui.dataframe(
        rows,
        hide_index=True,
        width="stretch",
        key="whatif_table",
        column_config={
            "label": st.column_config.TextColumn("config"),
            "source": st.column_config.TextColumn("from"),
            "latency_s": st.column_config.NumberColumn(
                "predicted mean latency (s)", format="%.2f", help="empty: saturated at this rate"
            ),
            "effective_batch": st.column_config.NumberColumn("requests in flight B", format="%.1f"),
            "k_used": st.column_config.NumberColumn("K used", help="adaptive: the K the controller picks at that load"),
            "saturation_rps": st.column_config.NumberColumn("saturation (requests/s)", format="%.2f"),
            "extrapolated": st.column_config.CheckboxColumn(
                "extrapolation", help="beyond the measured rates or batch sizes"
            ),
            "max_rate_at_slo_rps": st.column_config.NumberColumn("max rate within target (requests/s)", format="%.2f"),
            "meets_slo": st.column_config.CheckboxColumn("meets target"),
            "best": st.column_config.CheckboxColumn("lowest latency"),
        },
    )

checks = pd.DataFrame(
    [
        {
            "k": chk.k,
            "status": "ok" if chk.ok else "not enough data",
            "n_points": chk.n_points,
            "c1_s": chk.fit.c1_s if chk.fit and chk.ok else None,
            "saturation_rps": chk.fit.saturation_rps if chk.fit and chk.ok else None,
            "relative_rmse": chk.relative_rmse,
            "engine_model_error": chk.engine_model_error,
        }
        for chk in rep.checks.values()
    ]
)
if not checks.empty:
    st.subheader("Fitted check (Kong's model per K)")
    ui.dataframe(
        checks,
        hide_index=True,
        width="stretch",
        key="planner_checks",
        column_config={
            "k": st.column_config.NumberColumn("K"),
            "status": st.column_config.TextColumn("fit"),
            "n_points": st.column_config.NumberColumn("points"),
            "c1_s": st.column_config.NumberColumn("C1: latency at zero load (s)", format="%.3f"),
            "saturation_rps": st.column_config.NumberColumn("saturation 1/C2 (requests/s)", format="%.2f"),
            "relative_rmse": st.column_config.NumberColumn("fit error (RMSE / mean)", format="percent"),
            "engine_model_error": st.column_config.NumberColumn("engine model error at the points", format="percent"),
        },
    )
