"""Samples keep the draft tokens per draft position, so that acceptance per position
(accepted_j / draft_tokens_j) can be recomputed in roll-ups.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("metric_samples") as batch:
        batch.add_column(sa.Column("draft_tokens_per_pos", JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("metric_samples") as batch:
        batch.drop_column("draft_tokens_per_pos")
