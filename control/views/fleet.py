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
from .common import ViewError, host_status, list_hosts, require, require_reason, utc

#: Requests to engine hosts in flight at once when the Fleet page asks every host for its state.
STATE_WORKERS = 8


def fleet_overview(store: Store, window_s: float = 60.0, now: float | None = None) -> pd.DataFrame:
    """All hosts at a glance, one row each (by host name): ``host``, ``state``
    (UP/DOWN/phase), ``mode``, ``k_current`` (K in force for the next step, tokens),
    ``running``, ``max_num_seqs``, ``waiting``, ``open_alerts``, ``output_tokens_per_s``
    (mean over the last ``window_s`` s) and ``ttft_p99_ms`` (the worst P99 in it, ms),
    ``usd_per_hour`` (USD/hour), ``gpu_kind``, ``url``, ``error`` (why a host is DOWN).

    What it costs with N hosts: the figures and the alert counts are one query each for
    all hosts (:func:`control.fleet.window_figures`, :func:`control.fleet.open_alert_counts`);
    every host is asked for its state with up to :data:`STATE_WORKERS` requests in
    flight (cached clients, the dashboard's state timeout), so unreachable hosts cost
    one timeout per :data:`STATE_WORKERS` of them, not one each.

    Raises:
        StoreError, MetricSourceError: the store or Prometheus cannot answer. A host that
        is down never raises: its row says DOWN and why.
    """
    from concurrent.futures import ThreadPoolExecutor

    from .. import fleet as fleet_mod

    now = time.time() if now is None else now
    hosts = sorted(list_hosts(store), key=lambda h: h.name)
    if not hosts:
        return pd.DataFrame([])
    figures = fleet_mod.window_figures(store, now - window_s, now)
    counts = fleet_mod.open_alert_counts(store)
    with ThreadPoolExecutor(max_workers=min(STATE_WORKERS, len(hosts)), thread_name_prefix="fleet-state") as pool:
        statuses = dict(zip((h.name for h in hosts), pool.map(lambda h: host_status(store, h.name), hosts)))
    rows = []
    for h in hosts:
        s = statuses[h.name]
        tokens, ttft = figures.get(h.name, (None, None))
        rows.append(
            {
                "host": h.name,
                "state": s.label,
                "mode": s.mode,
                "k_current": s.k_next,
                "running": s.running,
                "max_num_seqs": s.max_num_seqs,
                "waiting": s.waiting,
                "open_alerts": int(counts.get(h.name, 0)),
                "output_tokens_per_s": tokens,
                "ttft_p99_ms": ttft,
                "usd_per_hour": h.usd_per_hour,
                "gpu_kind": h.gpu_kind,
                "url": h.url,
                "error": s.error,
            }
        )
    return pd.DataFrame(rows)


ROLLOUT_COLUMNS = ["id", "status", "phase", "canary", "hosts", "change", "guards", "message", "updated_at"]


def rollouts_frame(store: Store, limit: int = 10) -> pd.DataFrame:
    """Recent rollouts, newest first: ``id``, ``status`` (running, succeeded,
    rolled_back, failed), ``phase``, ``canary``, ``hosts`` (in order), ``change``
    (JSON text), ``guards``, ``message``, ``updated_at`` (UTC)."""
    from ..rollout import list_rollouts

    rows = [
        {
            "id": r.id,
            "status": r.status,
            "phase": r.phase,
            "canary": r.canary,
            "hosts": ", ".join(r.hosts),
            "change": json.dumps(r.patch, separators=(",", ":")),
            "guards": "; ".join(r.guards),
            "message": r.message or "",
            "updated_at": utc(r.updated_at),
        }
        for r in list_rollouts(store, limit=limit)
    ]
    return pd.DataFrame(rows, columns=ROLLOUT_COLUMNS)


def start_rollout(
    store: Store,
    user: User | None,
    *,
    hosts: list[str],
    canary: str,
    patch: dict[str, Any],
    watch_s: float,
    guards: list[str],
    reason: str,
) -> int:
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
        rid = create(
            store,
            hosts=hosts,
            canary=canary,
            patch=patch,
            watch_s=watch_s,
            guards=[g for g in guards if g.strip()],
            reason=reason,
            author=user.name,
        )
    except (RolloutError, ControlError, ValueError) as exc:
        raise ViewError(str(exc)) from exc
    threading.Thread(
        target=run, args=(store, rid), kwargs={"interface": "dashboard"}, name=f"rollout-{rid}", daemon=True
    ).start()
    return rid


__all__ = ["ROLLOUT_COLUMNS", "fleet_overview", "rollouts_frame", "start_rollout"]
