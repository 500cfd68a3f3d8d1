"""Presentation helpers shared by the dashboard's pages: session user, host picker,
alert banner, Plotly figure conventions (units on every axis, one colour per meaning,
config changes as markers), and cached reads.

Nothing here decides or queries anything by itself: data comes from the view modules
(``control.views.*``), given the store opened once per process (:func:`store`).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from control.views import alerts as alert_views
from control.views import common
from control.views.common import Store, User

# One colour per meaning, colour-blind safe (Okabe-Ito), same on every page.
COLORS = {
    "p50": "#0072B2",  # blue
    "p95": "#E69F00",  # orange
    "p99": "#D55E00",  # vermillion
    "throughput": "#009E73",  # green
    "kv": "#CC79A7",  # purple
    "running": "#0072B2",
    "waiting": "#D55E00",
    "cap": "#555555",
    "acceptance": "#009E73",
    "k": "#000000",
    "marker": "#7F7F7F",
    "bad": "#D55E00",
    "good": "#009E73",
}
K_COLORS = ["#000000", "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#7F7F7F"]
CHART_HEIGHT = 285


def current_user() -> User | None:
    """The logged-in user of this browser session (None before login)."""
    return st.session_state.get("user")


def require_user() -> User:
    """The logged-in user; stops the page when there is none (the router shows the login)."""
    user = current_user()
    if user is None:
        st.stop()
    return user


@st.cache_resource(show_spinner=False)
def _store(url: str | None) -> Store:
    return common.open_store(url)


def store() -> Store:
    """The control plane's store, opened (and migrated) once per process and held in
    ``st.cache_resource``: ``--db`` / ``$SPECPILOT_DB``, else the SQLite file in
    ``$SPECPILOT_HOME``. Every view gets it as its first argument."""
    return _store(common.db_url())


@st.cache_data(ttl=10, show_spinner=False)
def _cached_hosts(url: str | None) -> list[common.HostInfo]:
    return common.list_hosts(store())


def cached_hosts() -> list[common.HostInfo]:
    """Registered hosts (refreshed every 10 s)."""
    return _cached_hosts(common.db_url())


def host_picker(label: str = "Host", key: str = "host", allow_all: bool = False) -> str | None:
    """A host selector shared across pages (the choice follows the user from page to
    page). Returns the host name, None for "all hosts", or stops when none is registered."""
    hosts = [h.name for h in cached_hosts()]
    if not hosts:
        st.info("No engine host is registered yet. Add one with `python -m control hosts add NAME URL`.")
        st.stop()
    options = (["All hosts"] if allow_all else []) + hosts
    chosen = None if allow_all else st.session_state.get("selected_host")
    index = options.index(chosen) if chosen in options else 0
    value = st.selectbox(label, options, index=index, key=key)
    if value != "All hosts":
        st.session_state["selected_host"] = value
        return value
    return None


def alert_banner() -> None:
    """Open alerts across the fleet, on top of every page (nothing when all is well)."""
    try:
        summary = _cached_alert_summary()
    except Exception as exc:  # a broken store must not break every page
        st.warning(f"Alerts unavailable: {common.describe_error(exc)}")
        return
    if summary.open_count:
        text = "; ".join(summary.lines[:3]) + (f" (+{summary.open_count - 3} more)" if summary.open_count > 3 else "")
        st.error(
            f"**{summary.open_count} open alert{'s' if summary.open_count != 1 else ''}**: {text}",
            icon=":material/notifications_active:",
        )


def _cached_alert_summary() -> alert_views.AlertSummary:
    return _alert_summary(common.db_url())


@st.cache_data(ttl=5, show_spinner=False)
def _alert_summary(url: str | None) -> alert_views.AlertSummary:
    return alert_views.alert_summary(store())


def fmt(value: Any, unit: str = "", digits: int = 0) -> str:
    """A number for a metric tile: '—' when unknown."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, float):
        text = f"{value:,.{digits}f}"
    else:
        text = f"{value:,}"
    return f"{text} {unit}".strip()


def fmt_ms(value: Any) -> str:
    """A latency for a metric tile, short enough never to be cut: ``4.1 ms``,
    ``485 ms``, ``2.49 s``, ``19.9 s``, ``125 s``; '—' when unknown."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    v = float(value)
    if v < 10:
        return f"{v:.1f} ms"
    if v < 1000:
        return f"{v:.0f} ms"
    if v < 10_000:
        return f"{v / 1000:.2f} s"
    if v < 100_000:
        return f"{v / 1000:.1f} s"
    return f"{v / 1000:,.0f} s"


def fmt_rate(value: Any, unit: str) -> str:
    """A rate for a metric tile, at most 4 significant figures: ``812 tok/s``,
    ``2,485 tok/s``, ``19.9k tok/s``; '—' when unknown."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    v = float(value)
    if v < 10:
        return f"{v:.1f} {unit}"
    if v < 10_000:
        return f"{v:,.0f} {unit}"
    if v < 1_000_000:
        return f"{v / 1000:.1f}k {unit}"
    return f"{v / 1e6:.2f}M {unit}"


def wrap_tiles() -> None:
    """Metric tiles wrap a long value onto a second line instead of cutting it with
    '…' (Streamlit cuts by default), with a value font that fits 4 tiles a row at 800 px."""
    st.html(
        "<style>[data-testid='stMetricValue'], [data-testid='stMetricValue'] > div {"
        "white-space: normal !important; overflow: visible !important; text-overflow: clip !important;"
        "overflow-wrap: anywhere; font-size: clamp(1.1rem, 2.2vw, 1.8rem) !important; line-height: 1.2;}"
        "</style>"
    )


def _arr(values: Any) -> Any:
    """A column as a plain array for Plotly: numbers as float64 (NaN for gaps), UTC
    timestamps as naive datetime64 (the axes say UTC), anything else as a list."""
    if isinstance(values, pd.Series):
        if isinstance(values.dtype, pd.DatetimeTZDtype):
            return values.dt.tz_convert(None).to_numpy()
        if pd.api.types.is_numeric_dtype(values.dtype):
            return values.to_numpy(dtype="float64", na_value=float("nan"))
        return values.tolist()
    if isinstance(values, np.ndarray):
        return values
    return list(values)


def _t(value: Any) -> Any:
    """One timestamp for a shape or annotation (naive UTC, ISO text)."""
    ts = pd.Timestamp(value)
    if ts.tzinfo is not None:
        ts = ts.tz_convert(None)
    return ts.isoformat()


def new_fig() -> dict[str, Any]:
    """An empty figure as a plain dict.

    Figures are built as dicts and handed to Plotly without validation: building them
    through ``plotly.graph_objects`` (validation, template deep copies) cost about
    0.1 s per chart, most of the Live page's render time.
    """
    return {"data": [], "layout": {"shapes": [], "annotations": []}}


def base_layout(
    fig: dict[str, Any],
    title: str,
    y_title: str,
    x_title: str = "time (UTC)",
    height: int = CHART_HEIGHT,
    y_range: list[float] | None = None,
) -> dict[str, Any]:
    """Common look: title, axis titles with units, legend on top, white background,
    light grid, little chrome."""
    axis = {
        "showgrid": True,
        "gridcolor": "#EEEEEE",
        "zeroline": True,
        "zerolinecolor": "#CCCCCC",
        "linecolor": "#CCCCCC",
        "automargin": True,
        "title": {"font": {"size": 13, "color": "#444"}},
    }
    x = {**axis, "title": {**axis["title"], "text": x_title}}
    if x_title.startswith("time"):
        x.update(
            {
                "type": "date",
                "hoverformat": "%H:%M:%S",
                "tickformatstops": [
                    {"dtickrange": [None, 60_000], "value": "%H:%M:%S"},
                    {"dtickrange": [60_000, 86_400_000], "value": "%H:%M"},
                    {"dtickrange": [86_400_000, None], "value": "%b %d"},
                ],
            }
        )
    y = {**axis, "title": {**axis["title"], "text": y_title}, "rangemode": "tozero"}
    if y_range is not None:
        y["range"] = y_range
    fig["layout"].update(
        {
            "title": {"text": title, "x": 0, "xanchor": "left", "font": {"size": 15, "color": "#222"}},
            "height": height,
            "margin": {"l": 60, "r": 20, "t": 60, "b": 80},
            # Below the plot: above it, the legend would cover the config-version labels.
            "legend": {
                "orientation": "h",
                "yref": "container",
                "yanchor": "bottom",
                "y": 0.01,
                "x": 0,
                "xanchor": "left",
                "font": {"size": 12},
            },
            "paper_bgcolor": "white",
            "plot_bgcolor": "white",
            "hovermode": "x unified",
            "font": {"size": 13, "color": "#222", "family": "sans-serif"},
            "xaxis": {**x, **fig["layout"].get("xaxis", {})},
            "yaxis": {**y, **fig["layout"].get("yaxis", {})},
        }
    )
    return fig


def note(fig: dict[str, Any], text: str) -> None:
    """A grey note in the middle of an empty chart (says why it is empty)."""
    fig["layout"]["annotations"].append(
        {
            "x": 0.5,
            "y": 0.5,
            "xref": "paper",
            "yref": "paper",
            "text": text,
            "showarrow": False,
            "font": {"size": 13, "color": "#777"},
        }
    )


def add_config_markers(fig: dict[str, Any], markers: pd.DataFrame, show_labels: bool = True) -> dict[str, Any]:
    """Config changes as dotted vertical lines labelled with the version (``v12``).

    ``markers`` has columns ``t`` (datetime, UTC) and ``label``.
    """
    if markers is None or markers.empty:
        return fig
    for row in markers.itertuples(index=False):
        vline(fig, row.t, COLORS["marker"], dash="dot", width=1)
        if show_labels:
            fig["layout"]["annotations"].append(
                {
                    "x": _t(row.t),
                    "y": 1.0,
                    "xref": "x",
                    "yref": "paper",
                    "text": str(row.label),
                    "showarrow": False,
                    "yanchor": "bottom",
                    "font": {"size": 11, "color": "#444"},
                    "bgcolor": "rgba(255,255,255,0.8)",
                }
            )
    return fig


def vline(fig: dict[str, Any], x: Any, color: str, dash: str = "dot", width: float = 1.0) -> None:
    """A vertical line across the plot at ``x`` (a time or a number)."""
    xv = _t(x) if isinstance(x, (pd.Timestamp, np.datetime64)) or hasattr(x, "tzinfo") else x
    fig["layout"]["shapes"].append(
        {
            "type": "line",
            "x0": xv,
            "x1": xv,
            "xref": "x",
            "y0": 0,
            "y1": 1,
            "yref": "paper",
            "line": {"color": color, "width": width, "dash": dash},
        }
    )


def hline(
    fig: dict[str, Any], y: float, color: str, text: str | None = None, dash: str = "dash", width: float = 1.5
) -> None:
    """A horizontal line across the plot at ``y`` with an optional label at its left end."""
    fig["layout"]["shapes"].append(
        {
            "type": "line",
            "x0": 0,
            "x1": 1,
            "xref": "paper",
            "y0": y,
            "y1": y,
            "yref": "y",
            "line": {"color": color, "width": width, "dash": dash},
        }
    )
    if text:
        fig["layout"]["annotations"].append(
            {
                "x": 0,
                "xref": "paper",
                "xanchor": "left",
                "y": y,
                "yref": "y",
                "yanchor": "bottom",
                "text": text,
                "showarrow": False,
                "font": {"size": 11, "color": color},
            }
        )


def line(
    fig: dict[str, Any],
    x: Iterable[Any],
    y: Iterable[Any],
    name: str,
    color: str,
    dash: str | None = None,
    width: float = 2.0,
    shape: str = "linear",
    mode: str = "lines",
    showlegend: bool = True,
) -> None:
    """Add one line trace with the dashboard's conventions."""
    fig["data"].append(
        {
            "type": "scatter",
            "x": _arr(x),
            "y": _arr(y),
            "name": name,
            "mode": mode,
            "line": {"color": color, "width": width, "dash": dash or "solid", "shape": shape},
            "marker": {"color": color},
            "connectgaps": False,
            "showlegend": showlegend,
        }
    )


def points(
    fig: dict[str, Any],
    x: Iterable[Any],
    y: Iterable[Any],
    name: str,
    color: str,
    size: float = 6,
    opacity: float = 0.5,
    showlegend: bool = False,
) -> None:
    """Add a scatter of markers (measured points)."""
    fig["data"].append(
        {
            "type": "scatter",
            "x": _arr(x),
            "y": _arr(y),
            "name": name,
            "mode": "markers",
            "marker": {"color": color, "size": size, "opacity": opacity, "line": {"width": 0}},
            "showlegend": showlegend,
        }
    )


def bar(fig: dict[str, Any], x: Iterable[Any], y: Iterable[Any], name: str, color: Any, **extra: Any) -> None:
    """Add a bar trace (``color`` one colour or one per bar)."""
    fig["data"].append({"type": "bar", "x": _arr(x), "y": _arr(y), "name": name, "marker": {"color": color}, **extra})


def show(fig: dict[str, Any], key: str | None = None) -> None:
    """Render a figure (no validation: see :func:`new_fig`) without Plotly's mode bar."""
    st.plotly_chart(
        go.Figure(fig, _validate=False),
        width="stretch",
        key=key,
        theme=None,
        config={"displayModeBar": False, "displaylogo": False},
    )


def no_none(df: pd.DataFrame, digits: int = 2) -> Any:
    """A Styler that shows missing values as '—' (never "None") and numbers with
    ``digits`` decimals (whole numbers without)."""

    def number(v: Any) -> str:
        if isinstance(v, bool):
            return str(v)
        if isinstance(v, (int, np.integer)) or (isinstance(v, float) and v.is_integer()):
            return f"{v:,.0f}"
        return f"{v:,.{digits}f}"

    num = [c for c in df.columns if pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])]
    return df.style.format(na_rep="—").format(number, subset=num, na_rep="—")


def color_cells(
    df: pd.DataFrame, column: str, good: Iterable[str], bad: Iterable[str], formats: dict[str, str] | None = None
) -> Any:
    """A Styler that colours ``column``'s text: green for ``good`` values, red and bold
    for ``bad`` ones, orange for anything else (fonts without emoji still show it).
    Numbers show with 2 decimals unless ``formats`` (column -> format string) says
    otherwise; missing values show as '—'."""
    good, bad = set(good), set(bad)

    def style(v: Any) -> str:
        if v in good:
            return f"color: {COLORS['good']}; font-weight: 600"
        if v in bad:
            return f"color: {COLORS['bad']}; font-weight: 700"
        return "color: #B8860B; font-weight: 600" if v else ""

    styler = df.style.map(style, subset=[column]).format(precision=2, na_rep="—")
    if formats:
        styler = styler.format({k: v for k, v in formats.items() if k in df.columns}, na_rep="—")
    return styler


def page_header(title: str, caption: str | None = None) -> None:
    """Page title and the alert banner."""
    alert_banner()
    st.title(title)
    if caption:
        st.caption(caption)


#: What a table shows in a cell without a value (Streamlit's default is the word "None").
EMPTY_CELL = "—"


def dataframe(data: Any, **kwargs: Any) -> Any:
    """``st.dataframe`` with empty cells shown as :data:`EMPTY_CELL`, never "None"."""
    kwargs.setdefault("placeholder", EMPTY_CELL)
    return st.dataframe(data, **kwargs)
