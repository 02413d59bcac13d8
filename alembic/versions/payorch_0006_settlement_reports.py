"""Settlement reports as evidence (payorch.recon): the files imported, their rows as judged,
and what each provider's settlements still owe.

Keyed by provider and merchant account, not by tenant (a report is the account's); on Citus
they stay on the coordinator, as plain tables.

Revision ID: payorch_0006
Revises: payorch_0005
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "payorch_0006"
down_revision = "payorch_0005"
branch_labels = None
depends_on = None


def _ts(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "payorch_recon_files",
        sa.Column("provider", sa.String(64), nullable=False),
        sa.Column("account", sa.String(80), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("format", sa.String(16), nullable=False),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("rows", sa.Integer, nullable=False),
        sa.Column("new_rows", sa.Integer, nullable=False),
        _ts("first_at"),
        _ts("last_at"),
        _ts("imported_at", nullable=False),
        sa.PrimaryKeyConstraint("provider", "account", "digest", name="pk_payorch_recon_files"),
    )
    op.create_table(
        "payorch_recon_rows",
        sa.Column("provider", sa.String(64), nullable=False),
        sa.Column("account", sa.String(80), nullable=False),
        sa.Column("row_key", sa.String(128), nullable=False),
        sa.Column("file_digest", sa.String(64), nullable=False),
        sa.Column("line", sa.Integer, nullable=False),
        sa.Column("entry", sa.String(24), nullable=False),
        sa.Column("category", sa.String(80), nullable=False),
        sa.Column("batch", sa.String(80)),
        _ts("booked_at", nullable=False),
        sa.Column("reference", sa.String(255)),
        sa.Column("payment_reference", sa.String(255)),
        sa.Column("merchant_reference", sa.String(255)),
        sa.Column("amount", sa.BigInteger),
        sa.Column("currency", sa.String(3)),
        sa.Column("net_currency", sa.String(3), nullable=False),
        sa.Column("net", sa.BigInteger, nullable=False),
        sa.Column("fee", sa.BigInteger),
        sa.Column("class", sa.String(24)),
        sa.Column("tenant_id", sa.String(64)),
        sa.Column("operation_id", sa.String(36)),
        sa.Column("detail", sa.JSON),
        _ts("imported_at", nullable=False),
        _ts("judged_at"),
        sa.PrimaryKeyConstraint("provider", "account", "row_key", name="pk_payorch_recon_rows"),
    )
    for name, columns in (
        ("file", ["file_digest", "line"]),
        ("batch", ["provider", "account", "batch"]),
        ("reference", ["provider", "reference"]),
        ("payment", ["provider", "payment_reference"]),
        ("class", ["provider", "class"]),
    ):
        op.create_index(f"ix_payorch_recon_rows_{name}", "payorch_recon_rows", columns)
    op.create_table(
        "payorch_recon_providers",
        sa.Column("provider", sa.String(64), nullable=False),
        _ts("since", nullable=False),
        sa.Column("lag_seconds", sa.Integer, nullable=False),
        sa.Column("expected", sa.Integer, nullable=False),
        sa.Column("overdue", sa.Integer, nullable=False),
        _ts("oldest_expected_at"),
        sa.Column("counts", sa.JSON, nullable=False),
        _ts("checked_at", nullable=False),
        sa.PrimaryKeyConstraint("provider", name="pk_payorch_recon_providers"),
    )


def downgrade() -> None:
    op.drop_table("payorch_recon_providers")
    op.drop_table("payorch_recon_rows")
    op.drop_table("payorch_recon_files")
