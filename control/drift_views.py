"""The dashboard's view of config drift (Alerts page): open drifts with both sides, and
the operator's two ways out. Logic: :mod:`control.drift`; the store is the one of the
dashboard's backend (:mod:`control.views`)."""

from __future__ import annotations

from typing import Any

from .auth import User
from .views import _backend, diff_text


def _store() -> Any:
    return getattr(_backend(), "store", None)  # None: a backend without a store (page tests)


def open_drifts(host: str | None = None) -> list[dict[str, Any]]:
    """Open drifts, newest first (see :func:`control.drift.drifts`), each with
    ``summary``: one line naming both sides and the diff."""
    from .drift import drifts

    store = _store()
    if store is None:
        return []
    out = []
    for d in drifts(store, host, open_only=True):
        change = diff_text(d["diff"]).replace("\n", "; ") or "same content, another engine version"
        out.append({**d, "summary": f"{d['host']}: the engine runs its config version {d['engine_version']}, the "
                                    f"store's version in force is {d['store_version']} ({change})"})
    return out


def resolve(host: str, how: str, user: User | None, reason: str) -> str:
    """Re-apply the store's version (``how = "reapply"``) or adopt the engine's config
    (``"adopt"``) as ``user`` (operators only), with a reason. Returns one line to show.

    Raises:
        PermissionError, ValueError, control.drift.NoDrift and what the apply raises
        (see :func:`control.drift.resolve_as_user`).
    """
    from .drift import resolve_as_user

    return resolve_as_user(_store(), host, how, user, reason)
