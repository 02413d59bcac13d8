"""Lean writes: an uneventful operation's claim and answer are kept on its row, a NOTIFY is
sent only for an operation someone waits on, and a claim adds no entry to the reference
index (partial: only rows whose provider reference is known).

Plans that do not depend on statistics: the keys of payorch_operations lead with the column
that names a row (the primary key with ``id``, the namespace with ``idempotency_key``, the
downstream index with ``downstream_key``), the listing index is partial on a predicate only
the listing states, and the plain ``id`` index (now the primary key's lead) goes: on a table
never analyzed, a by-key statement has one usable index, the right one.

Revision ID: payorch_0005
Revises: payorch_0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import re

import sqlalchemy as sa
from alembic import op

revision = "payorch_0005"
down_revision = "payorch_0004"
branch_labels = None
depends_on = None

OPS = "payorch_operations"
OLD_REFERENCE = "ix_payorch_operations_reference"
REFERENCE = "ix_payorch_operations_provider_reference"
KNOWN = "provider_reference IS NOT NULL"
PK = "pk_payorch_operations"
NAMESPACE = "uq_payorch_operations_namespace"
DOWNSTREAM = "ix_payorch_operations_downstream"
CREATED = "ix_payorch_operations_created"
BY_ID = "ix_payorch_operations_id"
LISTED = "created_at > '2000-01-01 00:00:00+00'"
# (name, old columns, new columns); the keys are constraints, the other a plain index.
KEYS = (
    (PK, "tenant_id, id", "id, tenant_id"),
    (NAMESPACE, "tenant_id, operation, idempotency_key", "idempotency_key, operation, tenant_id"),
)
# (before, after): indexed by ``new``.
DOWNSTREAM_COLUMNS = ("tenant_id, provider, downstream_key", "downstream_key, provider, tenant_id")


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
        _rekey_postgresql(new=True)
    else:
        op.create_index(
            REFERENCE,
            "payorch_operations",
            ["tenant_id", "provider", "provider_reference"],
            sqlite_where=sa.text(KNOWN),
        )
        op.drop_index(OLD_REFERENCE, "payorch_operations")
        _rekey_sqlite(new=True)


def _rekey_postgresql(*, new: bool) -> None:
    """The keys and the downstream index rebuilt in their ``new`` column order (or back), the
    listing index made partial (or plain) and the id index dropped (or made again). Each index
    is built CONCURRENTLY beside the old; the keys then change hands in the migration's
    transaction (a short lock), so a claim always sees its conflict target and the table its
    primary key."""
    with op.get_context().autocommit_block():
        for name, old, later in KEYS:
            op.execute(
                f"CREATE UNIQUE INDEX CONCURRENTLY {name}_next ON {OPS} ({later if new else old})"
            )
        op.execute(
            f"CREATE INDEX CONCURRENTLY {DOWNSTREAM}_next ON {OPS} "
            f"({DOWNSTREAM_COLUMNS[new]})"
        )
        listed = f" WHERE {LISTED}" if new else ""
        op.execute(
            f"CREATE INDEX CONCURRENTLY {CREATED}_next ON {OPS} (tenant_id, created_at){listed}"
        )
        if not new:
            op.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {BY_ID} ON {OPS} (id)")
    kinds = {PK: "PRIMARY KEY", NAMESPACE: "UNIQUE"}
    for name, *_ in KEYS:  # one ALTER each (Citus takes one constraint change at a time)
        op.execute(f"ALTER TABLE {OPS} DROP CONSTRAINT {name}")
        op.execute(f"ALTER TABLE {OPS} ADD CONSTRAINT {name} {kinds[name]} USING INDEX {name}_next")
    with op.get_context().autocommit_block():
        for name in (DOWNSTREAM, CREATED):
            op.execute(f"DROP INDEX CONCURRENTLY {name}")
            op.execute(f"ALTER INDEX {name}_next RENAME TO {name}")
        if new:
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {BY_ID}")


def _rekey_sqlite(*, new: bool) -> None:
    """SQLite cannot alter a key: the table is rebuilt as its documented procedure does
    (new table from the stored definition with the keys changed, rows copied, renamed, the
    stored index definitions replayed), so every column and partial index stays as it was."""
    bind = op.get_bind()
    stored = bind.exec_driver_sql(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (OPS,)
    ).scalar_one()
    for name, old, later in KEYS:
        before, after = (old, later) if new else (later, old)
        kind = "PRIMARY KEY" if name == PK else "UNIQUE"
        old_text, new_text = f"{name} {kind} ({before})", f"{name} {kind} ({after})"
        if old_text not in stored:
            raise RuntimeError(f"{OPS}: constraint {name} not as expected ({old_text})")
        stored = stored.replace(old_text, new_text)
    indexes = [
        sql
        for name, sql in bind.exec_driver_sql(
            "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = ? "
            "AND sql IS NOT NULL",
            (OPS,),
        )
        if name not in (DOWNSTREAM, CREATED, BY_ID)
    ]
    listed = f" WHERE {LISTED}" if new else ""
    indexes += [
        f"CREATE INDEX {DOWNSTREAM} ON {OPS} ({DOWNSTREAM_COLUMNS[new]})",
        f"CREATE INDEX {CREATED} ON {OPS} (tenant_id, created_at){listed}",
    ]
    if not new:
        indexes.append(f"CREATE INDEX {BY_ID} ON {OPS} (id)")
    # A table SQLite renamed before is stored as CREATE TABLE "name".
    op.execute(re.sub(rf'^CREATE TABLE\s+"?{OPS}"?', f"CREATE TABLE {OPS}_rebuilt", stored))
    op.execute(f"INSERT INTO {OPS}_rebuilt SELECT * FROM {OPS}")  # noqa: S608
    op.execute(f"DROP TABLE {OPS}")
    op.execute(f"ALTER TABLE {OPS}_rebuilt RENAME TO {OPS}")
    for sql in indexes:
        op.execute(sql)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _rekey_postgresql(new=False)
    else:
        _rekey_sqlite(new=False)
    op.create_index(
        OLD_REFERENCE, "payorch_operations", ["tenant_id", "provider", "provider_reference"]
    )
    op.drop_index(REFERENCE, "payorch_operations")
    # The events kept on rows are lost to a version that reads only the event table. Plain
    # ALTER TABLE on both dialects: a batch rebuild would lose the partial indexes' predicates.
    for column in ("waited", "answer_event", "claim_event"):
        op.execute(f"ALTER TABLE {OPS} DROP COLUMN {column}")
