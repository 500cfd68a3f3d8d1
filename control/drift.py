"""Config drift: the engine's config differs from the store's version in force.

The collector calls :func:`check` on every scrape with the engine's ``/control/state``.
The two sides agree when the engine's config equals the config of the store's version
in force (:func:`control.versions.version_in_force`) *and* the engine's own
``config_version`` is the one recorded for that version at apply
(``Host.engine_config_version``). The engine's counter restarts at 1 with the engine,
so versions are never compared number to number: a supervised restart that re-applies
the last version records the new mapping and is not drift. Anything else is drift, e.g.
a PUT straight to the engine, or an apply recorded ``failed`` (the engine answered 503)
that the engine core carried out later.

A drift is recorded once per engine side (a :class:`control.models.ConfigDrift` row with
both sides and the diff, an audit event ``config.drift``) and raises the
``config_drift`` alert through the collector. It ends when the sides agree again
(``agreed``), or by an operator's decision:

* :func:`reapply`: send the store's version in force again (a new version, ``source =
  reapply``), so the engine goes back to what the store says;
* :func:`adopt`: record the engine's config as a new version (``source = adopt``,
  applied), so the store goes along with the engine.

No check is made while an apply holds the host's lease (its outcome is not known yet).
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select

from engine_host.config import diff_configs

from .client import EngineClient
from .models import ConfigDrift, Host
from .store import ControlError, Store, active_host, audit, current_user, get_host, origin
from .versions import APPLIED, acquire_lease, last_applied, record_version, release_lease

SYSTEM_ACTOR = "control-plane"


class NoDrift(ControlError):
    """The host has no open config drift (nothing to re-apply or adopt)."""


def _engine_side(state: dict[str, Any]) -> tuple[int | None, float | None, dict[str, Any] | None]:
    return state.get("config_version"), (state.get("engine") or {}).get("started_at"), state.get("config")


def compare(store_config: dict[str, Any] | None, mapped_engine_version: int | None, state: dict[str, Any]) -> list[str]:
    """Why the engine (``state``, the JSON of ``GET /control/state``) and the store
    disagree; empty when they agree.

    Args:
        store_config: the config of the store's version in force; mapped_engine_version:
            the engine ``config_version`` recorded for it (None: not known, not compared).
    Returns:
        Human-readable reasons, e.g. ``["config differs: speculation.k 2 -> 4"]``.
    """
    why = []
    engine_version, _, engine_config = _engine_side(state)
    if store_config is not None and engine_config != store_config:
        d = diff_configs(store_config, engine_config or {})
        why.append("config differs: " + "; ".join(f"{x['field']} {x['old']!r} -> {x['new']!r}" for x in d[:5]))
    if mapped_engine_version is not None and engine_version != mapped_engine_version:
        why.append(
            f"engine config version {engine_version}, the store's version in force was applied as "
            f"engine version {mapped_engine_version}"
        )
    return why


def _lease_held(host: Host, now: float) -> bool:
    return host.apply_lock_until is not None and host.apply_lock_until >= now


def check(store: Store, host_name: str, state: dict[str, Any], now: float | None = None) -> ConfigDrift | None:
    """Compare the engine's ``state`` with the store; record, continue or end a drift.

    Returns:
        The open drift after the check (None when the sides agree, when the store has no
        applied version yet, or while an apply holds the lease and no drift is open).
    Raises:
        UnknownHost.
    """
    now = time.time() if now is None else now
    host = get_host(store, host_name)
    base = last_applied(store, host.id)
    current = open_drift(store, host_name)
    if base is None or _lease_held(host, time.time()):
        return current
    mapped = host.engine_config_version if host.engine_config_version is not None else base.engine_version
    why = compare(base.config, mapped, state)
    engine_version, started, engine_config = _engine_side(state)
    with store.writer() as s:
        row = s.get(ConfigDrift, current.id) if current is not None else None
        if row is not None and (
            not why
            or (row.engine_version, row.engine_started_at, row.engine_config)
            != (engine_version, started, engine_config)
            or row.store_version != base.version
        ):
            row.ended_at, row.resolution = now, ("agreed" if not why else "changed")
            row = None
        if why and row is None:
            row = ConfigDrift(
                host_id=host.id,
                detected_at=now,
                store_version=base.version,
                store_engine_version=mapped,
                store_config=base.config,
                engine_version=engine_version,
                engine_started_at=started,
                engine_config=engine_config,
                diff=diff_configs(base.config, engine_config or {}),
            )
            s.add(row)
            s.flush()
            audit(
                s,
                actor=SYSTEM_ACTOR,
                origin=origin("collector"),
                action="config.drift",
                outcome="failed",
                host_name=host.name,
                message=f"config drift: store version {base.version} against engine config "
                f"version {engine_version}: " + "; ".join(why),
                detail={
                    "store_version": base.version,
                    "store_engine_version": mapped,
                    "engine_version": engine_version,
                    "diff": row.diff,
                },
            )
        return row


def open_drift(store: Store, host_name: str) -> ConfigDrift | None:
    """The host's open drift, or None.

    Raises:
        UnknownHost.
    """
    with store.reader() as s:
        h = active_host(s, host_name)
        return s.scalars(
            select(ConfigDrift)
            .where(ConfigDrift.host_id == h.id, ConfigDrift.ended_at.is_(None))
            .order_by(ConfigDrift.detected_at.desc())
        ).first()


def drifts(store: Store, host: str | None = None, open_only: bool = False, limit: int = 100) -> list[dict[str, Any]]:
    """Drifts, newest first, as dicts: ``id, host, detected_at, ended_at`` (unix s),
    ``store_version, store_engine_version, store_config, engine_version,
    engine_started_at, engine_config, diff, resolution, resolved_by, resolved_version``.

    Raises:
        UnknownHost: ``host`` given and not registered.
    """
    q = (
        select(ConfigDrift, Host.name)
        .join(Host, Host.id == ConfigDrift.host_id)
        .order_by(ConfigDrift.detected_at.desc())
        .limit(limit)
    )
    if open_only:
        q = q.where(ConfigDrift.ended_at.is_(None))
    with store.reader() as s:
        if host:
            q = q.where(ConfigDrift.host_id == active_host(s, host).id)
        return [
            {
                "id": d.id,
                "host": name,
                **{
                    c: getattr(d, c)
                    for c in (
                        "detected_at",
                        "ended_at",
                        "store_version",
                        "store_engine_version",
                        "store_config",
                        "engine_version",
                        "engine_started_at",
                        "engine_config",
                        "diff",
                        "resolution",
                        "resolved_by",
                        "resolved_version",
                    )
                },
            }
            for d, name in s.execute(q)
        ]


def _resolve(store: Store, drift_id: int, how: str, who: str, version: int | None) -> None:
    with store.writer() as s:
        row = s.get(ConfigDrift, drift_id)
        if row is not None and row.ended_at is None:
            row.ended_at, row.resolution, row.resolved_by, row.resolved_version = time.time(), how, who, version


def reapply(
    store: Store,
    host_name: str,
    *,
    reason: str,
    author: str | None = None,
    interface: str = "api",
    client: EngineClient | None = None,
) -> Any:
    """Resolve a host's drift by sending the store's version in force again, as a new
    version (``source = reapply``, ``rollback_of`` = that version).

    Returns:
        The :class:`control.apply.ApplyResult` (``failed`` leaves the drift open).
    Raises:
        NoDrift: no open drift; and everything :func:`control.apply.apply_change` raises.
    """
    from .apply import apply_change

    drift = open_drift(store, host_name)
    if drift is None:
        raise NoDrift(f"host {host_name!r} has no open config drift")
    host = get_host(store, host_name)
    base = last_applied(store, host.id)
    assert base is not None  # a drift is only opened against an applied version, which stays applied
    author = author or current_user()
    res = apply_change(
        store,
        host_name,
        base.config,
        reason=reason,
        author=author,
        interface=interface,
        source="reapply",
        rollback_of=base.version,
        client=client,
    )
    if res.ok:
        _resolve(store, drift.id, "reapply", author, res.version)
    return res


def adopt(
    store: Store,
    host_name: str,
    *,
    reason: str,
    author: str | None = None,
    interface: str = "api",
    client: EngineClient | None = None,
) -> Any:
    """Resolve a host's drift by recording the engine's config as a new version
    (``source = adopt``, ``applied``, with the engine's version number), read from the
    engine now (not from the drift record, in case it moved on).

    Returns:
        The new :class:`control.models.ConfigVersion`.
    Raises:
        ValueError: empty reason. NoDrift: no open drift. EngineError / TokenMissing:
        the engine's state cannot be read (nothing recorded). ApplyBusy: an apply holds
        the host.
    """
    from .apply import _resolve_interrupted

    if not reason or not reason.strip():
        raise ValueError("a reason is required for every config change")
    drift = open_drift(store, host_name)
    if drift is None:
        raise NoDrift(f"host {host_name!r} has no open config drift")
    host = get_host(store, host_name)
    author, who = author or current_user(), origin(interface)
    own_client = client is None
    client = client or EngineClient.for_host(host)
    token = acquire_lease(store, host.id, who=f"{interface} ({author})")
    try:
        state = client.state()
        _resolve_interrupted(store, host, state, False, who)
        base = last_applied(store, host.id)
        v = record_version(
            store,
            host.id,
            config=state["config"],
            author=author,
            reason=reason.strip(),
            source="adopt",
            base=base,
            status=APPLIED,
            engine_version=state.get("config_version"),
            message=f"adopted the engine's config version {state.get('config_version')}",
        )
        with store.writer() as s:
            audit(
                s,
                actor=author,
                origin=who,
                action="config.adopt",
                outcome="ok",
                host_name=host.name,
                message=f"version {v.version}: adopted the engine's config version {state.get('config_version')}",
                detail={"version": v.version, "reason": reason, "diff": v.diff, "drift": drift.id},
            )
        _resolve(store, drift.id, "adopt", author, v.version)
        return v
    finally:
        release_lease(store, host.id, token)
        if own_client:
            client.close()


def resolve_as_user(store: Store, host_name: str, how: str, user: Any, reason: str) -> str:
    """The dashboard's drift action: ``how`` = ``reapply`` or ``adopt``, as ``user``
    (a :class:`control.auth.User`; operators only), with a reason (>= 4 characters).

    Returns:
        What happened, one line for the operator.
    Raises:
        PermissionError: no user, or a role that may not apply. ValueError: unknown
        ``how`` or no reason. NoDrift, and what :func:`reapply` / :func:`adopt` raise.
    """
    if user is None or not user.can("apply"):
        raise PermissionError(
            "only operators may resolve a config drift" + ("" if user is None else f": {user.name} is a {user.role}")
        )
    reason = (reason or "").strip()
    if len(reason) < 4:
        raise ValueError("a reason is required (at least 4 characters): say why, for the history")
    if how == "reapply":
        res = reapply(store, host_name, reason=reason, author=user.name, interface="dashboard")
        return f"version {res.version} {res.status}: {res.message}"
    if how == "adopt":
        v = adopt(store, host_name, reason=reason, author=user.name, interface="dashboard")
        return f"version {v.version} recorded: the engine's config version {v.engine_version} adopted"
    raise ValueError(f"unknown drift action {how!r}: use reapply or adopt")
