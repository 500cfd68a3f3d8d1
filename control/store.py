"""The store: sessions on the control plane's database, engine hosts and the audit trail.

Open one with :meth:`Store.open` (migrates to the newest schema). Reads use
:meth:`Store.reader`, writes :meth:`Store.writer` (one transaction each; ``BEGIN
IMMEDIATE`` on SQLite). Objects returned by the functions in ``control.*`` are
detached ORM rows: read their attributes, do not modify them.

Other parts of the store live beside this module: ``control.versions`` (config
versions), ``control.samples`` (metric samples, gaps, downsampling), ``control.alerts``
(rules and events), ``control.warmup`` (warm-up schedules and runs).
"""

from __future__ import annotations

import getpass
import math
import os
import socket
import time
from contextlib import contextmanager
from typing import Any, Iterator
from urllib.parse import urlsplit

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker

from .db import create_db_engine, open_engine, writer
from .models import AuditEvent, Host

DEFAULT_TOKEN_ENV = "SPECPILOT_CONTROL_TOKEN"


class ControlError(RuntimeError):
    """Base of the control plane's errors; the message is fit to show an operator."""


class UnknownHost(ControlError, LookupError):
    """No (active) engine host of that name is registered."""


class BadHostSpec(ControlError, ValueError):
    """A host definition is invalid (bad URL, name, price)."""


def current_user() -> str:
    """The operator's name: ``$USER``, else the login name, else ``unknown``."""
    user = os.environ.get("USER")
    if user:
        return user
    try:
        return getpass.getuser()
    except Exception:
        return "unknown"


def origin(interface: str) -> str:
    """Where an action comes from: ``"<interface>@<machine> pid <pid>"``."""
    return f"{interface}@{socket.gethostname()} pid {os.getpid()}"


class Store:
    """The control plane's database.

    Args:
        engine: an SQLAlchemy engine whose schema is at the newest revision.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._read = sessionmaker(engine, expire_on_commit=False)
        self._write = sessionmaker(writer(engine), expire_on_commit=False)

    @classmethod
    def open(cls, url: str | None = None) -> "Store":
        """Open (and migrate) the store at ``url`` (default: ``$SPECPILOT_DB_URL`` or
        ``$SPECPILOT_HOME/specpilot.db``).

        Raises:
            control.db.StoreError: bad URL, missing driver, unreachable server, failed migration.
        """
        return cls(open_engine(url))

    @classmethod
    def open_unmigrated(cls, url: str | None = None) -> "Store":
        """Open without migrating (a process that knows the schema is current)."""
        return cls(create_db_engine(url))

    def close(self) -> None:
        """Release the database connections."""
        self.engine.dispose()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def reader(self) -> Iterator[Session]:
        """A session in a read transaction."""
        with self._read() as s, s.begin():
            yield s

    @contextmanager
    def writer(self) -> Iterator[Session]:
        """A session in a write transaction (committed on exit, rolled back on error)."""
        with self._write() as s, s.begin():
            yield s

    @property
    def dialect(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self.engine.dialect.name


# --------------------------------------------------------------------------- audit


def audit(
    s: Session,
    *,
    actor: str,
    origin: str,
    action: str,
    outcome: str,
    host_name: str | None = None,
    message: str | None = None,
    detail: dict[str, Any] | None = None,
    at: float | None = None,
) -> AuditEvent:
    """Add an audit event to the session's transaction (written with it).

    Args:
        actor: who (operator name or ``control-plane``); origin: see :func:`origin`;
        action: e.g. ``host.add``, ``config.apply``; outcome: ``ok``, ``failed`` or ``refused``.
    """
    ev = AuditEvent(
        at=time.time() if at is None else at,
        actor=actor,
        origin=origin,
        action=action,
        host_name=host_name,
        outcome=outcome,
        message=message,
        detail=detail,
    )
    s.add(ev)
    return ev


def record_audit(store: Store, **kwargs: Any) -> AuditEvent:
    """:func:`audit` in a transaction of its own."""
    with store.writer() as s:
        return audit(s, **kwargs)


def audit_events(
    store: Store, host: str | None = None, since: float | None = None, limit: int = 200
) -> list[AuditEvent]:
    """Audit events, newest first (optionally of one host, after ``since`` unix s)."""
    q = select(AuditEvent).order_by(AuditEvent.at.desc(), AuditEvent.id.desc()).limit(limit)
    if host:
        q = q.where(AuditEvent.host_name == host)
    if since is not None:
        q = q.where(AuditEvent.at >= since)
    with store.reader() as s:
        return list(s.scalars(q))


# --------------------------------------------------------------------------- hosts


def check_url(url: str) -> str:
    """Normalise an engine host's base URL (``http(s)://host[:port][/prefix]``, no trailing slash).

    Raises:
        BadHostSpec: not an http(s) URL with a host name.
    """
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise BadHostSpec(f"bad URL {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadHostSpec(f"bad URL {url!r}: expected http://HOST[:PORT] (e.g. http://127.0.0.1:8000)")
    if parts.query or parts.fragment:
        raise BadHostSpec(f"bad URL {url!r}: no query or fragment expected")
    return url.strip().rstrip("/")


def _check_name(name: str) -> str:
    name = name.strip()
    if not name or len(name) > 64 or not all(c.isalnum() or c in "-_." for c in name):
        raise BadHostSpec(f"bad host name {name!r}: use 1-64 letters, digits, '-', '_' or '.'")
    return name


def active_host(s: Session, name: str, lock: bool = False) -> Host:
    """The active host ``name`` inside session ``s`` (row-locked with ``lock`` on PostgreSQL).

    Raises:
        UnknownHost: none registered (the message lists the known names).
    """
    q = select(Host).where(Host.name == name, Host.removed_at.is_(None))
    if lock:
        q = q.with_for_update()
    host = s.scalars(q).first()
    if host is None:
        known = ", ".join(s.scalars(select(Host.name).where(Host.removed_at.is_(None)).order_by(Host.name)))
        raise UnknownHost(
            f"no engine host named {name!r} is registered"
            + (f" (known: {known})" if known else " (add one with: python -m control hosts add NAME URL)")
        )
    return host


def add_host(
    store: Store,
    name: str,
    url: str,
    *,
    usd_per_hour: float | None = None,
    gpu_kind: str | None = None,
    token_env: str = DEFAULT_TOKEN_ENV,
    actor: str | None = None,
    origin_: str = "api",
    update: bool = False,
) -> Host:
    """Register an engine host (or bring back a removed one of that name).

    Args:
        name: unique name; url: base URL (``http://host:port``); usd_per_hour: what the
        machine costs (USD/hour, finite, >= 0; None: 0 for a new host, unchanged on update);
        gpu_kind: free text (``H100``, ``cpu``; None: unchanged on update);
        token_env: environment variable that holds its control token at use time;
        update: when the name is registered already, change its settings instead of failing.
    Returns:
        The host row.
    Raises:
        BadHostSpec: invalid name, URL, price or variable name, or the name is taken
            (without ``update``).
    """
    name = _check_name(name)
    url = check_url(url)
    if usd_per_hour is not None and (not math.isfinite(usd_per_hour) or usd_per_hour < 0):
        raise BadHostSpec(f"USD per hour must be a finite number >= 0 (got {usd_per_hour})")
    if not token_env or not token_env.replace("_", "a").isalnum() or token_env[0].isdigit():
        raise BadHostSpec(f"bad environment variable name {token_env!r}")
    actor = actor or current_user()
    now = time.time()
    with store.writer() as s:
        host = s.scalars(select(Host).where(Host.name == name)).first()
        if host is not None and host.removed_at is None and not update:
            raise BadHostSpec(f"host {name!r} is registered already ({host.url}); remove it first or pass update")
        action = "host.add" if host is None or host.removed_at is not None else "host.update"
        if host is None:
            host = Host(name=name, created_at=now)
            s.add(host)
        kept = action == "host.update"  # an update changes only what it names
        host.url, host.token_env = url, token_env
        if usd_per_hour is not None or not kept:
            host.usd_per_hour = float(usd_per_hour or 0.0)
        if gpu_kind is not None or not kept:
            host.gpu_kind = gpu_kind
        host.removed_at = None
        audit(
            s,
            actor=actor,
            origin=origin_,
            action=action,
            outcome="ok",
            host_name=name,
            detail={"url": url, "usd_per_hour": host.usd_per_hour, "gpu_kind": host.gpu_kind, "token_env": token_env},
        )
        s.flush()
        return host


def remove_host(store: Store, name: str, *, actor: str | None = None, origin_: str = "api") -> None:
    """Remove a host from the fleet. Its history (versions, samples, alerts) is kept;
    open alerts and gaps are closed.

    Raises:
        UnknownHost: no active host of that name.
    """
    from .models import AlertEvent, CollectionGap

    now = time.time()
    with store.writer() as s:
        host = active_host(s, name)
        host.removed_at = now
        for ev in s.scalars(select(AlertEvent).where(AlertEvent.host_id == host.id, AlertEvent.ended_at.is_(None))):
            ev.ended_at = now
        for gap in s.scalars(
            select(CollectionGap).where(CollectionGap.host_id == host.id, CollectionGap.ended_at.is_(None))
        ):
            gap.ended_at = now
        audit(s, actor=actor or current_user(), origin=origin_, action="host.remove", outcome="ok", host_name=name)


def get_host(store: Store, name: str) -> Host:
    """The active host called ``name``.

    Raises:
        UnknownHost: none registered (the message lists the known names).
    """
    with store.reader() as s:
        return active_host(s, name)


def list_hosts(store: Store, include_removed: bool = False) -> list[Host]:
    """Registered hosts by name."""
    q = select(Host).order_by(Host.name)
    if not include_removed:
        q = q.where(Host.removed_at.is_(None))
    with store.reader() as s:
        return list(s.scalars(q))


def set_engine_identity(
    store: Store,
    host_id: int,
    *,
    pid: int | None,
    started_at: float | None,
    limits: dict[str, Any] | None,
    seen_at: float | None = None,
) -> None:
    """Remember the engine identity (PID, start time in unix s) and start-up limits last seen."""
    with store.writer() as s:
        host = s.get(Host, host_id)
        if host is None:
            return
        host.engine_pid, host.engine_started_at = pid, started_at
        if limits:
            host.engine_limits = limits
        host.last_seen_at = time.time() if seen_at is None else seen_at
