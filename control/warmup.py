"""Warm-up schedules and runs in the store.

A schedule is an :class:`engine_host.config.HeartbeatSchedule` kept per host; it takes
effect on the engine through a config version (:func:`warmup_patch` gives the patch
for ``control.apply.apply_change``). Runs are what the engine host reports at
``GET /control/warmup/runs`` (start-up warm-up and heartbeats, with latency), copied by
the collector with :func:`sync_runs`.
"""

from __future__ import annotations

import time
from typing import Any, cast

from sqlalchemy import CursorResult, delete, func, select
from sqlalchemy.exc import IntegrityError

from engine_host.config import HeartbeatSchedule, WarmupConfig

from .models import Host, WarmupRun, WarmupSchedule
from .store import ControlError, Store, active_host


class UnknownSchedule(ControlError, LookupError):
    """The host has no warm-up schedule of that name."""


def set_schedule(store: Store, host: str, schedule: HeartbeatSchedule | dict[str, Any]) -> WarmupSchedule:
    """Create or replace a host's schedule (validated as a ``HeartbeatSchedule``).

    Raises:
        UnknownHost; pydantic.ValidationError: invalid schedule.
    """
    spec = HeartbeatSchedule.model_validate(schedule).model_dump(mode="json")
    now = time.time()
    with store.writer() as s:
        h = active_host(s, host)
        row = s.scalars(
            select(WarmupSchedule).where(WarmupSchedule.host_id == h.id, WarmupSchedule.name == spec["name"])
        ).first()
        if row is None:
            row = WarmupSchedule(host_id=h.id, name=spec["name"], created_at=now)
            s.add(row)
        row.spec, row.updated_at = spec, now
        s.flush()
        return row


def schedules(store: Store, host: str) -> list[WarmupSchedule]:
    """A host's schedules by name."""
    with store.reader() as s:
        h = active_host(s, host)
        return list(
            s.scalars(select(WarmupSchedule).where(WarmupSchedule.host_id == h.id).order_by(WarmupSchedule.name))
        )


def delete_schedule(store: Store, host: str, name: str) -> None:
    """Delete a schedule. Raises: UnknownHost, UnknownSchedule."""
    with store.writer() as s:
        h = active_host(s, host)
        n = cast(
            CursorResult[Any],
            s.execute(delete(WarmupSchedule).where(WarmupSchedule.host_id == h.id, WarmupSchedule.name == name)),
        ).rowcount
        if not n:
            raise UnknownSchedule(f"host {host!r} has no warm-up schedule {name!r}")


def warmup_patch(store: Store, host: str) -> dict[str, Any]:
    """The config patch that puts the host's stored schedules in force:
    ``{"warmup": {"heartbeats": [...]}}``."""
    beats = [HeartbeatSchedule.model_validate(r.spec) for r in schedules(store, host)]
    return {"warmup": WarmupConfig(heartbeats=beats).model_dump(mode="json")}


def last_run_id(store: Store, host_id: int, engine_started_at: float) -> int:
    """The largest engine run id stored for this engine start (0 when none)."""
    with store.reader() as s:
        return (
            s.scalar(
                select(func.max(WarmupRun.run_id)).where(
                    WarmupRun.host_id == host_id, WarmupRun.engine_started_at == engine_started_at
                )
            )
            or 0
        )


def record_runs(store: Store, host_id: int, engine_started_at: float, runs: list[dict[str, Any]]) -> int:
    """Store runs reported by the engine (``GET /control/warmup/runs`` items); already
    stored ones are skipped. Returns how many were added."""
    added = 0
    for r in runs:
        try:
            with store.writer() as s:
                s.add(
                    WarmupRun(
                        host_id=host_id,
                        engine_started_at=engine_started_at,
                        run_id=int(r["id"]),
                        kind=r.get("kind", "?"),
                        schedule=r.get("schedule"),
                        started_at=float(r.get("started_at") or time.time()),
                        duration_s=r.get("duration_s"),
                        ttft_s=r.get("ttft_s"),
                        output_tokens=r.get("output_tokens"),
                        k=r.get("k"),
                        outcome=r.get("outcome", "?"),
                        detail=r.get("detail"),
                    )
                )
            added += 1
        except IntegrityError:
            continue
    return added


def sync_runs(store: Store, host: Host, client: Any) -> int:
    """Copy new runs from a reachable engine host (needs its identity, see
    ``control.apply.reconcile``). Returns how many were added."""
    if host.engine_started_at is None:
        return 0
    after = last_run_id(store, host.id, host.engine_started_at)
    return record_runs(store, host.id, host.engine_started_at, client.warmup_runs(after))


def runs(store: Store, host: str, since: float | None = None, limit: int = 1000) -> list[WarmupRun]:
    """A host's warm-up and heartbeat runs, newest first."""
    with store.reader() as s:
        h = active_host(s, host)
        q = select(WarmupRun).where(WarmupRun.host_id == h.id).order_by(WarmupRun.started_at.desc()).limit(limit)
        if since is not None:
            q = q.where(WarmupRun.started_at >= since)
        return list(s.scalars(q))
