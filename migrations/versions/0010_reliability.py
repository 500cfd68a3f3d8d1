"""Reliability: who holds a host's apply lease, the engine config version that carries
the store's version in force, config drift spans, and the ``config_drift`` alert rule.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

DRIFT_RULE = {
    "name": "config_drift",
    "metric": "config_drift",
    "op": ">",
    "threshold": 0.0,
    "for_s": 0.0,
    "severity": "critical",
    "enabled": True,
    "description": "The engine's config (content or version) differs from the store's version in force.",
}


def upgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("apply_lock_info", JSON, nullable=True))
        batch.add_column(sa.Column("engine_config_version", sa.Integer(), nullable=True))
    op.create_table(
        "config_drifts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("detected_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("store_version", sa.Integer(), nullable=True),
        sa.Column("store_engine_version", sa.Integer(), nullable=True),
        sa.Column("store_config", JSON, nullable=True),
        sa.Column("engine_version", sa.Integer(), nullable=True),
        sa.Column("engine_started_at", sa.Float(), nullable=True),
        sa.Column("engine_config", JSON, nullable=True),
        sa.Column("diff", JSON, nullable=False),
        sa.Column("resolution", sa.String(length=16), nullable=True),
        sa.Column("resolved_by", sa.String(length=128), nullable=True),
        sa.Column("resolved_version", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.id"], name=op.f("fk_config_drifts_host_id_hosts"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_config_drifts")),
    )
    op.create_index("ix_config_drifts_host_detected", "config_drifts", ["host_id", "detected_at"], unique=False)
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
    op.bulk_insert(rules, [DRIFT_RULE])


def downgrade() -> None:
    op.execute(
        sa.text("DELETE FROM alert_events WHERE rule_id IN (SELECT id FROM alert_rules WHERE name = 'config_drift')")
    )
    op.execute(sa.text("DELETE FROM alert_rules WHERE name = 'config_drift'"))
    op.drop_index("ix_config_drifts_host_detected", table_name="config_drifts")
    op.drop_table("config_drifts")
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("engine_config_version")
        batch.drop_column("apply_lock_info")
