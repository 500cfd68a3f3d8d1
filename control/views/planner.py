"""The Planner page's data: :func:`planner_report` reads a host's stored samples and live
state and hands them to :func:`control.planner.plan` (the engine model, Kong et al.'s
fitted check; :mod:`control.planner` holds both). The older fit-only view
(:func:`planner_view`) stays for its callers."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pandas as pd

from .. import planner
from ..planner import PlannerError, curve, what_if, workload_from_samples  # noqa: F401  (the page's)
from ..store import Store
from .common import describe_error, engine_client, get_host, open_store, stored_samples


@dataclass
class PlannerView:
    """The Planner page's data for one host.

    Attributes:
        fits: fitted model per K (:class:`control.planner.LatencyFit`).
        problems: K -> why it could not be fitted.
        points: measured points (``k``, ``rate_rps``, ``latency_s``, ``t_start``, ``n_requests``).
        days: how far back the samples go (days).
        window_s: window of samples per measured point (seconds).
    """

    fits: dict[int, planner.LatencyFit]
    problems: dict[int, str]
    points: pd.DataFrame
    days: float
    window_s: float


def planner_view(name: str, days: float = 7.0, window_s: float = 60.0, store: Store | None = None) -> PlannerView:
    """Fit Kong et al.'s latency model per K from the host's stored samples of the last
    ``days`` days (points of ``window_s`` seconds at constant K); ``store`` defaults to
    the dashboard's (:func:`control.views.common.open_store`)."""
    store = store or open_store()
    since = time.time() - days * 86400.0
    samples = stored_samples(store, name, since=since, resolution_s=1 if window_s < 60 else 60)
    pts = planner.points_from_samples(samples, window_s=window_s)
    fits, problems = planner.fit_per_k(pts)
    df = pd.DataFrame([p.__dict__ for p in pts], columns=["k", "rate_rps", "latency_s", "t_start", "n_requests"])
    return PlannerView(fits=fits, problems=problems, points=df, days=days, window_s=window_s)


def planner_points_for_display(view: PlannerView, max_per_k: int = 120) -> pd.DataFrame:
    """Measured points to draw: each K's points as they are when there are at most
    ``max_per_k``, else binned by request rate (``max_per_k`` equal-width bins) to the
    mean rate and mean latency of each bin. Columns ``k``, ``rate_rps`` (requests/s),
    ``latency_s`` (seconds), ``n`` (windows behind the point). The fit always uses every
    point; this only keeps the chart light (thousands of SVG markers take seconds to draw)."""
    cols = ["k", "rate_rps", "latency_s", "n"]
    if view.points.empty:
        return pd.DataFrame(columns=cols)
    frames = []
    for k, g in view.points.groupby("k"):
        if len(g) <= max_per_k:
            frames.append(g.assign(n=1)[cols])
            continue
        bins = pd.cut(g["rate_rps"], bins=max_per_k)
        agg = (
            g.groupby(bins, observed=True)
            .agg(rate_rps=("rate_rps", "mean"), latency_s=("latency_s", "mean"), n=("latency_s", "size"))
            .reset_index(drop=True)
        )
        frames.append(agg.assign(k=k)[cols])
    return pd.concat(frames, ignore_index=True)


def planner_curves(view: PlannerView, rate_max_rps: float | None = None, n: int = 200) -> pd.DataFrame:
    """Predicted mean latency against request rate for every fitted K: ``k``,
    ``rate_rps`` (requests/s), ``latency_s`` (seconds), up to ``rate_max_rps`` (default
    1.2x the highest saturation rate or measured rate)."""
    if not view.fits:
        return pd.DataFrame(columns=["k", "rate_rps", "latency_s"])
    if rate_max_rps is None:
        finite = [f.saturation_rps for f in view.fits.values() if math.isfinite(f.saturation_rps)]
        measured = float(view.points["rate_rps"].max()) if not view.points.empty else 1.0
        rate_max_rps = 1.1 * max(finite + [measured])
    frames = []
    for k, f in sorted(view.fits.items()):
        r, lat = planner.curve(f, rate_max_rps, n=n)
        frames.append(pd.DataFrame({"k": k, "rate_rps": r, "latency_s": lat}))
    return pd.concat(frames, ignore_index=True)


def planner_inputs(
    store: Store, name: str, days: float = 7.0, window_s: float = 60.0
) -> tuple[list[dict], dict | None, str | None]:
    """What the planner reads for one host: its stored samples of the last ``days`` days
    (1 s rows for points under a minute, else 60 s rows) and its live ``/control/state``.

    Returns:
        ``(samples, state, down)``: ``state`` is None when the host is down, ``down`` says why.
    Raises:
        ViewError: no host of that name.
    """
    get_host(store, name)
    samples = stored_samples(store, name, since=time.time() - days * 86400.0, resolution_s=1 if window_s < 60 else 60)
    try:
        return samples, engine_client(store, name).state(), None
    except Exception as exc:  # down, refused, timeout: the engine model says "not enough data"
        return samples, None, describe_error(exc)


def planner_report(
    samples: list[dict],
    state: dict | None,
    window_s: float = 60.0,
    *,
    rate_rps: float | None = None,
    latency_slo_s: float | None = None,
    output_tokens: float | None = None,
    prefill_s: float | None = None,
) -> planner.PlannerReport:
    """:func:`control.planner.plan` on what :func:`planner_inputs` read; the what-if
    inputs: ``rate_rps``, ``latency_slo_s``, ``output_tokens``, ``prefill_s``.

    Raises:
        control.planner.PlannerError: a what-if value is invalid.
    """
    return planner.plan(
        samples,
        state,
        window_s=window_s,
        rate_rps=rate_rps,
        latency_slo_s=latency_slo_s,
        output_tokens=output_tokens,
        prefill_s=prefill_s,
    )


__all__ = [
    "PlannerError",
    "PlannerView",
    "curve",
    "workload_from_samples",
    "planner_curves",
    "planner_inputs",
    "planner_points_for_display",
    "planner_report",
    "planner_view",
    "what_if",
]
