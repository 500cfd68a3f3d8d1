"""Config versions in the store: numbering, outcomes, history, diffs, and the per-host
apply lease that serialises applies across processes.

Versions are numbered by the control plane per host (1, 2, 3 ...), independently of the
engine host's own counter (stored as ``engine_version``). A version row is immutable
except for its outcome, which moves once from ``pending`` to ``applied`` or ``failed``
(enforced in ``control.models``). The apply flow itself is ``control.apply``.

The store's version *in force* on a host is its newest ``applied`` version
(:func:`version_in_force`); the engine's own counter that carries it is kept on the
host (``Host.engine_config_version``), recorded whenever a version is applied, so that
drift detection (:mod:`control.drift`) can compare by that mapping: the engine's counter
restarts at 1 with the engine while the store's numbers go on.

The apply lease records its holder (who, machine, PID and the PID's start time, since
when): a waiting apply says whom it waits for, and a lease whose holder process is gone
(on this machine) is released at once instead of blocking the host until it expires.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Any, Callable, cast

from sqlalchemy import CursorResult, func, select, update

from engine_host.config import diff_configs

from .models import ConfigVersion, Host
from .store import ControlError, Store, active_host, audit, current_user

log = logging.getLogger("specpilot.apply")

PENDING, APPLIED, FAILED = "pending", "applied", "failed"


class UnknownVersion(ControlError, LookupError):
    """The host has no config version of that number."""


class ApplyBusy(ControlError):
    """Another apply holds the host's lease longer than we were willing to wait."""


def history(store: Store, host: str, limit: int | None = None) -> list[ConfigVersion]:
    """A host's config versions, newest first.

    Raises:
        UnknownHost: no such host.
    """
    with store.reader() as s:
        h = active_host(s, host)
        q = select(ConfigVersion).where(ConfigVersion.host_id == h.id).order_by(ConfigVersion.version.desc())
        if limit:
            q = q.limit(limit)
        return list(s.scalars(q))


def get_version(store: Store, host: str, version: int) -> ConfigVersion:
    """One version of a host.

    Raises:
        UnknownHost, UnknownVersion.
    """
    with store.reader() as s:
        h = active_host(s, host)
        v = s.scalars(
            select(ConfigVersion).where(ConfigVersion.host_id == h.id, ConfigVersion.version == version)
        ).first()
        if v is None:
            last = s.scalar(select(func.max(ConfigVersion.version)).where(ConfigVersion.host_id == h.id))
            raise UnknownVersion(
                f"host {host!r} has no config version {version}"
                + (f" (versions 1..{last})" if last else " (no versions yet)")
            )
        return v


def last_applied(store: Store, host_id: int) -> ConfigVersion | None:
    """The newest version whose outcome is ``applied`` (the config the engine should have)."""
    with store.reader() as s:
        return s.scalars(
            select(ConfigVersion)
            .where(ConfigVersion.host_id == host_id, ConfigVersion.status == APPLIED)
            .order_by(ConfigVersion.version.desc())
            .limit(1)
        ).first()


def version_in_force(store: Store, host: str) -> ConfigVersion | None:
    """The store's version in force on host ``host``: its newest ``applied`` version
    (None before the first contact). This is the number to show operators; the engine's
    own ``config_version`` restarts at 1 with the engine (the one that carries this
    version is ``Host.engine_config_version``).

    Raises:
        UnknownHost: no such host.
    """
    with store.reader() as s:
        h = active_host(s, host)
    return last_applied(store, h.id)


def set_engine_config_version(store: Store, host_id: int, engine_version: int | None) -> None:
    """Record that the engine's own ``config_version`` ``engine_version`` carries the
    store's version in force (e.g. a restarted engine that already runs it)."""
    with store.writer() as s:
        h = s.get(Host, host_id)
        if h is not None:
            h.engine_config_version = engine_version


def pending_versions(store: Store, host_id: int) -> list[ConfigVersion]:
    """Versions still ``pending`` (an apply in flight, or one interrupted), oldest first."""
    with store.reader() as s:
        return list(
            s.scalars(
                select(ConfigVersion)
                .where(ConfigVersion.host_id == host_id, ConfigVersion.status == PENDING)
                .order_by(ConfigVersion.version)
            )
        )


def diff_versions(store: Store, host: str, a: int, b: int) -> list[dict[str, Any]]:
    """Field-by-field difference from version ``a`` to version ``b``:
    ``[{"field": "speculation.k", "old": 2, "new": 4}, ...]``.

    Raises:
        UnknownHost, UnknownVersion.
    """
    return diff_configs(get_version(store, host, a).config, get_version(store, host, b).config)


def record_version(
    store: Store,
    host_id: int,
    *,
    config: dict[str, Any],
    author: str,
    reason: str,
    source: str,
    base: ConfigVersion | None,
    rollback_of: int | None = None,
    status: str = PENDING,
    engine_version: int | None = None,
    message: str | None = None,
) -> ConfigVersion:
    """Write a new version with the next number (host row locked while numbering).

    Args:
        config: the full ``LiveConfig`` dict; base: the version it is diffed against
        (None: diff against nothing); status: ``pending`` (an apply follows) or
        ``applied`` (imported from the engine).
    """
    now = time.time()
    with store.writer() as s:
        s.scalars(select(Host.id).where(Host.id == host_id).with_for_update()).first()
        n = (s.scalar(select(func.max(ConfigVersion.version)).where(ConfigVersion.host_id == host_id)) or 0) + 1
        v = ConfigVersion(
            host_id=host_id,
            version=n,
            created_at=now,
            author=author,
            reason=reason,
            source=source,
            base_version=base.version if base else None,
            rollback_of=rollback_of,
            config=config,
            diff=diff_configs(base.config, config) if base else [],
            status=status,
            finished_at=now if status != PENDING else None,
            engine_version=engine_version,
            engine_message=message,
        )
        s.add(v)
        if status == APPLIED:
            host = s.get(Host, host_id)
            assert host is not None  # the host row was locked above
            host.engine_config_version = engine_version
        s.flush()
        return v


def record_outcome(
    store: Store,
    version_id: int,
    *,
    status: str,
    engine_version: int | None = None,
    message: str | None = None,
    apply_latency_ms: float | None = None,
) -> ConfigVersion:
    """Set a pending version's outcome (``applied`` or ``failed``) with the engine's
    message and the apply latency (ms).

    Raises:
        ValueError: the version has an outcome already.
    """
    with store.writer() as s:
        v = s.get(ConfigVersion, version_id)
        assert v is not None, f"no config version with id {version_id}"
        if v.status != PENDING:
            raise ValueError(f"version {v.version} already has its outcome ({v.status})")
        v.status, v.finished_at = status, time.time()
        v.engine_version, v.engine_message, v.apply_latency_ms = engine_version, message, apply_latency_ms
        if status == APPLIED:
            host = s.get(Host, v.host_id)
            assert host is not None  # a version's host row is never deleted
            host.engine_config_version = engine_version
        s.flush()
        return v


# --------------------------------------------------------------------------- apply lease


def _pid_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/PID/stat``
    field 22), or None when there is no such process (or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def lease_holder(who: str | None = None) -> dict[str, Any]:
    """This process as a lease holder: ``{"who", "machine", "pid", "pid_start", "since"}``."""
    pid = os.getpid()
    return {
        "who": who or current_user(),
        "machine": socket.gethostname(),
        "pid": pid,
        "pid_start": _pid_start(pid),
        "since": time.time(),
    }


def holder_gone(info: dict[str, Any] | None) -> bool:
    """True when the lease holder ran on this machine and its process is gone (no such
    PID, or the PID now belongs to a process started later). A holder on another machine
    is never judged gone: its lease expires on its own."""
    if not info or info.get("machine") != socket.gethostname() or not info.get("pid"):
        return False
    start = _pid_start(int(info["pid"]))
    return start is None or (info.get("pid_start") is not None and start != info["pid_start"])


def describe_holder(info: dict[str, Any] | None, until: float | None) -> str:
    """``"cli (alice) pid 4242 on box since 12:00:01 UTC, lease until 12:01:01 UTC"``."""

    def hms(t: float | None) -> str:
        return time.strftime("%H:%M:%S UTC", time.gmtime(t)) if t else "?"

    if not info:
        return f"another apply (lease until {hms(until)})"
    return (
        f"{info.get('who', '?')} pid {info.get('pid', '?')} on {info.get('machine', '?')} since "
        f"{hms(info.get('since'))}, lease until {hms(until)}"
    )


def acquire_lease(
    store: Store,
    host_id: int,
    ttl_s: float = 60.0,
    wait_s: float = 60.0,
    poll_s: float = 0.05,
    who: str | None = None,
    on_wait: Callable[[str], None] | None = None,
    tell_every_s: float = 10.0,
) -> str:
    """Take the host's apply lease (one apply at a time per host, across processes).

    A lease expires after ``ttl_s`` seconds; a lease whose holder process is gone (on
    this machine, see :func:`holder_gone`) is released at once (audited as
    ``config.lease_released``). While waiting, ``on_wait`` (default: a warning on the
    ``specpilot.apply`` logger) is told whom we wait for, at once and every
    ``tell_every_s`` s. Polls every ``poll_s`` s until ``wait_s`` s have passed.

    Args:
        who: the holder's description recorded with the lease (e.g. ``"cli (alice)"``).
    Returns:
        The lease token (give it to :func:`release_lease`).
    Raises:
        ApplyBusy: still held by someone else after ``wait_s`` seconds (the message
        names the holder).
    """
    token = uuid.uuid4().hex
    deadline = time.monotonic() + wait_s
    tell = on_wait or log.warning
    told_at: float | None = None
    info = lease_holder(who)
    while True:
        now = time.time()
        with store.writer() as s:
            taken = cast(
                CursorResult[Any],
                s.execute(
                    update(Host)
                    .where(Host.id == host_id)
                    .where((Host.apply_lock_until.is_(None)) | (Host.apply_lock_until < now))
                    .values(apply_lock_owner=token, apply_lock_until=now + ttl_s, apply_lock_info=info)
                ),
            ).rowcount
            if not taken:
                name, owner, until, held = s.execute(
                    select(Host.name, Host.apply_lock_owner, Host.apply_lock_until, Host.apply_lock_info).where(
                        Host.id == host_id
                    )
                ).one()
                if holder_gone(held):
                    taken = cast(
                        CursorResult[Any],
                        s.execute(
                            update(Host)
                            .where(Host.id == host_id, Host.apply_lock_owner == owner)
                            .values(apply_lock_owner=token, apply_lock_until=now + ttl_s, apply_lock_info=info)
                        ),
                    ).rowcount
                    if taken:
                        msg = f"released the apply lease of {describe_holder(held, until)}: its process is gone"
                        audit(
                            s,
                            actor=info["who"],
                            origin=f"{info['machine']} pid {info['pid']}",
                            action="config.lease_released",
                            outcome="ok",
                            host_name=name,
                            message=msg,
                            detail={"holder": held},
                        )
                        log.warning("host %s: %s", name, msg)
        if taken:
            return token
        if time.monotonic() >= deadline:
            raise ApplyBusy(
                f"another apply holds host {name!r}: {describe_holder(held, until)}; waited {wait_s:.0f} s, try again"
            )
        if told_at is None or time.monotonic() - told_at >= tell_every_s:
            tell(f"host {name}: waiting for the apply lease held by {describe_holder(held, until)}")
            told_at = time.monotonic()
        time.sleep(poll_s)


def release_lease(store: Store, host_id: int, token: str) -> None:
    """Give the lease back (no-op when it expired and someone else took it)."""
    with store.writer() as s:
        s.execute(
            update(Host)
            .where(Host.id == host_id, Host.apply_lock_owner == token)
            .values(apply_lock_owner=None, apply_lock_until=None, apply_lock_info=None)
        )
