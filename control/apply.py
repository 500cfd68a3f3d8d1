"""Changing an engine host's config: apply, rollback, and re-apply after a restart.

Apply = validate -> record the version as ``pending`` -> send -> record ``applied`` or
``failed`` with the engine's message. In detail (:func:`apply_change`):

1. take the host's apply lease (applies to one host are serialised across processes;
   versions are numbered and sent in the same order);
2. read the engine's state (config, limits, identity). When the engine is down, the
   limits last seen are used, so that a change can still be validated and recorded;
3. validate the patch on top of the last applied version with
   :func:`engine_host.config.apply_patch` (the one definition of the config). A refused
   change is not recorded as a version; an audit event says why;
4. record the version (full config, diff to the last applied one) as ``pending``;
5. send the *full* config (so the engine ends up exactly on the recorded version,
   whatever it had before), once;
6. record the outcome with the engine's message. On failure the engine keeps its last
   good config (the engine applies a config atomically or not at all) and the history
   says so; the next apply is again based on the last *applied* version.

Rollback applies an earlier version's full config as a new version (``source =
rollback``). :func:`reconcile` compares the engine's identity (PID, start time) with
the one last seen: on a restart it re-applies the last applied version (``source =
reapply``) and says so in the history and the audit trail.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from engine_host.config import ConfigError, EngineLimits, LiveConfig, apply_patch

from .client import EngineAuthError, EngineClient, EngineError, EngineRefused, EngineUnreachable
from .models import ConfigVersion, Host
from .store import ControlError, Store, audit, current_user, get_host, origin, record_audit, set_engine_identity
from .versions import (
    APPLIED,
    FAILED,
    acquire_lease,
    get_version,
    last_applied,
    pending_versions,
    record_outcome,
    record_version,
    release_lease,
    set_engine_config_version,
)

SYSTEM_ACTOR = "control-plane"


class ConfigRefused(ControlError):
    """The change is invalid (or needs an engine restart); nothing was recorded as a version.

    Attributes:
        errors: ``[{"loc": [...], "msg": str}]`` naming each field.
        restart_required: the change needs a restart (HTTP 409 semantics).
    """

    def __init__(self, message: str, errors: list[dict[str, Any]], restart_required: bool = False):
        super().__init__(message)
        self.errors = errors
        self.restart_required = restart_required


class HostNeverSeen(ControlError):
    """The engine host is unreachable and was never reached, so its limits are unknown
    and the change cannot be validated."""


@dataclass
class ApplyResult:
    """What happened to one apply.

    Attributes:
        version: the control plane's version number; status: ``applied`` or ``failed``;
        config: the full config of the version; diff: against the last applied version
        (``[{"field", "old", "new"}]``); engine_version: the engine's own number (when
        applied); message: the engine's message or why it failed; apply_latency_ms:
        engine-side apply time (ms); notes: other things noticed (drift, restart).
    """

    host: str
    version: int
    status: str
    config: dict[str, Any]
    diff: list[dict[str, Any]]
    engine_version: int | None = None
    message: str | None = None
    apply_latency_ms: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == APPLIED


def _validate(base: dict[str, Any], patch: dict[str, Any], limits: dict[str, Any]) -> LiveConfig:
    try:
        return apply_patch(LiveConfig.model_validate(base), patch, EngineLimits.model_validate(limits))
    except ConfigError as exc:
        raise ConfigRefused(f"refused: {exc}", exc.errors, restart_required=exc.status == 409) from None


def _identity(state: dict[str, Any]) -> tuple[int | None, float | None]:
    eng = state.get("engine") or {}
    return eng.get("pid"), eng.get("started_at")


def _resolve_interrupted(
    store: Store, host: Host, state: dict[str, Any] | None, restarted: bool, who: str
) -> list[str]:
    """Give pending versions left by an interrupted apply their outcome (lease held)."""
    notes = []
    for v in pending_versions(store, host.id):
        if state is not None and not restarted and state.get("config") == v.config:
            record_outcome(
                store,
                v.id,
                status=APPLIED,
                engine_version=state.get("config_version"),
                message="confirmed from the engine's state after the apply was interrupted",
            )
        else:
            record_outcome(
                store,
                v.id,
                status=FAILED,
                message="interrupted: the control plane stopped before the engine answered"
                + ("; the engine has restarted since" if restarted else ""),
            )
        notes.append(f"version {v.version} was left pending by an interrupted apply; outcome recorded")
        record_audit(
            store,
            actor=SYSTEM_ACTOR,
            origin=who,
            action="config.resolve_pending",
            outcome="ok",
            host_name=host.name,
            message=notes[-1],
        )
    return notes


def import_engine_config(store: Store, host: Host, state: dict[str, Any], who: str) -> ConfigVersion:
    """Record the engine's own config as the host's first version (``source = import``)."""
    v = record_version(
        store,
        host.id,
        config=state["config"],
        author=SYSTEM_ACTOR,
        reason="config found on the engine host at first contact",
        source="import",
        base=None,
        status=APPLIED,
        engine_version=state.get("config_version"),
        message=f"engine config version {state.get('config_version')}",
    )
    record_audit(
        store,
        actor=SYSTEM_ACTOR,
        origin=who,
        action="config.import",
        outcome="ok",
        host_name=host.name,
        message=f"imported the engine's config as version {v.version}",
    )
    return v


def _send(store: Store, client: EngineClient, host: Host, pending: ConfigVersion) -> ApplyResult:
    result = ApplyResult(
        host=host.name, version=pending.version, status=FAILED, config=pending.config, diff=pending.diff
    )
    try:
        answer = client.put_config(pending.config)
    except EngineRefused as exc:
        result.message = str(exc)
    except EngineUnreachable as exc:
        result.message = f"{exc} (not applied; the engine keeps its last good config)"
    except EngineError as exc:
        result.message = f"{exc} (the engine keeps its last good config unless it acknowledges later)"
    else:
        result.status = APPLIED
        result.engine_version = answer.get("config_version")
        result.apply_latency_ms = answer.get("apply_latency_ms")
        result.message = f"applied as engine config version {result.engine_version}"
        if answer.get("config") not in (None, pending.config):
            result.notes.append("the engine reports a config that differs from the one sent")
    record_outcome(
        store,
        pending.id,
        status=result.status,
        engine_version=result.engine_version,
        message=result.message,
        apply_latency_ms=result.apply_latency_ms,
    )
    return result


def apply_change(
    store: Store,
    host_name: str,
    patch: dict[str, Any],
    *,
    reason: str,
    author: str | None = None,
    interface: str = "api",
    source: str = "apply",
    rollback_of: int | None = None,
    client: EngineClient | None = None,
    lock_wait_s: float = 60.0,
    lease_ttl_s: float = 60.0,
    on_wait: Callable[[str], None] | None = None,
) -> ApplyResult:
    """Apply a change (any subset of the ``LiveConfig`` JSON) to a host as a new version.

    Args:
        patch: e.g. ``{"speculation": {"mode": "fixed", "k": 4}}`` or ``{"batch": {"max_num_seqs": 2}}``.
        reason: why (required, shown in the history); author: who (default ``$USER``);
        interface: where from (``cli``, ``dashboard``, ``collector``...);
        client: an engine client (default: one for the host, token from its variable);
        lock_wait_s: how long to wait for another apply on the host (s); lease_ttl_s: how
        long this apply may hold the host before others may take over (s); on_wait: told
        whom this apply waits for while another holds the host (default: a warning on
        the ``specpilot.apply`` logger, which the CLI prints on stderr).
    Returns:
        :class:`ApplyResult` with ``status`` ``applied`` or ``failed`` (engine down,
        refused by the engine, no acknowledgement); both are recorded.
    Raises:
        ValueError: empty reason. UnknownHost: no such host. TokenMissing /
        EngineAuthError: the control token is unset or wrong (nothing recorded).
        ConfigRefused: invalid change (nothing recorded as a version; audited).
        HostNeverSeen: engine down and never reached (limits unknown).
        ApplyBusy: another apply held the host longer than ``lock_wait_s`` s.
    """
    if not reason or not reason.strip():
        raise ValueError("a reason is required for every config change")
    reason, author = reason.strip(), author or current_user()
    who = origin(interface)
    host = get_host(store, host_name)
    own_client = client is None
    client = client or EngineClient.for_host(host)
    token = acquire_lease(
        store, host.id, ttl_s=lease_ttl_s, wait_s=lock_wait_s, who=f"{interface} ({author})", on_wait=on_wait
    )
    try:
        notes: list[str] = []
        state, down_reason = None, None
        try:
            state = client.state()
        except EngineUnreachable as exc:
            down_reason = str(exc)
        except EngineAuthError:
            raise
        except EngineError as exc:  # it answers but cannot tell its state (starting up): still try the PUT
            notes.append(f"engine state unavailable: {exc}")
        restarted = False
        if state is not None:
            pid, started = _identity(state)
            restarted = host.engine_started_at is not None and (pid, started) != (
                host.engine_pid,
                host.engine_started_at,
            )
            set_engine_identity(store, host.id, pid=pid, started_at=started, limits=state.get("limits"))
            if restarted:
                notes.append(f"the engine restarted since last seen (pid {host.engine_pid} -> {pid})")
        notes += _resolve_interrupted(store, host, state, restarted, who)
        base = last_applied(store, host.id)
        if base is None and state is not None:
            base = import_engine_config(store, host, state, who)
        limits = state.get("limits") if state is not None else host.engine_limits
        if not limits:
            why = down_reason or f"engine host {host.name!r} gave no state"
            raise HostNeverSeen(
                f"{why}; it was never reached, so its limits are unknown and the change "
                "cannot be validated (start it, then apply again)"
            )
        base_config = base.config if base else LiveConfig().model_dump(mode="json")
        try:
            new = _validate(base_config, patch, limits)
        except ConfigRefused as exc:
            record_audit(
                store,
                actor=author,
                origin=who,
                action=f"config.{source}",
                outcome="refused",
                host_name=host.name,
                message=str(exc),
                detail={"patch": patch, "reason": reason},
            )
            raise
        if state is not None and base is not None and state.get("config") != base.config:
            notes.append(
                f"the engine's config differed from version {base.version} (changed outside the control "
                "plane, or an engine restart); this version replaces it whole"
            )
        pending = record_version(
            store,
            host.id,
            config=new.model_dump(mode="json"),
            author=author,
            reason=reason,
            source=source,
            base=base,
            rollback_of=rollback_of,
        )
        if down_reason is not None:
            result = ApplyResult(
                host=host.name,
                version=pending.version,
                status=FAILED,
                config=pending.config,
                diff=pending.diff,
                message=f"{down_reason} (not applied; retry when it is back)",
            )
            record_outcome(store, pending.id, status=FAILED, message=result.message)
        else:
            result = _send(store, client, host, pending)
        result.notes = notes + result.notes
        with store.writer() as s:
            audit(
                s,
                actor=author,
                origin=who,
                action=f"config.{source}",
                outcome="ok" if result.ok else "failed",
                host_name=host.name,
                message=f"version {result.version}: {result.message}",
                detail={
                    "version": result.version,
                    "reason": reason,
                    "diff": result.diff,
                    "rollback_of": rollback_of,
                    "notes": result.notes,
                },
            )
        return result
    finally:
        release_lease(store, host.id, token)
        if own_client:
            client.close()


def rollback(
    store: Store,
    host_name: str,
    version: int,
    *,
    reason: str,
    author: str | None = None,
    interface: str = "api",
    client: EngineClient | None = None,
) -> ApplyResult:
    """Apply version ``version``'s full config again, as a new version (``source = rollback``).

    Raises:
        UnknownVersion, and everything :func:`apply_change` raises.
    """
    old = get_version(store, host_name, version)
    return apply_change(
        store,
        host_name,
        old.config,
        reason=reason,
        author=author,
        interface=interface,
        source="rollback",
        rollback_of=version,
        client=client,
    )


@dataclass
class ReconcileResult:
    """What :func:`reconcile` found: ``restarted`` (identity changed), ``imported``
    (first version recorded from the engine), ``reapplied`` (the apply result)."""

    restarted: bool = False
    imported: int | None = None
    reapplied: ApplyResult | None = None
    notes: list[str] = field(default_factory=list)


def reconcile(
    store: Store, host_name: str, client: EngineClient | None = None, interface: str = "collector"
) -> ReconcileResult:
    """Bring the store and a reachable engine host into agreement.

    First contact: remember the identity and import the engine's config as version 1.
    Identity changed (the engine restarted): record it in the audit trail and, when the
    engine's config differs from the last applied version, re-apply that version as a
    new one (``source = reapply``, author ``control-plane``).

    Raises:
        UnknownHost; EngineUnreachable / EngineAuthError when the engine cannot be read.
    """
    host = get_host(store, host_name)
    own_client = client is None
    client = client or EngineClient.for_host(host)
    who = origin(interface)
    out = ReconcileResult()
    try:
        state = client.state()
        pid, started = _identity(state)
        known = (host.engine_pid, host.engine_started_at)
        out.restarted = host.engine_started_at is not None and (pid, started) != known
        set_engine_identity(store, host.id, pid=pid, started_at=started, limits=state.get("limits"))
        base = last_applied(store, host.id)
        if base is None and not pending_versions(store, host.id):
            out.imported = import_engine_config(store, host, state, who).version
            return out
        if not out.restarted:
            return out
        msg = f"engine restarted: pid {known[0]} -> {pid}, started at {started}"
        record_audit(
            store,
            actor=SYSTEM_ACTOR,
            origin=who,
            action="engine.restart",
            outcome="ok",
            host_name=host.name,
            message=msg,
            detail={"old": list(known), "new": [pid, started]},
        )
        out.notes.append(msg)
        if base is not None and state.get("config") != base.config:
            out.reapplied = apply_change(
                store,
                host.name,
                base.config,
                author=SYSTEM_ACTOR,
                interface=interface,
                source="reapply",
                reason=f"engine host restarted (pid {known[0]} -> {pid}); re-applying version {base.version}",
                rollback_of=base.version,
                client=client,
            )
        elif base is not None:
            set_engine_config_version(store, host.id, state.get("config_version"))
            out.notes.append(f"the restarted engine already runs version {base.version}'s config")
        return out
    finally:
        if own_client:
            client.close()
