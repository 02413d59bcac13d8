"""Look-up by downstream key (keys now come from the namespace), and keys stored in their
quoted sf-string form rewritten to the bare form execute() now reads them as.

Revision ID: payorch_0003
Revises: payorch_0002
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from payorch.core import canonical_idempotency_key
from payorch.errors import InvalidIdempotencyKey

revision = "payorch_0003"
down_revision = "payorch_0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # Built without blocking the claims of a live table; CONCURRENTLY needs autocommit.
        with op.get_context().autocommit_block():
            op.create_index(
                "ix_payorch_operations_downstream",
                "payorch_operations",
                ["tenant_id", "provider", "downstream_key"],
                postgresql_concurrently=True,
            )
    else:
        op.create_index(
            "ix_payorch_operations_downstream",
            "payorch_operations",
            ["tenant_id", "provider", "downstream_key"],
        )
    _unquote_keys()


def _unquote_keys() -> None:
    """A key stored as ``"abc"`` (a service that passed the raw header to execute()) is
    stored as ``abc``, so the client's retry finds its operation instead of claiming a
    second one under another downstream key. Its own downstream key is kept (what the
    provider saw). Where both forms already hold an operation, both stay and the quoted
    one is flagged: that pair was the duplicate this migration prevents from now on."""
    conn = op.get_bind()
    ops = sa.table(
        "payorch_operations",
        sa.column("tenant_id"),
        sa.column("id"),
        sa.column("operation"),
        sa.column("idempotency_key"),
        sa.column("needs_attention", sa.Boolean),
    )
    c = ops.c
    quoted = conn.execute(
        sa.select(c.tenant_id, c.id, c.operation, c.idempotency_key).where(
            c.idempotency_key.like('"%')
        )
    ).all()
    for tenant_id, op_id, operation, key in quoted:
        try:
            bare = canonical_idempotency_key(key)
        except InvalidIdempotencyKey:
            continue  # not an sf-string: a key that merely begins with a quote stays as it is
        taken = conn.execute(
            sa.select(c.id).where(
                c.tenant_id == tenant_id, c.operation == operation, c.idempotency_key == bare
            )
        ).first()
        where = (c.tenant_id == tenant_id, c.id == op_id)
        if taken is None:
            conn.execute(sa.update(ops).where(*where).values(idempotency_key=bare))
        else:
            conn.execute(sa.update(ops).where(*where).values(needs_attention=True))


def downgrade() -> None:
    # Unquoted keys stay bare: the earlier revision read both forms as two keys, and either
    # spelling reaches these operations from a client of today.
    op.drop_index("ix_payorch_operations_downstream", table_name="payorch_operations")
