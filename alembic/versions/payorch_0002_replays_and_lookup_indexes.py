"""Replays counted on the operation; indexes for look-up by id, the attention queue and the
reaper's clearing of webhook bodies.

Revision ID: payorch_0002
Revises: payorch_0001
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "payorch_0002"
down_revision = "payorch_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A server default fills the rows already there; new claims rely on it too.
    op.add_column(
        "payorch_operations",
        sa.Column("replays", sa.Integer, nullable=False, server_default=sa.text("0")),
    )
    op.add_column("payorch_operations", sa.Column("last_replayed_at", sa.DateTime(timezone=True)))
    # The one index not led by tenant_id (see docs/semantics.md, "Schema"): not unique, so
    # it constrains nothing across tenants and shards like the others.
    op.create_index("ix_payorch_operations_id", "payorch_operations", ["id"])
    op.create_index(
        "ix_payorch_operations_attention",
        "payorch_operations",
        ["tenant_id", "created_at", "id"],
        postgresql_where=sa.text("needs_attention"),
        sqlite_where=sa.text("needs_attention = 1"),
    )
    op.create_index(
        "ix_payorch_webhook_inbox_operation",
        "payorch_webhook_inbox",
        ["tenant_id", "operation_id"],
    )


def downgrade() -> None:
    op.drop_index("ix_payorch_webhook_inbox_operation", table_name="payorch_webhook_inbox")
    op.drop_index("ix_payorch_operations_attention", table_name="payorch_operations")
    op.drop_index("ix_payorch_operations_id", table_name="payorch_operations")
    # Plain ALTER TABLE on both dialects (SQLite >= 3.35): a batch rebuild of the table
    # would recreate its partial indexes from reflection, which loses their predicates.
    for column in ("last_replayed_at", "replays"):
        op.execute(f"ALTER TABLE payorch_operations DROP COLUMN {column}")
