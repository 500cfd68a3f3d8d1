"""The Cost review page's data: the control plane's weekly report (:mod:`control.cost`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pandas as pd

from .. import cost as cost_mod
from ..store import Store
from .common import list_hosts, utc


@dataclass
class WeeklyReport:
    """The weekly cost review.

    Attributes:
        start, end: the week (UTC).
        summary: one row per host: ``host``, ``usd`` (cost of the week), ``output_tokens``,
            ``usd_per_million_tokens``, ``utilisation`` (0..1), ``baseline_usd_per_million_tokens``,
            ``saving_usd`` (against the baseline), ``saving_frac`` (0..1).
        daily: one row per host and day: ``host``, ``day`` (date), ``usd``, ``output_tokens``,
            ``usd_per_million_tokens``, ``utilisation``.
        baseline: what the saving is measured against (text).
        csv: the report as CSV (bytes, UTF-8).
        unpriced_hosts: hosts of the report with no price set (``usd_per_hour`` 0 or
            unset): their cost reads 0 until a price is set.
    """

    start: datetime
    end: datetime
    summary: pd.DataFrame
    daily: pd.DataFrame
    baseline: str
    csv: bytes
    unpriced_hosts: list[str] | None = None


SUMMARY_COLUMNS = [
    "host",
    "usd",
    "output_tokens",
    "usd_per_million_tokens",
    "utilisation",
    "baseline_usd_per_million_tokens",
    "saving_usd",
    "saving_frac",
    "busy_tokens_per_s",
    "acceptance_rate",
    "mean_k",
    "uptime_h",
    "baseline_note",
]
DAILY_COLUMNS = ["host", "day", "usd", "output_tokens", "usd_per_million_tokens", "utilisation"]

#: How to set a host's price (shown when none is set).
SET_PRICE = "python -m control hosts add NAME URL --usd-per-hour PRICE --update"


def report_from_cost(rep: Any) -> WeeklyReport:
    """A :class:`control.cost.WeeklyReport` as the dashboard's :class:`WeeklyReport`."""
    summary = pd.DataFrame([{**h, "saving_frac": h.get("saving_fraction")} for h in rep.hosts])
    summary = summary.reindex(columns=SUMMARY_COLUMNS)
    daily = pd.DataFrame(rep.days).reindex(columns=DAILY_COLUMNS)
    if not daily.empty:
        daily["day"] = pd.to_datetime(daily["day"]).dt.date
    base = "K = 0 (no speculation)" if rep.baseline == "k0" else rep.baseline.replace("version:", "config version ")
    start, end = utc(rep.start), utc(rep.end)
    assert start is not None and end is not None
    return WeeklyReport(
        start=start, end=end, summary=summary, daily=daily, baseline=base, csv=rep.to_csv().encode("utf-8")
    )


def weekly_report(
    store: Store, host: str | None = None, end: datetime | None = None, baseline: str = "k0"
) -> WeeklyReport:
    """The weekly cost report from the control plane's cost model
    (:func:`control.cost.weekly_report`, the same figures as ``python -m control report
    weekly``) for the 7 days before ``end`` (all hosts, or one), read now (prices as
    they are now).

    Args:
        baseline: ``k0`` (no speculation) or ``version:N`` (that config version's period).
    Raises:
        control.cost.BadBaseline: an unknown baseline.
    """
    rep = cost_mod.weekly_report(store, end=None if end is None else end.timestamp(), host=host, baseline=baseline)
    out = report_from_cost(rep)
    out.unpriced_hosts = [
        h.name for h in list_hosts(store) if (host is None or h.name == host) and not (h.usd_per_hour or 0) > 0
    ]
    return out


__all__ = ["DAILY_COLUMNS", "SET_PRICE", "SUMMARY_COLUMNS", "WeeklyReport", "report_from_cost", "weekly_report"]
