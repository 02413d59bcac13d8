"""Routing across providers (payorch.routing): an operation's route, kept on its row.

``route`` holds the decision made before the first call (the rule, the providers in order)
and every provider attempt (its downstream key, and the proof that let it move on). NULL for
an operation that was not routed: nullable, so the column is instant on PostgreSQL and a
process of the previous version keeps working beside it. A partial index finds the moves
(``fallback`` events) by time, for the watch that asks the providers moved away from.
``payorch_route_keys`` keeps the keys of the attempts routed operations left (a move's, a
provider passed over), so a webhook or a settlement row naming one finds its operation; on
a Citus cluster whose operations are distributed it is distributed beside them.

Revision ID: payorch_0007
Revises: payorch_0006
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "payorch_0007"
down_revision = "payorch_0006"
branch_labels = None
depends_on = None


FALLBACKS = "ix_payorch_events_fallback"
MOVED = "kind IN ('fallback', 'route_skipped')"


KEYS = "payorch_route_keys"


def _route_keys() -> None:
    op.create_table(
        KEYS,
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("downstream_key", sa.String(255), nullable=False),
        sa.Column("provider", sa.String(64), nullable=False),
        sa.Column("operation_id", sa.String(36), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint(
            "downstream_key", "provider", "tenant_id", "operation_id", name="pk_payorch_route_keys"
        ),
        if_not_exists=True,
    )
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    citus = bind.execute(sa.text("SELECT 1 FROM pg_extension WHERE extname = 'citus'")).first()
    if citus is None:
        return
    placed = sa.text(
        "SELECT count(*) FROM pg_dist_partition WHERE logicalrelid IN "
        "('payorch_operations'::regclass, 'payorch_route_keys'::regclass)"
    )
    if bind.execute(placed).scalar() == 1:  # the operations are distributed, the keys not yet
        bind.execute(
            sa.text(
                "SELECT create_distributed_table('payorch_route_keys', 'tenant_id', "
                "colocate_with => 'payorch_operations')"
            )
        )


def upgrade() -> None:
    _route_keys()
    # Only the moves (and routes that passed a provider over): small, written only then.
    if op.get_bind().dialect.name == "postgresql":
        # Re-runnable: the column commits before the index is built (CONCURRENTLY needs
        # autocommit), and a build that failed leaves an INVALID index to drop first.
        op.execute("ALTER TABLE payorch_operations ADD COLUMN IF NOT EXISTS route json")
        with op.get_context().autocommit_block():
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {FALLBACKS}")
            # Built without blocking the writes of a live event log.
            op.create_index(
                FALLBACKS,
                "payorch_events",
                ["created_at", "tenant_id"],
                postgresql_where=sa.text(MOVED),
                postgresql_concurrently=True,
            )
    else:
        op.add_column("payorch_operations", sa.Column("route", sa.JSON))
        op.create_index(
            FALLBACKS, "payorch_events", ["created_at", "tenant_id"], sqlite_where=sa.text(MOVED)
        )


def downgrade() -> None:
    # Re-runnable too: a downgrade stopped after its first commit runs again.
    op.drop_table(KEYS, if_exists=True)
    if op.get_bind().dialect.name == "postgresql":
        with op.get_context().autocommit_block():
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {FALLBACKS}")
    else:
        op.execute(f"DROP INDEX IF EXISTS {FALLBACKS}")
    # Plain ALTER TABLE on both dialects: a batch rebuild would lose the partial indexes'
    # predicates. SQLite has no DROP COLUMN IF EXISTS: the column is looked for first.
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute("ALTER TABLE payorch_operations DROP COLUMN IF EXISTS route")
    elif "route" in {c["name"] for c in sa.inspect(bind).get_columns("payorch_operations")}:
        op.execute("ALTER TABLE payorch_operations DROP COLUMN route")
