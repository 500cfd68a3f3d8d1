"""Live: one host's serving state now and over the last minutes, refreshed every 2 s.

Windowed TTFT/ITL P50/P95/P99, output tokens/s, KV cache usage, running and waiting
against the caps in force, acceptance overall and per draft position, K in force and
the controller's choice over time; config changes as dotted markers on every time chart.
"""

from __future__ import annotations

import streamlit as st

from control.views import common
from control.views import live as views
from dashboard import ui

ui.require_user()
ui.page_header("Live")

top = st.columns([2, 1, 3])
with top[0]:
    host = ui.host_picker()
with top[1]:
    window_min = st.selectbox(
        "Window", [5, 10, 30, 60], index=1, format_func=lambda m: f"last {m} min", key="live_window"
    )


def _status_line(view: views.LiveView) -> None:
    s = view.status
    if not s.up:
        last = view.series["t"].max() if not view.series.empty else None
        seen = f" Last sample stored {last:%H:%M:%S} UTC." if last is not None else ""
        st.error(f"### {s.name} is DOWN\n{s.error or 'no answer'}.{seen}", icon=":material/error:")
        return
    k_range = f"{s.k_min}..{s.k_max}" if s.mode in ("adaptive", "heuristic") else ""
    badge = ":green-badge[UP]" if s.phase == "ready" else f":orange-badge[{s.label}]"
    last_step = f", last step K={s.k_current}" if s.k_current is not None and s.k_current != s.k_next else ""
    version = "—" if view.version_in_force is None else f"v{view.version_in_force}"
    st.markdown(
        f"{badge} **{s.name}** · mode **{s.mode}** {k_range} · K in force **{ui.fmt(s.k_next)}**{last_step} "
        f"(engine K_max {s.k_max_engine}{', ' + s.speculation if s.speculation else ''}) · config **{version}** · "
        f"caps: {s.max_num_seqs} sequences, {s.max_num_batched_tokens} tokens/step"
    )
    st.caption(
        f"Config version: the control plane's version in force (History). The engine's own counter says "
        f"v{s.config_version}; it restarts at 1 with the engine."
        + (f" The engine core's step loop runs on CPU {s.core_cpu} of its own." if s.core_cpu is not None else "")
    )
    routing = views.routing_summary(s.router)
    if routing:
        st.caption(routing)


def _tiles(view: views.LiveView) -> None:
    s = view.status
    ui.wrap_tiles()
    row1, row2 = st.columns(4), st.columns(4)
    row1[0].metric("TTFT P99", ui.fmt_ms(view.latest("ttft_p99_ms")), help="time to first token, last 10 s window")
    row1[1].metric("ITL P99", ui.fmt_ms(view.latest("itl_p99_ms")), help="inter-token latency, last 10 s window")
    row1[2].metric(
        "Output",
        ui.fmt_rate(view.window_mean("output_tokens_per_s"), "tok/s"),
        help="output tokens per second, mean over the window",
    )
    acc = view.window_mean("acceptance_rate")
    row1[3].metric(
        "Acceptance", ui.fmt(None if acc is None else 100 * acc, "%"), help="accepted / drafted tokens over the window"
    )
    kv = view.latest("kv_cache_usage")
    row2[0].metric("KV cache", ui.fmt(None if kv is None else 100 * kv, "%"), help="fraction of KV cache blocks in use")
    running = s.running if s.up else view.latest("running")
    row2[1].metric("Running", f"{ui.fmt(running)} / {ui.fmt(s.max_num_seqs)}", help="running requests / cap in force")
    row2[2].metric("Waiting", ui.fmt(s.waiting if s.up else view.latest("waiting")), help="queued requests")
    row2[3].metric(
        "K in force",
        ui.fmt(s.k_next if s.up else view.latest("k")),
        help="draft tokens the policy uses for the next step",
    )


def _time_fig(
    view: views.LiveView,
    title: str,
    y_title: str,
    series: list[tuple[str, str, str, str | None]],
    y_range: list[float] | None = None,
    scale: float = 1.0,
    shape: str = "linear",
    empty_note: str = "no data in this window",
) -> dict:
    fig = ui.new_fig()
    df = view.series
    has_data = False
    for col, name, color, dash in series:
        if not df.empty and col in df:
            ui.line(fig, df["t"], df[col] * scale, name, color, dash=dash, shape=shape, showlegend=len(series) > 1)
            has_data = has_data or bool(df[col].notna().any())
    if not has_data:
        ui.note(fig, empty_note)
    ui.base_layout(fig, title, y_title, y_range=y_range)
    if not df.empty:
        fig["layout"]["xaxis"]["range"] = [ui._t(df["t"].min()), ui._t(df["t"].max())]
    ui.add_config_markers(fig, view.markers)
    return fig


def _charts(view: views.LiveView) -> None:
    s = view.status
    if view.series.empty:
        st.info(
            "No samples in this window yet: charts fill as requests are served "
            "(the collector stores one sample per second)."
        )
    c = ui.COLORS
    left, right = st.columns(2)
    with left:
        ui.show(
            _time_fig(
                view,
                "Time to first token (TTFT)",
                "TTFT (ms)",
                [
                    ("ttft_p50_ms", "P50", c["p50"], None),
                    ("ttft_p95_ms", "P95", c["p95"], None),
                    ("ttft_p99_ms", "P99", c["p99"], None),
                ],
            ),
            key="ttft",
        )
        ui.show(
            _time_fig(
                view,
                "Output throughput",
                "output tokens/s",
                [("output_tokens_per_s", "tokens/s", c["throughput"], None)],
            ),
            key="tps",
        )
        fig = _time_fig(
            view,
            "Running and waiting requests",
            "requests",
            [("running", "running", c["running"], None), ("waiting", "waiting", c["waiting"], None)],
            shape="hv",
        )
        # Scaled to the requests, not to the cap: 0-4 running under a cap of 128 must stay readable.
        data_max = max(
            [
                float(view.series[col].max())
                for col in ("running", "waiting")
                if not view.series.empty and view.series[col].notna().any()
            ]
            or [0.0]
        )
        top = max(1.0, data_max) * 1.25
        caps = view.series["max_num_seqs"].dropna() if not view.series.empty else []
        cap = s.max_num_seqs
        if len(caps) and caps.nunique() > 1 and float(caps.min()) <= top:
            ui.line(
                fig,
                view.series["t"],
                view.series["max_num_seqs"],
                "cap (max_num_seqs)",
                c["cap"],
                dash="dash",
                width=1.5,
                shape="hv",
            )
            top = max(top, float(caps.max()) * 1.05)
        elif cap and cap <= top * 1.5:
            ui.hline(fig, cap, c["cap"], text=f"cap {cap}")
            top = max(top, cap * 1.1)
        fig["layout"]["yaxis"]["range"] = [0, top]
        if cap and cap > top:
            fig["layout"]["title"]["text"] += f" (cap {cap}, above the scale)"
        ui.show(fig, key="running")
        fig = _time_fig(
            view,
            "Draft length K in force (controller's choice)",
            "K (draft tokens)",
            [("k", "K", c["k"], None)],
            shape="hv",
        )
        if s.k_max_engine:
            fig["layout"]["yaxis"].update(range=[-0.3, s.k_max_engine + 0.5], dtick=1)
        ui.show(fig, key="k")
    with right:
        ui.show(
            _time_fig(
                view,
                "Inter-token latency (ITL)",
                "ITL (ms)",
                [
                    ("itl_p50_ms", "P50", c["p50"], None),
                    ("itl_p95_ms", "P95", c["p95"], None),
                    ("itl_p99_ms", "P99", c["p99"], None),
                ],
            ),
            key="itl",
        )
        fig = _time_fig(
            view,
            "KV cache usage",
            "KV cache used (%)",
            [("kv_cache_usage", "KV cache", c["kv"], None)],
            y_range=[0, 100],
            scale=100.0,
        )
        ui.hline(fig, 90, c["bad"], text="alert 90%", width=1)
        ui.show(fig, key="kv")
        ui.show(
            _time_fig(
                view,
                "Acceptance rate (accepted / drafted tokens)",
                "acceptance (%)",
                [("acceptance_rate", "acceptance", c["acceptance"], None)],
                y_range=[0, 100],
                scale=100.0,
                empty_note="no drafted tokens in this window (K = 0: speculation off)",
            ),
            key="acc",
        )
        _acceptance_by_position(view)
    _controller_choice(view)


def _acceptance_by_position(view: views.LiveView) -> None:
    df = view.acceptance_per_position
    fig = ui.new_fig()
    no_estimate = not df.empty and df["estimated"].isna().all()
    if not df.empty:
        ui.bar(fig, df["position"], df["measured"].astype(float) * 100, "measured (window)", ui.COLORS["acceptance"])
        ui.bar(
            fig,
            df["position"],
            df["estimated"].astype(float) * 100,
            "controller estimate (all of 1..i accepted)",
            "#56B4E9",
        )
        for col, name, color in (
            ("after_full", "after a draft accepted whole", "#009E73"),
            ("otherwise", "after a rejected draft", "#CC79A7"),
        ):
            if col in df and not df[col].isna().all():
                ui.bar(fig, df["position"], df[col].astype(float) * 100, name, color)
    if df.empty:
        ui.note(fig, "no drafts measured in this window")
    elif no_estimate:
        ui.note(fig, "controller estimate: no data yet (no drafts measured since the engine started)")
    ui.base_layout(fig, "Acceptance per draft position", "accepted (%)", x_title="draft position", y_range=[0, 100])
    fig["layout"].update(hovermode="closest", barmode="group")
    fig["layout"]["xaxis"]["dtick"] = 1
    ui.show(fig, key="accpos")
    line = views.per_request_line(view.status)
    if line:
        st.caption(line)


def _controller_choice(view: views.LiveView) -> None:
    df = view.goodput_by_k
    if df.empty or df["predicted_goodput_tokens_per_s"].dropna().empty:
        return
    s = view.status
    k_now = s.k_next
    adaptive = s.mode in ("adaptive", "heuristic")
    best = views.best_k(df, s.k_min if adaptive else None, s.k_max if adaptive else None)
    colors = [ui.COLORS["good"] if k == k_now else "#BBBBBB" for k in df["k"]]
    fig = ui.new_fig()
    ui.bar(
        fig,
        df["k"],
        df["predicted_goodput_tokens_per_s"].astype(float),
        "predicted goodput",
        colors,
        customdata=df[["expected_tokens_per_step", "step_time_ms"]].astype(float).values.tolist(),
        hovertemplate="K=%{x}: %{y:.0f} tokens/s<br>E(K)=%{customdata[0]:.2f} tokens/step"
        "<br>T=%{customdata[1]:.1f} ms/step<extra></extra>",
    )
    mode = view.status.mode
    title = (
        f"Why K={k_now}: the controller's predicted goodput per K (green: in force)"
        if mode in ("adaptive", "heuristic", "threshold", "batch_table")
        else f"Controller's predicted goodput per K (green: K={k_now}, set by the operator in mode {mode})"
    )
    ui.base_layout(fig, title, "goodput (tokens/s)", x_title="K (draft tokens)", height=230)
    fig["layout"].update(hovermode="closest", showlegend=False)
    fig["layout"]["xaxis"]["dtick"] = 1
    ui.show(fig, key="goodput")
    if best is not None and k_now is not None and best != k_now:
        if adaptive:
            st.caption(
                f"K={k_now} is in force while the best predicted now is K={best}: the controller moves only "
                "when another K beats the one in force by its margin and hysteresis, and explores now and "
                "then; predictions are smoothed over recent steps."
            )
        else:
            st.caption(
                f"K={k_now} is set by the operator (mode {s.mode}); the controller would predict K={best} to be best."
            )


@st.fragment(run_every="2s")
def live_panel() -> None:
    """The refreshing part of the page (every 2 s, without reloading the page)."""
    try:
        view = views.live_view(ui.store(), host, window_s=window_min * 60.0)
    except Exception as exc:
        st.error(f"Live data unavailable: {common.describe_error(exc)}")
        return
    _status_line(view)
    _tiles(view)
    _charts(view)
    st.caption(
        f"Updated {view.status.checked_at:%H:%M:%S} UTC · samples from the "
        f"{'store (collector)' if view.source == 'store' else 'engine host (collector not running)'} · "
        "dotted lines: config changes"
    )


live_panel()
