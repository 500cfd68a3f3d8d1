"""What the dashboard's Fleet page shows and does about canary rollouts, as plain data
(the page arranges it; :mod:`control.rollout` does the work)."""

from __future__ import annotations

import threading
from typing import Any

import pandas as pd

from .auth import User
from .views import PermissionDenied, ViewError, _backend, _require, _utc, require_reason

ROLLOUT_COLUMNS = ["id", "status", "phase", "canary", "hosts", "change", "guards", "message", "updated_at"]


def rollouts_frame(limit: int = 10) -> pd.DataFrame:
    """Recent rollouts, newest first: ``id``, ``status`` (running, succeeded,
    rolled_back, failed), ``phase``, ``canary``, ``hosts`` (in order), ``change``
    (JSON text), ``guards``, ``message``, ``updated_at`` (UTC)."""
    import json

    from .rollout import list_rollouts

    rows = [{"id": r.id, "status": r.status, "phase": r.phase, "canary": r.canary, "hosts": ", ".join(r.hosts),
             "change": json.dumps(r.patch, separators=(",", ":")), "guards": "; ".join(r.guards),
             "message": r.message or "", "updated_at": _utc(r.updated_at)}
            for r in list_rollouts(_backend().store, limit=limit)]
    return pd.DataFrame(rows, columns=ROLLOUT_COLUMNS)


def start_rollout(user: User | None, *, hosts: list[str], canary: str, patch: dict[str, Any], watch_s: float,
                  guards: list[str], reason: str) -> int:
    """Record a rollout (operators only) and run it in a background thread of this
    process; returns its id. If the dashboard stops, ``python -m control config
    rollout --resume`` takes it over.

    Raises:
        PermissionDenied: the user may not apply. ViewError: a bad rollout (the reason
        says what), nothing recorded.
    """
    from .rollout import RolloutError, create, run
    from .store import ControlError

    user = _require(user, "apply")
    reason = require_reason(reason)
    store = _backend().store
    try:
        rid = create(store, hosts=hosts, canary=canary, patch=patch, watch_s=watch_s,
                     guards=[g for g in guards if g.strip()], reason=reason, author=user.name)
    except (RolloutError, ControlError, ValueError) as exc:
        raise ViewError(str(exc)) from exc
    threading.Thread(target=run, args=(store, rid), kwargs={"interface": "dashboard"}, name=f"rollout-{rid}",
                     daemon=True).start()
    return rid


__all__ = ["PermissionDenied", "ViewError", "rollouts_frame", "start_rollout"]
