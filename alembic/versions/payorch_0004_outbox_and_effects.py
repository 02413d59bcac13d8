"""The transactional outbox and the effects done once (payorch.outbox, payorch.once).

Revision ID: payorch_0004
Revises: payorch_0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "payorch_0004"
down_revision = "payorch_0003"
branch_labels = None
depends_on = None

PENDING = "state = 'pending'"
DEAD = "state = 'dead'"


def _ts(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # The staging order of outbox messages (SQLite numbers them by rowid).
        op.execute(sa.schema.CreateSequence(sa.Sequence("payorch_outbox_seq")))
    op.create_table(
        "payorch_outbox",
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("aggregatetype", sa.String(128), nullable=False),
        sa.Column("aggregateid", sa.String(255), nullable=False),
        sa.Column("type", sa.String(128), nullable=False),
        sa.Column("payload", sa.JSON, nullable=False),
        sa.Column("destination", sa.String(64), nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("operation_id", sa.String(36)),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        _ts("next_attempt_at", nullable=False),
        sa.Column("lease_owner", sa.String(200)),
        _ts("lease_expires_at"),
        sa.Column("last_error", sa.Text),
        _ts("created_at", nullable=False),
        _ts("updated_at", nullable=False),
        _ts("delivered_at"),
        sa.PrimaryKeyConstraint("tenant_id", "id", name="pk_payorch_outbox"),
    )
    op.create_index(
        "ix_payorch_outbox_pending",
        "payorch_outbox",
        ["tenant_id", "next_attempt_at"],
        postgresql_where=sa.text(PENDING),
        sqlite_where=sa.text(PENDING),
    )
    op.create_index(
        "ix_payorch_outbox_aggregate",
        "payorch_outbox",
        ["tenant_id", "aggregatetype", "aggregateid", "destination", "seq"],
    )
    op.create_index(
        "ix_payorch_outbox_state", "payorch_outbox", ["tenant_id", "state", "created_at"]
    )
    op.create_index(
        "ix_payorch_outbox_dead",
        "payorch_outbox",
        ["tenant_id", "created_at"],
        postgresql_where=sa.text(DEAD),
        sqlite_where=sa.text(DEAD),
    )
    op.create_index("ix_payorch_outbox_id", "payorch_outbox", ["id"])
    op.create_table(
        "payorch_effects",
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("namespace", sa.String(128), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("possibly_sent", sa.Boolean, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("result", sa.JSON),
        sa.Column("error", sa.JSON),
        sa.Column("needs_attention", sa.Boolean, nullable=False),
        sa.Column("lease_owner", sa.String(200)),
        _ts("lease_expires_at"),
        sa.Column("version", sa.Integer, nullable=False),
        _ts("created_at", nullable=False),
        _ts("updated_at", nullable=False),
        _ts("completed_at"),
        _ts("retain_until"),
        sa.PrimaryKeyConstraint("tenant_id", "namespace", "key", name="pk_payorch_effects"),
    )
    op.create_index("ix_payorch_effects_id", "payorch_effects", ["id"])
    op.create_index(
        "ix_payorch_effects_attention",
        "payorch_effects",
        ["tenant_id", "created_at"],
        postgresql_where=sa.text("needs_attention"),
        sqlite_where=sa.text("needs_attention = 1"),
    )
    op.create_index(
        "ix_payorch_effects_retention", "payorch_effects", ["tenant_id", "retain_until"]
    )


def downgrade() -> None:
    op.drop_table("payorch_effects")
    op.drop_table("payorch_outbox")
    if op.get_bind().dialect.name == "postgresql":
        op.execute(sa.schema.DropSequence(sa.Sequence("payorch_outbox_seq"), if_exists=True))
