"""The History page's data and actions: config versions (:func:`control.versions.history`),
heartbeat runs (:func:`control.warmup.runs`) and rollback (:func:`control.apply.rollback`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pandas as pd

from .. import versions as versions_mod
from .. import warmup as warmup_mod
from ..auth import User
from ..store import Store, UnknownHost
from .common import ChangeOutcome, get_host, list_hosts, require, require_reason, run_change, utc

HISTORY_COLUMNS = [
    "host",
    "version",
    "created_at",
    "author",
    "reason",
    "outcome",
    "message",
    "applied_at",
    "source",
    "diff_text",
    "diff",
    "config",
]


def diff_text(diff: list[dict[str, Any]] | None) -> str:
    """A diff as one line per field: ``speculation.k: 2 → 4``."""
    if not diff:
        return ""
    return "\n".join(f"{d['field']}: {d.get('old')!r} → {d.get('new')!r}" for d in diff)


def _version_row(host: str, v: Any) -> dict[str, Any]:
    return {
        "host": host,
        "version": v.version,
        "created_at": utc(v.created_at),
        "author": v.author,
        "reason": v.reason,
        "outcome": v.status,
        "message": v.engine_message,
        "source": f"rollback to v{v.rollback_of}" if v.source == "rollback" and v.rollback_of else v.source,
        "applied_at": utc(v.finished_at) if v.status == "applied" else None,
        "diff": v.diff or [],
        "config": v.config,
    }


def history(
    store: Store,
    host: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 500,
) -> pd.DataFrame:
    """Config versions, newest first: :data:`HISTORY_COLUMNS` (times UTC; ``outcome`` is
    ``applied``, ``failed`` or ``pending``; ``source`` ``apply``, ``rollback to vN``,
    ``import`` (the engine's own config at first contact) or ``reapply`` (after an engine
    restart); ``diff_text`` one change per line).

    Args:
        host: one host, or None for all.
        since, until: keep versions created in this span.
        limit: most rows returned.
    """
    names = [host] if host else [h.name for h in list_hosts(store)]
    rows = []
    for n in names:
        try:
            found = versions_mod.history(store, n)
        except UnknownHost:
            continue
        for v in found:
            if since is not None and v.created_at < since.timestamp():
                break  # newest first: the rest is older
            if until is not None and v.created_at > until.timestamp():
                continue
            rows.append(_version_row(n, v))
    df = pd.DataFrame(rows, columns=[c for c in HISTORY_COLUMNS if c != "diff_text"])
    df["diff_text"] = [diff_text(d) for d in df["diff"]] if not df.empty else []
    if not df.empty:
        df = df.sort_values(["created_at", "version"], ascending=False).head(limit).reset_index(drop=True)
    return df[HISTORY_COLUMNS]


def version_markers(store: Store, name: str, since: float) -> pd.DataFrame:
    """Config versions of a host applied after ``since`` (unix s), as chart markers:
    ``t``, ``version``, ``label`` (``v12``), ``author``, ``reason``."""
    cols = ["t", "version", "label", "author", "reason"]
    try:
        df = history(store, host=name, since=utc(since))
    except Exception:
        return pd.DataFrame(columns=cols)
    if df.empty:
        return pd.DataFrame(columns=cols)
    df = df[df["outcome"] == "applied"]
    t = df["applied_at"].fillna(df["created_at"])
    return pd.DataFrame(
        {
            "t": t.values,
            "version": df["version"].values,
            "label": [f"v{v}" for v in df["version"]],
            "author": df["author"].values,
            "reason": df["reason"].values,
        },
        columns=cols,
    ).sort_values("t")


def rollback(store: Store, name: str, version: int, user: User | None, reason: str) -> ChangeOutcome:
    """Put an earlier version back in force as a new version (operators only, re-checked
    against the users file now; :func:`control.apply.rollback`).

    Raises:
        PermissionDenied: the user may not roll back (or was removed).
        ViewError: no reason given, or the host is unknown.
    """
    from .. import apply as apply_mod

    user = require(user, "rollback")
    reason = require_reason(reason)
    get_host(store, name)
    return run_change(
        store,
        name,
        lambda: apply_mod.rollback(store, name, int(version), reason=reason, author=user.name, interface="dashboard"),
    )


def rollback_diff(store: Store, name: str, version: int) -> tuple[int | None, list[dict[str, Any]]]:
    """What a rollback to ``version`` would change: the version in force on the host
    (:func:`control.versions.last_applied`, None when none) and the diff
    ``[{"field", "old", "new"}]`` from its config to ``version``'s config (empty: the
    same config).

    Raises:
        ViewError: no such host; control.versions.UnknownVersion: no such version.
    """
    from engine_host.config import diff_configs

    from .common import version_in_force

    target = versions_mod.get_version(store, name, int(version))
    now = version_in_force(store, name)
    if now is None:
        return None, diff_configs({}, target.config or {})
    current = versions_mod.get_version(store, name, now)
    return now, diff_configs(current.config or {}, target.config or {})


RUN_COLUMNS = [
    "host",
    "started_at",
    "kind",
    "schedule",
    "outcome",
    "duration_s",
    "ttft_s",
    "output_tokens",
    "k",
    "detail",
]


def heartbeat_runs(
    store: Store, host: str | None = None, since: datetime | None = None, limit: int = 200
) -> pd.DataFrame:
    """Warm-up and heartbeat runs the engine reported and the collector stored
    (:func:`control.warmup.runs`), newest first, skips included: :data:`RUN_COLUMNS`
    (``started_at`` UTC, ``kind`` warm-up or heartbeat, ``schedule`` the heartbeat's
    name, ``outcome`` as the engine said (e.g. ``ok``, ``skipped``), ``duration_s`` and
    ``ttft_s`` seconds, ``output_tokens`` tokens, ``k`` draft tokens, ``detail`` why)."""
    names = [host] if host else [h.name for h in list_hosts(store)]
    rows = []
    for n in names:
        try:
            found = warmup_mod.runs(store, n, since=None if since is None else since.timestamp(), limit=limit)
        except UnknownHost:
            continue
        rows += [
            {
                "host": n,
                "started_at": utc(r.started_at),
                "kind": r.kind,
                "schedule": r.schedule,
                "outcome": r.outcome,
                "duration_s": r.duration_s,
                "ttft_s": r.ttft_s,
                "output_tokens": r.output_tokens,
                "k": r.k,
                "detail": r.detail,
            }
            for r in found
        ]
    df = pd.DataFrame(rows, columns=RUN_COLUMNS)
    if not df.empty:
        df = df.sort_values("started_at", ascending=False).head(limit).reset_index(drop=True)
    return df


__all__ = [
    "HISTORY_COLUMNS",
    "RUN_COLUMNS",
    "diff_text",
    "get_host",
    "heartbeat_runs",
    "history",
    "rollback",
    "require_reason",
    "rollback_diff",
    "version_markers",
]
