"""Lean writes: an uneventful operation's claim and answer are kept on its row, a NOTIFY is
sent only for an operation someone waits on, and a claim adds no entry to the reference
index (partial: only rows whose provider reference is known).

Revision ID: payorch_0005
Revises: payorch_0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "payorch_0005"
down_revision = "payorch_0004"
branch_labels = None
depends_on = None

OLD_REFERENCE = "ix_payorch_operations_reference"
REFERENCE = "ix_payorch_operations_provider_reference"
KNOWN = "provider_reference IS NOT NULL"


def upgrade() -> None:
    # Nullable (or with a default): instant on PostgreSQL, and a process of the previous
    # version keeps working beside them (it writes its events as rows, as before).
    op.add_column("payorch_operations", sa.Column("claim_event", sa.JSON))
    op.add_column("payorch_operations", sa.Column("answer_event", sa.JSON))
    op.add_column(
        "payorch_operations",
        sa.Column("waited", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    if op.get_bind().dialect.name == "postgresql":
        # Built without blocking the claims of a live table; CONCURRENTLY needs autocommit.
        with op.get_context().autocommit_block():
            op.create_index(
                REFERENCE,
                "payorch_operations",
                ["tenant_id", "provider", "provider_reference"],
                postgresql_where=sa.text(KNOWN),
                postgresql_concurrently=True,
            )
            op.drop_index(OLD_REFERENCE, "payorch_operations", postgresql_concurrently=True)
    else:
        op.create_index(
            REFERENCE,
            "payorch_operations",
            ["tenant_id", "provider", "provider_reference"],
            sqlite_where=sa.text(KNOWN),
        )
        op.drop_index(OLD_REFERENCE, "payorch_operations")


def downgrade() -> None:
    op.create_index(
        OLD_REFERENCE, "payorch_operations", ["tenant_id", "provider", "provider_reference"]
    )
    op.drop_index(REFERENCE, "payorch_operations")
    # The events kept on rows are lost to a version that reads only the event table.
    with op.batch_alter_table("payorch_operations") as batch:
        batch.drop_column("waited")
        batch.drop_column("answer_event")
        batch.drop_column("claim_event")
