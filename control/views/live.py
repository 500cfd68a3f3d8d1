"""The Live page's data: one host's state now and its samples over a window."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pandas as pd

from ..store import Store
from .common import (
    STATE_TIMEOUT_S,
    HostStatus,
    engine_client,
    host_status,
    samples_frame,
    stored_samples,
    version_in_force,
)
from .history import version_markers


def per_request_line(status: HostStatus) -> str | None:
    """One line on draft length per request: how many running requests had their drafts
    verified in the last step, how per-request acceptance is spread (requests per
    acceptance bin), and where a new request's estimate starts (per request class where the
    engine reports classes; over the class's finished requests under the mixture prior, over
    its recent draft tokens under the pooled one), how drafts are priced (``gain``) and, under async
    scheduling, how many steps pass between probes of every request now (more than configured
    while probes find nothing that pays). None when the engine does not report it (no
    speculation, older engine)."""
    pr = status.per_request or {}
    if not pr or not status.k_max_engine:
        return None
    if not pr.get("enabled"):
        return "Draft length per request: off (every request verifies the step's K; adaptive mode turns it on)"
    bins = pr.get("acceptance_bins") or []
    hist = pr.get("acceptance_hist") or []
    spread = ", ".join(
        f"{n} at {lo:.0%}-{(bins[i + 1] if i + 1 < len(bins) else 1.0):.0%}"
        for i, (lo, n) in enumerate(zip(bins, hist))
        if n
    )
    prior = pr.get("prior_acceptance")
    start = f" · a new request starts at {prior:.0%}" if isinstance(prior, (int, float)) else ""
    by_class = {c: v for c, v in (pr.get("prior_acceptance_by_class") or {}).items() if isinstance(v, (int, float))}
    if start and by_class:
        start = " · a new request starts at " + ", ".join(f"{v:.0%} ({c})" for c, v in sorted(by_class.items()))
    source = {
        "mixture": "the finished requests of its class (its recent draft tokens until enough have finished)",
        "pooled": "the recent draft tokens of its class",
    }
    if start and pr.get("prior") in source:
        start += f", from {source[pr['prior']]}"
    priced = {
        "calibrated": " · drafts priced by what drafts at a like acceptance yielded",
        "geometric": " · drafts priced by the geometric law",
    }.get(str(pr.get("gain")), "")
    probes = ""
    every, now = pr.get("probe_every_steps"), pr.get("probe_interval_steps")
    if isinstance(now, int) and isinstance(every, int):
        probes = f" · probes every {now} steps" + (
            f" (backed off from {every}: the last probes found nothing that pays)" if now > every else ""
        )
    return (
        f"Draft length per request: {pr.get('requests_verified', 0)} of {pr.get('requests_with_drafts', 0)} "
        f"requests with drafts verified them in the last step · per-request acceptance: {spread or 'no data yet'}"
        f"{start}{priced}{probes}"
    )


def routing_summary(router: dict[str, Any]) -> str | None:
    """One line on a dual engine host's routing from its ``router`` section, e.g.
    ``routing auto · speculative engine resting: probes of 1 s every 80 s at 10%, next in
    31 s · TPOT plain 4.1 ms, speculative 10.6 ms`` (the interval as backed off now); None
    for a single engine host."""
    if not router or not router.get("mode"):
        return None
    parts = [f"routing {router['mode']}"]
    p = router.get("p_speculative")
    if router["mode"] == "auto" and isinstance(p, (int, float)):
        settings = router.get("settings") or {}
        if router.get("resting") and settings.get("probe_every_s"):
            probes = router.get("probes") or {}
            every = probes.get("every_s", settings["probe_every_s"])
            share = (
                f"speculative engine resting: probes of {settings.get('probe_s', 1):g} s every "
                f"{every:g} s at {settings.get('p_probe', 0):.0%}"
            )
            if isinstance(probes.get("next_in_s"), (int, float)):
                share += " (probing now)" if probes["next_in_s"] <= 0 else f", next in {probes['next_in_s']:.0f} s"
        else:
            share = f"{p:.0%} to the speculative engine"
        parts.append(share)
    tpot = router.get("tpot_ms") or {}
    shown = [f"{e} {v:.1f} ms" for e, v in tpot.items() if isinstance(v, (int, float))]
    if shown:
        parts.append("TPOT " + ", ".join(shown))
    return " · ".join(parts)


@dataclass
class LiveView:
    """Everything the Live page draws for one host.

    Attributes:
        status: the host now (up or down).
        series: per-second samples of the window (:func:`samples_frame` columns).
        markers: config changes in the window: ``t`` (UTC), ``version``, ``label``,
            ``author``, ``reason``.
        acceptance_per_position: ``position`` (1..K), ``measured`` (window mean of
            accepted/drafted at that position, 0..1), ``estimated`` (the controller's
            P(positions 1..i all accepted), 0..1; None where the controller has not
            measured the position yet), ``after_full`` and ``otherwise`` (the same for
            requests whose previous draft was accepted whole, and for the rest: the
            controller's run states, ``engine_host.run_acceptance``; None where not
            measured, or from an engine host that does not keep them).
        goodput_by_k: ``k``, ``predicted_goodput_tokens_per_s``, ``expected_tokens_per_step``,
            ``step_time_ms`` from the controller (why it chose K).
        source: ``store`` (collector samples) or ``engine`` (the host's own ring buffer).
        window_s: the window (seconds).
        version_in_force: the control plane's config version applied last on this host
            (the History page's number), None when the store has none.
    """

    status: HostStatus
    series: pd.DataFrame
    markers: pd.DataFrame
    acceptance_per_position: pd.DataFrame
    goodput_by_k: pd.DataFrame
    source: str
    window_s: float
    version_in_force: int | None = None

    def latest(self, column: str) -> Any:
        """Last non-null value of a series column (None when there is none)."""
        if self.series.empty or column not in self.series:
            return None
        col = self.series[column].dropna()
        return None if col.empty else col.iloc[-1].item() if hasattr(col.iloc[-1], "item") else col.iloc[-1]

    def window_mean(self, column: str) -> float | None:
        """Mean of a column over the window (None when empty)."""
        if self.series.empty or column not in self.series:
            return None
        col = self.series[column].dropna()
        return None if col.empty else float(col.mean())


def markers_from_series(series: pd.DataFrame) -> pd.DataFrame:
    """Config changes seen in samples (where ``config_version`` changes)."""
    cols = ["t", "version", "label", "author", "reason"]
    if series.empty or series["config_version"].dropna().empty:
        return pd.DataFrame(columns=cols)
    v = series[["t", "config_version"]].dropna()
    changed = v[v["config_version"].diff().fillna(0) != 0]
    return pd.DataFrame(
        {
            "t": changed["t"].values,
            "version": changed["config_version"].astype(int).values,
            "label": [f"v{int(x)}" for x in changed["config_version"]],
            "author": None,
            "reason": None,
        },
        columns=cols,
    )


def acceptance_table(series: pd.DataFrame, controller: dict[str, Any]) -> pd.DataFrame:
    """Acceptance per draft position: ``position`` (1..K), ``measured`` (window mean,
    0..1), ``estimated`` (the controller's estimate, 0..1), ``after_full`` and ``otherwise``
    (its estimates by run state, 0..1: ``acceptance_by_run_state``). An estimate the controller
    marks as unmeasured (``acceptance_measured`` false at that position, or
    ``acceptance_per_position`` entries that are None) is None: its prior is not a
    measurement."""
    measured: list[list[float]] = []
    if not series.empty:
        for per_pos in series["acceptance_per_position"].dropna():
            if isinstance(per_pos, (list, tuple)):
                for i, v in enumerate(per_pos):
                    while len(measured) <= i:
                        measured.append([])
                    if v is not None:
                        measured[i].append(float(v))
    est = list(controller.get("acceptance_per_position") or [])
    flags = controller.get("acceptance_measured")
    if isinstance(flags, (list, tuple)):
        est = [e if i < len(flags) and flags[i] else None for i, e in enumerate(est)]
    elif controller.get("acceptance_is_prior"):
        est = [None] * len(est)
    states = controller.get("acceptance_by_run_state") or {}
    after = list(states.get("after_full_acceptance_per_position") or [])
    other = list(states.get("otherwise_acceptance_per_position") or [])
    n = max(len(measured), len(est))
    return pd.DataFrame(
        {
            "position": list(range(1, n + 1)),
            "measured": [
                (sum(m) / len(m)) if i < len(measured) and measured[i] else None
                for i, m in enumerate(measured + [[]] * (n - len(measured)))
            ],
            "estimated": [est[i] if i < len(est) else None for i in range(n)],
            "after_full": [after[i] if i < len(after) else None for i in range(n)],
            "otherwise": [other[i] if i < len(other) else None for i in range(n)],
        }
    )


def best_k(goodput: pd.DataFrame, k_min: int | None = None, k_max: int | None = None) -> int | None:
    """The K with the highest predicted goodput among ``k_min..k_max`` (the range the
    controller may choose from; all K when unbounded), None when there is no prediction."""
    if goodput.empty:
        return None
    df = goodput.dropna(subset=["predicted_goodput_tokens_per_s"])
    if k_min is not None:
        df = df[df["k"] >= k_min]
    if k_max is not None:
        df = df[df["k"] <= k_max]
    if df.empty:
        return None
    return int(df.loc[df["predicted_goodput_tokens_per_s"].astype(float).idxmax(), "k"])


def goodput_table(controller: dict[str, Any]) -> pd.DataFrame:
    """The controller's prediction per K: ``k``, ``predicted_goodput_tokens_per_s``
    (tokens/s), ``expected_tokens_per_step`` (tokens), ``step_time_ms`` (ms)."""
    g = controller.get("predicted_goodput_tokens_per_s") or {}
    e = controller.get("expected_tokens_per_step") or {}
    st_ = controller.get("step_time_ms") or {}
    ks = sorted({int(k) for k in (*g, *e, *st_)})
    return pd.DataFrame(
        {
            "k": ks,
            "predicted_goodput_tokens_per_s": [g.get(str(k), g.get(k)) for k in ks],
            "expected_tokens_per_step": [e.get(str(k), e.get(k)) for k in ks],
            "step_time_ms": [st_.get(str(k), st_.get(k)) for k in ks],
        }
    )


def live_view(store: Store, name: str, window_s: float = 600.0) -> LiveView:
    """The Live page's data for one host over the last ``window_s`` seconds.

    Samples come from the store (the collector's 1 s samples); when the store holds
    none for the window (collector not running yet) the engine host's own ring buffer
    (last 10 minutes) is used. A host that is down gives ``status.up == False`` and
    whatever the store still holds.

    Raises:
        ViewError: no host of that name.
    """
    status = host_status(store, name)
    since = time.time() - window_s
    source = "store"
    try:
        samples = stored_samples(store, name, since=since)
    except Exception:
        samples = []
    if not samples and status.up:
        try:
            samples = engine_client(store, name).samples(since)
            source = "engine"
        except Exception:
            samples = []
    series = samples_frame(samples)
    markers = version_markers(store, name, since)
    if markers.empty:
        markers = markers_from_series(series)
    return LiveView(
        status=status,
        series=series,
        markers=markers,
        acceptance_per_position=acceptance_table(series, status.controller),
        goodput_by_k=goodput_table(status.controller),
        source=source,
        window_s=window_s,
        version_in_force=version_in_force(store, name),
    )


__all__ = [
    "LiveView",
    "STATE_TIMEOUT_S",
    "acceptance_table",
    "goodput_table",
    "live_view",
    "markers_from_series",
    "per_request_line",
    "routing_summary",
    "best_k",
]
