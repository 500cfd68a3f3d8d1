"""The Fleet page's data and actions: every host at a glance, and canary rollouts
(:mod:`control.rollout` does the work)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pandas as pd

from ..auth import User
from ..store import Store
from .alerts import alerts
from .common import ViewError, host_status, list_hosts, require, require_reason, samples_frame, stored_samples, utc


def fleet_overview(store: Store) -> pd.DataFrame:
    """All hosts at a glance, one row each: ``host``, ``state`` (UP/DOWN/phase),
    ``mode``, ``k_current`` (K in force for the next step, tokens), ``running``,
    ``max_num_seqs``, ``waiting``, ``open_alerts``, ``output_tokens_per_s`` and
    ``ttft_p99_ms`` (last minute, from the store), ``usd_per_hour``, ``gpu_kind``,
    ``url``, ``error``."""
    open_alerts = alerts(store, open_only=True)
    counts = open_alerts.groupby("host").size().to_dict() if not open_alerts.empty else {}
    rows = []
    since = time.time() - 60
    for h in list_hosts(store):
        s = host_status(store, h.name)
        try:
            recent = samples_frame(stored_samples(store, h.name, since=since))
        except Exception:
            recent = samples_frame([])
        rows.append({
            "host": h.name,
            "state": s.label,
            "mode": s.mode,
            "k_current": s.k_next,
            "running": s.running,
            "max_num_seqs": s.max_num_seqs,
            "waiting": s.waiting,
            "open_alerts": int(counts.get(h.name, 0)),
            "output_tokens_per_s": float(recent["output_tokens_per_s"].mean()) if not recent.empty else None,
            "ttft_p99_ms": float(recent["ttft_p99_ms"].max()) if not recent["ttft_p99_ms"].dropna().empty else None,
            "usd_per_hour": h.usd_per_hour,
            "gpu_kind": h.gpu_kind,
            "url": h.url,
            "error": s.error,
        })
    return pd.DataFrame(rows)


ROLLOUT_COLUMNS = ["id", "status", "phase", "canary", "hosts", "change", "guards", "message", "updated_at"]


def rollouts_frame(store: Store, limit: int = 10) -> pd.DataFrame:
    """Recent rollouts, newest first: ``id``, ``status`` (running, succeeded,
    rolled_back, failed), ``phase``, ``canary``, ``hosts`` (in order), ``change``
    (JSON text), ``guards``, ``message``, ``updated_at`` (UTC)."""
    from ..rollout import list_rollouts

    rows = [{"id": r.id, "status": r.status, "phase": r.phase, "canary": r.canary, "hosts": ", ".join(r.hosts),
             "change": json.dumps(r.patch, separators=(",", ":")), "guards": "; ".join(r.guards),
             "message": r.message or "", "updated_at": utc(r.updated_at)}
            for r in list_rollouts(store, limit=limit)]
    return pd.DataFrame(rows, columns=ROLLOUT_COLUMNS)


def start_rollout(store: Store, user: User | None, *, hosts: list[str], canary: str, patch: dict[str, Any],
                  watch_s: float, guards: list[str], reason: str) -> int:
    """Record a rollout (operators only, re-checked against the users file now) and run
    it in a background thread of this process; returns its id. If the dashboard stops,
    ``python -m control config rollout --resume`` takes it over.

    Raises:
        PermissionDenied: the user may not apply. ViewError: a bad rollout (the reason
        says what), nothing recorded.
    """
    from ..rollout import RolloutError, create, run
    from ..store import ControlError

    user = require(user, "apply")
    reason = require_reason(reason)
    try:
        rid = create(store, hosts=hosts, canary=canary, patch=patch, watch_s=watch_s,
                     guards=[g for g in guards if g.strip()], reason=reason, author=user.name)
    except (RolloutError, ControlError, ValueError) as exc:
        raise ViewError(str(exc)) from exc
    threading.Thread(target=run, args=(store, rid), kwargs={"interface": "dashboard"}, name=f"rollout-{rid}",
                     daemon=True).start()
    return rid


__all__ = ["ROLLOUT_COLUMNS", "fleet_overview", "rollouts_frame", "start_rollout"]
