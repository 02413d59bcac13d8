"""The host application's own first revision (its id is 0001, as many projects' is).

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "host_orders",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("total", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("host_orders")
