"""The Alerts page's data and the banner on every page (:func:`control.alerts.events`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import pandas as pd

from .. import alerts as alerts_mod
from ..store import Store, UnknownHost
from .common import User, require, require_reason, utc


@dataclass
class AlertSummary:
    """Open alerts across the fleet for the banner on every page.

    Attributes:
        open_count: number of open alerts.
        lines: one short line per open alert, most severe first (``host: rule since HH:MM``).
    """

    open_count: int
    lines: list[str]


ALERT_COLUMNS = ["id", "host", "rule", "severity", "message", "value", "started_at", "ended_at", "open", "duration_s"]


def alerts(
    store: Store, open_only: bool = False, host: str | None = None, since: datetime | None = None, limit: int = 500
) -> pd.DataFrame:
    """Alerts, newest first: :data:`ALERT_COLUMNS` (times UTC, ``duration_s`` seconds,
    to now for open ones)."""
    try:
        rows = alerts_mod.events(
            store, host=host, open_only=open_only, since=None if since is None else since.timestamp(), limit=limit
        )
    except UnknownHost:
        rows = []
    df = pd.DataFrame(rows, columns=[c for c in ALERT_COLUMNS if c not in ("open", "duration_s")])
    if df.empty:
        return pd.DataFrame(columns=ALERT_COLUMNS)
    df["started_at"] = [utc(t) for t in df["started_at"]]
    df["ended_at"] = pd.Series([utc(t) for t in df["ended_at"]], index=df.index, dtype=object)
    now = datetime.now(timezone.utc)
    df["open"] = df["ended_at"].isna()
    end = [now if o else e for o, e in zip(df["open"], df["ended_at"])]
    df["duration_s"] = [(e - s).total_seconds() if s is not None else None for s, e in zip(df["started_at"], end)]
    return df.sort_values("started_at", ascending=False).reset_index(drop=True)[ALERT_COLUMNS]


def alert_summary(store: Store) -> AlertSummary:
    """Open alerts across all hosts, for the banner."""
    df = alerts(store, open_only=True)
    order = {"critical": 0, "warning": 1, "info": 2}
    if df.empty:
        return AlertSummary(0, [])
    df = df.assign(_o=df["severity"].map(lambda s: order.get(str(s), 3))).sort_values(["_o", "started_at"])
    lines = [f"{r.host}: {r.message or r.rule} (since {r.started_at:%H:%M} UTC)" for r in df.itertuples()]
    return AlertSummary(len(df), lines)


__all__ = ["ALERT_COLUMNS", "AlertSummary", "alert_summary", "alerts"]


# --------------------------------------------------------------------------- config drift


def open_drifts(store: Store, host: str | None = None) -> list[dict[str, Any]]:
    """Open config drifts, newest first (:func:`control.drift.drifts`), each with
    ``summary``: one line naming both sides and the diff."""
    from ..drift import drifts
    from .history import diff_text

    out = []
    for d in drifts(store, host, open_only=True):
        change = diff_text(d["diff"]).replace("\n", "; ") or "same content, another engine version"
        out.append(
            {
                **d,
                "summary": f"{d['host']}: the engine runs its config version {d['engine_version']}, the "
                f"store's version in force is {d['store_version']} ({change})",
            }
        )
    return out


def resolve_drift(store: Store, host: str, how: str, user: User | None, reason: str) -> str:
    """Re-apply the store's version (``how = "reapply"``) or adopt the engine's config
    (``"adopt"``) as ``user`` (re-checked against the users file now: operators only),
    with a reason of at least 4 characters. Returns one line to show.

    Raises:
        PermissionDenied, ViewError, control.drift.NoDrift and what the apply raises
        (see :func:`control.drift.resolve_as_user`).
    """
    from ..drift import resolve_as_user

    checked = require(user, "apply")
    return resolve_as_user(store, host, how, checked, require_reason(reason))
