"""Dashboard login failures, so that lock-out survives a dashboard restart.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "login_failures",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("failed_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_login_failures")),
    )
    op.create_index("ix_login_failures_name_failed_at", "login_failures", ["name", "failed_at"])


def downgrade() -> None:
    op.drop_index("ix_login_failures_name_failed_at", table_name="login_failures")
    op.drop_table("login_failures")
