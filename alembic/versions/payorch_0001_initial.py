"""Operations, their append-only events, and the webhook inbox.

Revision ID: payorch_0001
Revises:
Branch: payorch (ids are prefixed so they never collide with a host application's)
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "payorch_0001"
down_revision = None
branch_labels = ("payorch",)
depends_on = None

ACTIVE = "state IN ('in_progress', 'outcome_unknown')"
RETAINED = "reaped_at IS NULL AND retain_until IS NOT NULL"


def _ts(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "payorch_operations",
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("operation", sa.String(64), nullable=False),
        sa.Column("idempotency_key", sa.String(255), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("provider", sa.String(64), nullable=False),
        sa.Column("downstream_key", sa.String(255), nullable=False),
        sa.Column("provider_reference", sa.String(255)),
        sa.Column("amount", sa.BigInteger),
        sa.Column("currency", sa.String(3)),
        sa.Column("request", sa.JSON),
        sa.Column("response", sa.JSON),
        sa.Column("error_code", sa.String(100)),
        sa.Column("resolution", sa.String(40)),
        sa.Column("retention_seconds", sa.Integer, nullable=False),
        sa.Column("possibly_sent", sa.Boolean, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("checks", sa.Integer, nullable=False),
        _ts("next_check_at"),
        sa.Column("needs_attention", sa.Boolean, nullable=False),
        sa.Column("lease_owner", sa.String(200)),
        _ts("lease_expires_at"),
        sa.Column("version", sa.Integer, nullable=False),
        _ts("created_at", nullable=False),
        _ts("updated_at", nullable=False),
        _ts("completed_at"),
        _ts("retain_until"),
        _ts("reaped_at"),
        sa.PrimaryKeyConstraint("tenant_id", "id", name="pk_payorch_operations"),
        sa.UniqueConstraint(
            "tenant_id", "operation", "idempotency_key", name="uq_payorch_operations_namespace"
        ),
    )
    op.create_index(
        "ix_payorch_operations_reference",
        "payorch_operations",
        ["tenant_id", "provider", "provider_reference"],
    )
    op.create_index(
        "ix_payorch_operations_created", "payorch_operations", ["tenant_id", "created_at"]
    )
    op.create_index(
        "ix_payorch_operations_active",
        "payorch_operations",
        ["tenant_id", "next_check_at"],
        postgresql_where=sa.text(ACTIVE),
        sqlite_where=sa.text(ACTIVE),
    )
    op.create_index(
        "ix_payorch_operations_retention",
        "payorch_operations",
        ["tenant_id", "retain_until"],
        postgresql_where=sa.text(RETAINED),
        sqlite_where=sa.text(RETAINED),
    )
    op.create_table(
        "payorch_events",
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("operation_id", sa.String(36), nullable=False),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("from_state", sa.String(20)),
        sa.Column("to_state", sa.String(20)),
        sa.Column("version", sa.Integer),
        sa.Column("detail", sa.JSON),
        _ts("created_at", nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "id", name="pk_payorch_events"),
    )
    op.create_index(
        "ix_payorch_events_operation", "payorch_events", ["tenant_id", "operation_id", "id"]
    )
    op.create_index(
        "ix_payorch_events_kind", "payorch_events", ["tenant_id", "kind", "created_at"]
    )
    op.create_table(
        "payorch_webhook_inbox",
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("provider", sa.String(64), nullable=False),
        sa.Column("event_id", sa.String(255), nullable=False),
        sa.Column("event_type", sa.String(100), nullable=False),
        sa.Column("operation_id", sa.String(36)),
        sa.Column("result", sa.String(40), nullable=False),
        sa.Column("body", sa.JSON),
        _ts("received_at", nullable=False),
        sa.PrimaryKeyConstraint(
            "tenant_id", "provider", "event_id", name="pk_payorch_webhook_inbox"
        ),
    )
    op.create_index(
        "ix_payorch_webhook_inbox_result",
        "payorch_webhook_inbox",
        ["tenant_id", "result", "received_at"],
    )


def downgrade() -> None:
    op.drop_index("ix_payorch_webhook_inbox_result", table_name="payorch_webhook_inbox")
    op.drop_table("payorch_webhook_inbox")
    op.drop_index("ix_payorch_events_kind", table_name="payorch_events")
    op.drop_index("ix_payorch_events_operation", table_name="payorch_events")
    op.drop_table("payorch_events")
    for name in (
        "ix_payorch_operations_retention",
        "ix_payorch_operations_active",
        "ix_payorch_operations_created",
        "ix_payorch_operations_reference",
    ):
        op.drop_index(name, table_name="payorch_operations")
    op.drop_table("payorch_operations")
