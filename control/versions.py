"""Config versions in the store: numbering, outcomes, history, diffs, and the per-host
apply lease that serialises applies across processes.

Versions are numbered by the control plane per host (1, 2, 3 ...), independently of the
engine host's own counter (stored as ``engine_version``). A version row is immutable
except for its outcome, which moves once from ``pending`` to ``applied`` or ``failed``
(enforced in ``control.models``). The apply flow itself is ``control.apply``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from sqlalchemy import func, select, update

from engine_host.config import diff_configs

from .models import ConfigVersion, Host
from .store import ControlError, Store, active_host

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
        v = s.scalars(select(ConfigVersion).where(ConfigVersion.host_id == h.id,
                                                  ConfigVersion.version == version)).first()
        if v is None:
            last = s.scalar(select(func.max(ConfigVersion.version)).where(ConfigVersion.host_id == h.id))
            raise UnknownVersion(f"host {host!r} has no config version {version}"
                                 + (f" (versions 1..{last})" if last else " (no versions yet)"))
        return v


def last_applied(store: Store, host_id: int) -> ConfigVersion | None:
    """The newest version whose outcome is ``applied`` (the config the engine should have)."""
    with store.reader() as s:
        return s.scalars(select(ConfigVersion).where(ConfigVersion.host_id == host_id, ConfigVersion.status == APPLIED)
                         .order_by(ConfigVersion.version.desc()).limit(1)).first()


def pending_versions(store: Store, host_id: int) -> list[ConfigVersion]:
    """Versions still ``pending`` (an apply in flight, or one interrupted), oldest first."""
    with store.reader() as s:
        return list(s.scalars(select(ConfigVersion).where(ConfigVersion.host_id == host_id,
                                                          ConfigVersion.status == PENDING)
                              .order_by(ConfigVersion.version)))


def diff_versions(store: Store, host: str, a: int, b: int) -> list[dict[str, Any]]:
    """Field-by-field difference from version ``a`` to version ``b``:
    ``[{"field": "speculation.k", "old": 2, "new": 4}, ...]``.

    Raises:
        UnknownHost, UnknownVersion.
    """
    return diff_configs(get_version(store, host, a).config, get_version(store, host, b).config)


def record_version(store: Store, host_id: int, *, config: dict[str, Any], author: str, reason: str, source: str,
                   base: ConfigVersion | None, rollback_of: int | None = None, status: str = PENDING,
                   engine_version: int | None = None, message: str | None = None) -> ConfigVersion:
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
            host_id=host_id, version=n, created_at=now, author=author, reason=reason, source=source,
            base_version=base.version if base else None, rollback_of=rollback_of, config=config,
            diff=diff_configs(base.config, config) if base else [], status=status,
            finished_at=now if status != PENDING else None, engine_version=engine_version, engine_message=message,
        )
        s.add(v)
        s.flush()
        return v


def record_outcome(store: Store, version_id: int, *, status: str, engine_version: int | None = None,
                   message: str | None = None, apply_latency_ms: float | None = None) -> ConfigVersion:
    """Set a pending version's outcome (``applied`` or ``failed``) with the engine's
    message and the apply latency (ms).

    Raises:
        ValueError: the version has an outcome already.
    """
    with store.writer() as s:
        v = s.get(ConfigVersion, version_id)
        if v.status != PENDING:
            raise ValueError(f"version {v.version} already has its outcome ({v.status})")
        v.status, v.finished_at = status, time.time()
        v.engine_version, v.engine_message, v.apply_latency_ms = engine_version, message, apply_latency_ms
        s.flush()
        return v


# --------------------------------------------------------------------------- apply lease

def acquire_lease(store: Store, host_id: int, ttl_s: float = 60.0, wait_s: float = 60.0,
                  poll_s: float = 0.05) -> str:
    """Take the host's apply lease (one apply at a time per host, across processes).

    A lease expires after ``ttl_s`` seconds, so a process killed mid-apply does not
    block the host for long. Polls every ``poll_s`` s until ``wait_s`` s have passed.

    Returns:
        The lease token (give it to :func:`release_lease`).
    Raises:
        ApplyBusy: still held by someone else after ``wait_s`` seconds.
    """
    token = uuid.uuid4().hex
    deadline = time.monotonic() + wait_s
    while True:
        now = time.time()
        with store.writer() as s:
            taken = s.execute(
                update(Host).where(Host.id == host_id)
                .where((Host.apply_lock_until.is_(None)) | (Host.apply_lock_until < now))
                .values(apply_lock_owner=token, apply_lock_until=now + ttl_s)
            ).rowcount
        if taken:
            return token
        if time.monotonic() >= deadline:
            with store.reader() as s:
                owner = s.scalar(select(Host.apply_lock_owner).where(Host.id == host_id))
            raise ApplyBusy(f"another apply (lease {owner}) is in progress on this host; "
                            f"waited {wait_s:.0f} s, try again")
        time.sleep(poll_s)


def release_lease(store: Store, host_id: int, token: str) -> None:
    """Give the lease back (no-op when it expired and someone else took it)."""
    with store.writer() as s:
        s.execute(update(Host).where(Host.id == host_id, Host.apply_lock_owner == token)
                  .values(apply_lock_owner=None, apply_lock_until=None))
