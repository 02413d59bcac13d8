"""Look-up by downstream key (keys now come from the namespace), and stored "nothing sent"
failures reopened (a transient failure is no longer an answer to its key).

Revision ID: payorch_0003
Revises: payorch_0002
Create Date: 2026-12-08
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
import uuid6
from alembic import op

revision = "payorch_0003"
down_revision = "payorch_0002"
branch_labels = None
depends_on = None

# The codes payorch stored for a failed_final whose every attempt was certainly not sent.
NOT_SENT_CODES = ("provider_unavailable", "provider_auth_failed", "abandoned")


def upgrade() -> None:
    op.create_index(
        "ix_payorch_operations_downstream",
        "payorch_operations",
        ["tenant_id", "provider", "downstream_key"],
    )
    _reopen_not_sent()


def _reopen_not_sent() -> None:
    """Each stored not-sent failure becomes released (in_progress, no lease, nothing sent),
    with an event saying why: the client's next request under its key runs it again, as
    today's payorch does for a new one. No money moved for any of them."""
    conn = op.get_bind()
    ops = sa.table(
        "payorch_operations",
        *(
            sa.column(n)
            for n in (
                "tenant_id",
                "id",
                "state",
                "possibly_sent",
                "error_code",
                "reaped_at",
                "version",
                "response",
                "resolution",
                "lease_owner",
                "lease_expires_at",
                "next_check_at",
                "completed_at",
                "retain_until",
                "updated_at",
            )
        ),
    )
    events = sa.table(
        "payorch_events",
        *(
            sa.column(n)
            for n in (
                "tenant_id",
                "id",
                "operation_id",
                "kind",
                "actor",
                "from_state",
                "to_state",
                "version",
                "created_at",
            )
        ),
        sa.column("detail", sa.JSON),
    )
    c = ops.c
    rows = conn.execute(
        sa.select(c.tenant_id, c.id, c.version, c.error_code).where(
            c.state == "failed_final",
            c.possibly_sent == sa.false(),
            c.error_code.in_(NOT_SENT_CODES),
            c.reaped_at.is_(None),
        )
    ).all()
    now = datetime.now(UTC)
    if conn.dialect.name == "sqlite":
        now = now.replace(tzinfo=None)  # as payorch's UTCDateTime stores it there
    for tenant_id, op_id, version, code in rows:
        done = conn.execute(
            sa.update(ops)
            .where(c.tenant_id == tenant_id, c.id == op_id, c.version == version)
            .values(
                state="in_progress",
                version=version + 1,
                response=None,
                resolution=None,
                lease_owner=None,
                lease_expires_at=None,
                next_check_at=None,
                completed_at=None,
                retain_until=None,
                updated_at=now,
            )
        )
        if done.rowcount != 1:
            continue
        detail = {
            "reason": "nothing was sent: no longer stored as the key's outcome",
            "error_code": code,
        }
        conn.execute(
            sa.insert(events).values(
                tenant_id=tenant_id,
                id=str(uuid6.uuid7()),
                operation_id=op_id,
                kind="reopened",
                actor="migration:payorch_0003",
                from_state="failed_final",
                to_state="in_progress",
                version=version + 1,
                detail=detail,
                created_at=now,
            )
        )


def downgrade() -> None:
    # Reopened operations stay released: no earlier revision stores anything different for
    # them that could be restored, and nothing sent means nothing to undo.
    op.drop_index("ix_payorch_operations_downstream", table_name="payorch_operations")
