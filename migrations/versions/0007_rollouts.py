"""Canary rollouts: one row per rollout of a config change across hosts, with its
phase, guards, steps and the process running it.

Revision ID: 0007
Revises: 0001
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007"
down_revision = "0001"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "rollouts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("author", sa.String(length=128), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("patch", JSON, nullable=False),
        sa.Column("hosts", JSON, nullable=False),
        sa.Column("canary", sa.String(length=64), nullable=False),
        sa.Column("watch_s", sa.Float(), nullable=False),
        sa.Column("guards", JSON, nullable=False),
        sa.Column("baseline", sa.String(length=16), nullable=False),
        sa.Column("phase", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("watch_started_at", sa.Float(), nullable=True),
        sa.Column("canary_base_version", sa.Integer(), nullable=True),
        sa.Column("baseline_figures", JSON, nullable=True),
        sa.Column("steps", JSON, nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("owner", sa.String(length=64), nullable=True),
        sa.Column("heartbeat_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollouts")),
    )
    op.create_index(op.f("ix_rollouts_status"), "rollouts", ["status"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_rollouts_status"), table_name="rollouts")
    op.drop_table("rollouts")
