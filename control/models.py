"""The control plane's tables as typed SQLAlchemy 2 models.

The schema is created and changed only by the Alembic revisions in ``migrations/``
(``control.db.upgrade``); these classes describe it for queries. Times are unix
seconds (float, UTC); configs are the JSON of :class:`engine_host.config.LiveConfig`.

Tables:
    hosts             engine hosts: name, URL, token *variable name*, GPU kind, USD/hour,
                      the engine identity last seen and the apply lease
    config_versions   immutable config versions per host, numbered by the control plane
    audit_events      who did what, when, from where, with what outcome
    metric_samples    per-host samples at 1 s, 60 s and 3600 s resolution
    collection_gaps   spans during which a host could not be scraped
    alert_rules       rules as data (metric, comparison, threshold, duration)
    alert_events      alerts that fired, with start and end
    warmup_schedules  heartbeat schedules per host (``HeartbeatSchedule`` JSON)
    warmup_runs       warm-up and heartbeat runs reported by engine hosts
    rollouts          canary rollouts of a config across hosts, step by step
    config_drifts     spans during which an engine's config differed from the store's
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    event,
    inspect,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

#: JSON on SQLite (TEXT), JSONB on PostgreSQL.
JSONType = JSON().with_variant(JSONB(), "postgresql")

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Declarative base; ``Base.metadata`` is what Alembic compares against."""

    metadata = MetaData(naming_convention=NAMING)


class Host(Base):
    """An engine host the control plane manages.

    The control token is never stored: ``token_env`` names the environment variable
    that holds it at use time. ``removed_at`` marks a removed host (its history stays);
    adding the name again brings it back.
    """

    __tablename__ = "hosts"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    url: Mapped[str] = mapped_column(String(512))
    token_env: Mapped[str] = mapped_column(String(128), default="SPECPILOT_CONTROL_TOKEN")
    gpu_kind: Mapped[str | None] = mapped_column(String(64))
    usd_per_hour: Mapped[float] = mapped_column(Float, default=0.0)
    created_at: Mapped[float] = mapped_column(Float)
    removed_at: Mapped[float | None] = mapped_column(Float)
    # Engine identity and start-up limits, as last seen (restart detection, offline validation).
    engine_pid: Mapped[int | None] = mapped_column(Integer)
    engine_started_at: Mapped[float | None] = mapped_column(Float)
    engine_limits: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    last_seen_at: Mapped[float | None] = mapped_column(Float)
    # Apply lease: one apply at a time per host, across processes (expires on its own).
    apply_lock_owner: Mapped[str | None] = mapped_column(String(128))
    apply_lock_until: Mapped[float | None] = mapped_column(Float)
    # Who holds the lease: {"who", "origin", "machine", "pid", "pid_start", "since"} (so a
    # waiting apply can say whom it waits for, and a lease of a dead process is released).
    apply_lock_info: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    # The engine's own config_version that carries the store's version in force (recorded
    # at apply, import, adopt; re-recorded when a restarted engine already runs it).
    engine_config_version: Mapped[int | None] = mapped_column(Integer)


class ConfigVersion(Base):
    """One config version of one host. Immutable once written, except that its outcome
    moves once from ``pending`` to ``applied`` or ``failed``.

    ``source``: ``import`` (the engine's own config, first contact), ``apply``,
    ``rollback`` (``rollback_of`` names the version restored) or ``reapply`` (after an
    engine restart). ``diff`` is against ``base_version`` (the last applied version).
    """

    __tablename__ = "config_versions"
    __table_args__ = (UniqueConstraint("host_id", "version", name="uq_config_versions_host_version"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    author: Mapped[str] = mapped_column(String(128))
    reason: Mapped[str] = mapped_column(Text)
    source: Mapped[str] = mapped_column(String(16))
    base_version: Mapped[int | None] = mapped_column(Integer)
    rollback_of: Mapped[int | None] = mapped_column(Integer)
    config: Mapped[dict[str, Any]] = mapped_column(JSONType)
    diff: Mapped[list[dict[str, Any]]] = mapped_column(JSONType)
    status: Mapped[str] = mapped_column(String(16))
    finished_at: Mapped[float | None] = mapped_column(Float)
    engine_version: Mapped[int | None] = mapped_column(Integer)
    engine_message: Mapped[str | None] = mapped_column(Text)
    apply_latency_ms: Mapped[float | None] = mapped_column(Float)


_IMMUTABLE = (
    "host_id",
    "version",
    "created_at",
    "author",
    "reason",
    "source",
    "base_version",
    "rollback_of",
    "config",
    "diff",
)


@event.listens_for(ConfigVersion, "before_update")
def _config_versions_are_immutable(mapper: Any, connection: Any, target: ConfigVersion) -> None:
    state = inspect(target)
    changed = [name for name in _IMMUTABLE if state.attrs[name].history.has_changes()]
    if changed:
        raise ValueError(f"config versions are immutable; refused change of {', '.join(changed)}")
    status_hist = state.attrs["status"].history
    if status_hist.has_changes() and status_hist.deleted and status_hist.deleted[0] != "pending":
        raise ValueError(f"version {target.version} already has its outcome ({status_hist.deleted[0]})")


class AuditEvent(Base):
    """Who (``actor``) did what (``action``, ``detail``), when, from where (``origin``:
    machine, process, interface) and with what ``outcome`` (ok, failed, refused)."""

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    at: Mapped[float] = mapped_column(Float, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    origin: Mapped[str] = mapped_column(String(256))
    action: Mapped[str] = mapped_column(String(64))
    host_name: Mapped[str | None] = mapped_column(String(64), index=True)
    outcome: Mapped[str] = mapped_column(String(16))
    message: Mapped[str | None] = mapped_column(Text)
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSONType)


class MetricSample(Base):
    """A host's figures over one interval.

    ``resolution_s`` is 1 (one scrape interval; latency percentiles and acceptance
    over the collector's trailing window), 60 or 3600 (roll-ups: sums, time-weighted
    means, maxima, percentiles of the merged histogram buckets). ``t`` is the start
    of the interval (unix s). ``hist`` holds the histogram bucket deltas of the
    interval, ``{"ttft"|"itl"|"e2e"|"queue": {"<upper bound s>": count}}``, so that
    roll-ups compute exact bucket percentiles.
    """

    __tablename__ = "metric_samples"

    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True)
    resolution_s: Mapped[int] = mapped_column(Integer, primary_key=True)
    t: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    covered_s: Mapped[float] = mapped_column(Float)
    busy_s: Mapped[float] = mapped_column(Float)
    output_tokens: Mapped[float] = mapped_column(Float)
    user_output_tokens: Mapped[float | None] = mapped_column(Float)
    prompt_tokens: Mapped[float] = mapped_column(Float)
    requests_finished: Mapped[float] = mapped_column(Float, default=0.0)
    output_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    ttft_p50_ms: Mapped[float | None] = mapped_column(Float)
    ttft_p95_ms: Mapped[float | None] = mapped_column(Float)
    ttft_p99_ms: Mapped[float | None] = mapped_column(Float)
    itl_p50_ms: Mapped[float | None] = mapped_column(Float)
    itl_p95_ms: Mapped[float | None] = mapped_column(Float)
    itl_p99_ms: Mapped[float | None] = mapped_column(Float)
    e2e_p50_ms: Mapped[float | None] = mapped_column(Float)
    e2e_p95_ms: Mapped[float | None] = mapped_column(Float)
    e2e_p99_ms: Mapped[float | None] = mapped_column(Float)
    queue_p50_ms: Mapped[float | None] = mapped_column(Float)
    queue_p95_ms: Mapped[float | None] = mapped_column(Float)
    queue_p99_ms: Mapped[float | None] = mapped_column(Float)
    kv_cache_usage: Mapped[float | None] = mapped_column(Float)
    kv_cache_usage_max: Mapped[float | None] = mapped_column(Float)
    running: Mapped[float | None] = mapped_column(Float)
    running_max: Mapped[float | None] = mapped_column(Float)
    waiting: Mapped[float | None] = mapped_column(Float)
    waiting_max: Mapped[float | None] = mapped_column(Float)
    num_drafts: Mapped[float] = mapped_column(Float, default=0.0)
    draft_tokens: Mapped[float] = mapped_column(Float, default=0.0)
    accepted_tokens: Mapped[float] = mapped_column(Float, default=0.0)
    acceptance_rate: Mapped[float | None] = mapped_column(Float)
    accepted_per_pos: Mapped[list[float] | None] = mapped_column(JSONType)
    draft_tokens_per_pos: Mapped[list[float] | None] = mapped_column(JSONType)
    acceptance_per_position: Mapped[list[float | None] | None] = mapped_column(JSONType)
    k: Mapped[float | None] = mapped_column(Float)
    mode: Mapped[str | None] = mapped_column(String(16))
    config_version: Mapped[int | None] = mapped_column(Integer)
    max_num_seqs: Mapped[int | None] = mapped_column(Integer)
    hist: Mapped[dict[str, dict[str, float]] | None] = mapped_column(JSONType)


class CollectionGap(Base):
    """A span during which a host could not be scraped (``ended_at`` None while it lasts)."""

    __tablename__ = "collection_gaps"
    __table_args__ = (Index("ix_collection_gaps_host_started", "host_id", "started_at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(Text)


class AlertRule(Base):
    """An alert rule, editable data: fires when ``<metric> <op> <threshold>`` holds for
    ``for_s`` seconds on a host (all hosts when ``host_id`` is None).

    ``metric`` names a field of a 1 s sample (e.g. ``acceptance_rate``,
    ``kv_cache_usage``, ``queue_p99_ms``) or ``up`` (1 scraped, 0 not).
    """

    __tablename__ = "alert_rules"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    metric: Mapped[str] = mapped_column(String(64))
    op: Mapped[str] = mapped_column(String(2))
    threshold: Mapped[float] = mapped_column(Float)
    for_s: Mapped[float] = mapped_column(Float, default=0.0)
    severity: Mapped[str] = mapped_column(String(16), default="warning")
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    host_id: Mapped[int | None] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    description: Mapped[str | None] = mapped_column(Text)


class AlertEvent(Base):
    """An alert that fired: from ``started_at`` (when the condition began) to
    ``ended_at`` (None while open). ``value`` is the metric when it fired, ``peak`` the
    worst value seen while open."""

    __tablename__ = "alert_events"
    __table_args__ = (Index("ix_alert_events_host_started", "host_id", "started_at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    rule_id: Mapped[int] = mapped_column(ForeignKey("alert_rules.id", ondelete="CASCADE"))
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    value: Mapped[float | None] = mapped_column(Float)
    peak: Mapped[float | None] = mapped_column(Float)
    message: Mapped[str] = mapped_column(Text)


class WarmupSchedule(Base):
    """A heartbeat schedule kept for a host; ``spec`` is a validated
    :class:`engine_host.config.HeartbeatSchedule` dump (applied through a config version)."""

    __tablename__ = "warmup_schedules"
    __table_args__ = (UniqueConstraint("host_id", "name", name="uq_warmup_schedules_host_name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class WarmupRun(Base):
    """A warm-up or heartbeat run as reported by ``GET /control/warmup/runs``
    (``run_id`` is the engine's id, unique per engine start)."""

    __tablename__ = "warmup_runs"
    __table_args__ = (
        UniqueConstraint("host_id", "engine_started_at", "run_id", name="uq_warmup_runs_engine_run"),
        Index("ix_warmup_runs_host_started", "host_id", "started_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    engine_started_at: Mapped[float] = mapped_column(Float)
    run_id: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))
    schedule: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[float] = mapped_column(Float)
    duration_s: Mapped[float | None] = mapped_column(Float)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    output_tokens: Mapped[int | None] = mapped_column(Integer)
    k: Mapped[int | None] = mapped_column(Integer)
    outcome: Mapped[str] = mapped_column(String(16))
    detail: Mapped[str | None] = mapped_column(Text)


class Rollout(Base):
    """A canary rollout of one config change across hosts (``control.rollout``).

    ``hosts`` is the order of application (the canary first); ``guards`` the guard
    expressions (``"ttft_p99_ms <= 1.1 * baseline"``); ``phase`` where it stands
    (``canary``: applying to the canary, ``watch``: watching it, ``stages``: applying
    to the others, ``done``); ``status`` ``running``, ``succeeded``, ``rolled_back`` or
    ``failed``; ``steps`` every step with its outcome and the config version it made.
    ``owner``/``heartbeat_at``: the process running it, so that another one can take
    over a rollout whose process died (``resume``).
    """

    __tablename__ = "rollouts"

    id: Mapped[int] = mapped_column(primary_key=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    author: Mapped[str] = mapped_column(String(128))
    reason: Mapped[str] = mapped_column(Text)
    patch: Mapped[dict[str, Any]] = mapped_column(JSONType)
    hosts: Mapped[list[str]] = mapped_column(JSONType)
    canary: Mapped[str] = mapped_column(String(64))
    watch_s: Mapped[float] = mapped_column(Float)
    guards: Mapped[list[str]] = mapped_column(JSONType)
    baseline: Mapped[str] = mapped_column(String(16))
    phase: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), index=True)
    watch_started_at: Mapped[float | None] = mapped_column(Float)
    canary_base_version: Mapped[int | None] = mapped_column(Integer)
    baseline_figures: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    steps: Mapped[list[dict[str, Any]]] = mapped_column(JSONType)
    message: Mapped[str | None] = mapped_column(Text)
    owner: Mapped[str | None] = mapped_column(String(64))
    heartbeat_at: Mapped[float | None] = mapped_column(Float)


class LoginFailure(Base):
    """A failed dashboard login for a user name (``failed_at`` unix s). Lock-out is
    counted from these rows (:func:`control.auth.authenticate`), so it survives a
    dashboard restart; a successful login deletes the name's rows."""

    __tablename__ = "login_failures"
    __table_args__ = (Index("ix_login_failures_name_failed_at", "name", "failed_at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    failed_at: Mapped[float] = mapped_column(Float)


class ConfigDrift(Base):
    """A span during which the engine's config (content or version) differed from the
    store's version in force (``ended_at`` None while it lasts).

    Both sides are kept: ``store_version`` (the control plane's number),
    ``store_engine_version`` (the engine version recorded for it), ``store_config``;
    ``engine_version`` (the engine's own ``config_version``), ``engine_config``,
    ``engine_started_at`` (unix s). ``diff`` is store -> engine
    (``[{"field", "old", "new"}]``). ``resolution``: ``reapply`` or ``adopt`` (an
    operator's action, ``resolved_version`` the version it made), ``agreed`` (the sides
    agree again by themselves) or ``changed`` (the engine side changed; a new drift follows).
    """

    __tablename__ = "config_drifts"
    __table_args__ = (Index("ix_config_drifts_host_detected", "host_id", "detected_at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    detected_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    store_version: Mapped[int | None] = mapped_column(Integer)
    store_engine_version: Mapped[int | None] = mapped_column(Integer)
    store_config: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    engine_version: Mapped[int | None] = mapped_column(Integer)
    engine_started_at: Mapped[float | None] = mapped_column(Float)
    engine_config: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    diff: Mapped[list[dict[str, Any]]] = mapped_column(JSONType)
    resolution: Mapped[str | None] = mapped_column(String(16))
    resolved_by: Mapped[str | None] = mapped_column(String(128))
    resolved_version: Mapped[int | None] = mapped_column(Integer)
