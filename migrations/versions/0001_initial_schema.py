"""Initial schema: hosts, config versions, audit events, metric samples, collection gaps,
alert rules (with the four default rules) and events, warm-up schedules and runs.

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

#: The default alert rules (data: edit them with ``python -m control alerts rule``).
DEFAULT_RULES = [
    {
        "name": "low_acceptance",
        "metric": "acceptance_rate",
        "op": "<",
        "threshold": 0.5,
        "for_s": 300.0,
        "severity": "warning",
        "enabled": True,
        "description": "Acceptance rate (accepted / draft tokens) under 0.5 for 5 minutes: drafts cost more than they bring.",
    },
    {
        "name": "kv_cache_full",
        "metric": "kv_cache_usage",
        "op": ">",
        "threshold": 0.9,
        "for_s": 0.0,
        "severity": "warning",
        "enabled": True,
        "description": "KV cache usage over 90 %: requests will queue or be preempted.",
    },
    {
        "name": "queue_time_p99",
        "metric": "queue_p99_ms",
        "op": ">",
        "threshold": 500.0,
        "for_s": 0.0,
        "severity": "warning",
        "enabled": True,
        "description": "Request queue time P99 over 500 ms (collector window).",
    },
    {
        "name": "host_down",
        "metric": "up",
        "op": "<",
        "threshold": 1.0,
        "for_s": 5.0,
        "severity": "critical",
        "enabled": True,
        "description": "The engine host's /metrics could not be scraped for 5 s.",
    },
]


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("origin", sa.String(length=256), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("host_name", sa.String(length=64), nullable=True),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("detail", JSON, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_events")),
    )
    op.create_index(op.f("ix_audit_events_at"), "audit_events", ["at"], unique=False)
    op.create_index(op.f("ix_audit_events_host_name"), "audit_events", ["host_name"], unique=False)

    op.create_table(
        "hosts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("url", sa.String(length=512), nullable=False),
        sa.Column("token_env", sa.String(length=128), nullable=False),
        sa.Column("gpu_kind", sa.String(length=64), nullable=True),
        sa.Column("usd_per_hour", sa.Float(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("removed_at", sa.Float(), nullable=True),
        sa.Column("engine_pid", sa.Integer(), nullable=True),
        sa.Column("engine_started_at", sa.Float(), nullable=True),
        sa.Column("engine_limits", JSON, nullable=True),
        sa.Column("last_seen_at", sa.Float(), nullable=True),
        sa.Column("apply_lock_owner", sa.String(length=128), nullable=True),
        sa.Column("apply_lock_until", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hosts")),
        sa.UniqueConstraint("name", name=op.f("uq_hosts_name")),
    )
    op.create_table(
        "alert_rules",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("metric", sa.String(length=64), nullable=False),
        sa.Column("op", sa.String(length=2), nullable=False),
        sa.Column("threshold", sa.Float(), nullable=False),
        sa.Column("for_s", sa.Float(), nullable=False),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=True),
        sa.Column("description", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.id"], name=op.f("fk_alert_rules_host_id_hosts"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alert_rules")),
        sa.UniqueConstraint("name", name=op.f("uq_alert_rules_name")),
    )
    op.create_table(
        "collection_gaps",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.id"], name=op.f("fk_collection_gaps_host_id_hosts"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_collection_gaps")),
    )
    op.create_index("ix_collection_gaps_host_started", "collection_gaps", ["host_id", "started_at"], unique=False)

    op.create_table(
        "config_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("author", sa.String(length=128), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("base_version", sa.Integer(), nullable=True),
        sa.Column("rollback_of", sa.Integer(), nullable=True),
        sa.Column("config", JSON, nullable=False),
        sa.Column("diff", JSON, nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("engine_version", sa.Integer(), nullable=True),
        sa.Column("engine_message", sa.Text(), nullable=True),
        sa.Column("apply_latency_ms", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.id"], name=op.f("fk_config_versions_host_id_hosts"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_config_versions")),
        sa.UniqueConstraint("host_id", "version", name="uq_config_versions_host_version"),
    )
    op.create_index(op.f("ix_config_versions_host_id"), "config_versions", ["host_id"], unique=False)

    op.create_table(
        "metric_samples",
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("resolution_s", sa.Integer(), nullable=False),
        sa.Column("t", sa.BigInteger(), nullable=False),
        sa.Column("covered_s", sa.Float(), nullable=False),
        sa.Column("busy_s", sa.Float(), nullable=False),
        sa.Column("output_tokens", sa.Float(), nullable=False),
        sa.Column("user_output_tokens", sa.Float(), nullable=True),
        sa.Column("prompt_tokens", sa.Float(), nullable=False),
        sa.Column("requests_finished", sa.Float(), nullable=False),
        sa.Column("output_tokens_per_s", sa.Float(), nullable=True),
        sa.Column("ttft_p50_ms", sa.Float(), nullable=True),
        sa.Column("ttft_p95_ms", sa.Float(), nullable=True),
        sa.Column("ttft_p99_ms", sa.Float(), nullable=True),
        sa.Column("itl_p50_ms", sa.Float(), nullable=True),
        sa.Column("itl_p95_ms", sa.Float(), nullable=True),
        sa.Column("itl_p99_ms", sa.Float(), nullable=True),
        sa.Column("e2e_p50_ms", sa.Float(), nullable=True),
        sa.Column("e2e_p95_ms", sa.Float(), nullable=True),
        sa.Column("e2e_p99_ms", sa.Float(), nullable=True),
        sa.Column("queue_p50_ms", sa.Float(), nullable=True),
        sa.Column("queue_p95_ms", sa.Float(), nullable=True),
        sa.Column("queue_p99_ms", sa.Float(), nullable=True),
        sa.Column("kv_cache_usage", sa.Float(), nullable=True),
        sa.Column("kv_cache_usage_max", sa.Float(), nullable=True),
        sa.Column("running", sa.Float(), nullable=True),
        sa.Column("running_max", sa.Float(), nullable=True),
        sa.Column("waiting", sa.Float(), nullable=True),
        sa.Column("waiting_max", sa.Float(), nullable=True),
        sa.Column("num_drafts", sa.Float(), nullable=False),
        sa.Column("draft_tokens", sa.Float(), nullable=False),
        sa.Column("accepted_tokens", sa.Float(), nullable=False),
        sa.Column("acceptance_rate", sa.Float(), nullable=True),
        sa.Column("accepted_per_pos", JSON, nullable=True),
        sa.Column("acceptance_per_position", JSON, nullable=True),
        sa.Column("k", sa.Float(), nullable=True),
        sa.Column("mode", sa.String(length=16), nullable=True),
        sa.Column("config_version", sa.Integer(), nullable=True),
        sa.Column("max_num_seqs", sa.Integer(), nullable=True),
        sa.Column("hist", JSON, nullable=True),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.id"], name=op.f("fk_metric_samples_host_id_hosts"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("host_id", "resolution_s", "t", name=op.f("pk_metric_samples")),
    )
    op.create_table(
        "warmup_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("engine_started_at", sa.Float(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("schedule", sa.String(length=64), nullable=True),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("duration_s", sa.Float(), nullable=True),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("output_tokens", sa.Integer(), nullable=True),
        sa.Column("k", sa.Integer(), nullable=True),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.id"], name=op.f("fk_warmup_runs_host_id_hosts"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_warmup_runs")),
        sa.UniqueConstraint("host_id", "engine_started_at", "run_id", name="uq_warmup_runs_engine_run"),
    )
    op.create_index("ix_warmup_runs_host_started", "warmup_runs", ["host_id", "started_at"], unique=False)

    op.create_table(
        "warmup_schedules",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("spec", JSON, nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.id"], name=op.f("fk_warmup_schedules_host_id_hosts"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_warmup_schedules")),
        sa.UniqueConstraint("host_id", "name", name="uq_warmup_schedules_host_name"),
    )
    op.create_table(
        "alert_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("rule_id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("peak", sa.Float(), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.id"], name=op.f("fk_alert_events_host_id_hosts"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["rule_id"], ["alert_rules.id"], name=op.f("fk_alert_events_rule_id_alert_rules"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alert_events")),
    )
    op.create_index("ix_alert_events_host_started", "alert_events", ["host_id", "started_at"], unique=False)
    rules = sa.table(
        "alert_rules",
        sa.column("name", sa.String),
        sa.column("metric", sa.String),
        sa.column("op", sa.String),
        sa.column("threshold", sa.Float),
        sa.column("for_s", sa.Float),
        sa.column("severity", sa.String),
        sa.column("enabled", sa.Boolean),
        sa.column("description", sa.Text),
    )
    op.bulk_insert(rules, DEFAULT_RULES)


def downgrade() -> None:
    for table in (
        "alert_events",
        "warmup_schedules",
        "warmup_runs",
        "metric_samples",
        "config_versions",
        "collection_gaps",
        "alert_rules",
        "hosts",
        "audit_events",
    ):
        op.drop_table(table)
