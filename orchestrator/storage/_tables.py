"""SQLAlchemy Core tables and the database clock.

The schema itself is created only by the Alembic migrations in ``alembic/versions``; these
definitions mirror them for queries (a test checks the two agree). Every key and index holds
``tenant_id`` so the tables can be distributed by tenant.

Plans that do not depend on statistics: PostgreSQL caches one generic plan per prepared
statement, chosen on its first runs; on a table never analyzed every index looks equally
cheap then, and a plan that walks a tenant's entries of the wrong index stays in use as the
table grows. So on ``payorch_operations`` each hot statement has one usable index, the right
one: the keys lead with the column that names the row (``id``; ``idempotency_key``;
``downstream_key``), not with ``tenant_id``, and the one tenant-led listing index is partial
on a predicate (:func:`is_listed`) that only the listing states.

A partial index serves a query only when the query's WHERE holds the index's predicate as
written: SQLite matches the term textually and PostgreSQL cannot prove it from bound
parameters in a generic plan. Queries therefore take those predicates from the helpers here
(:func:`is_active`, :func:`is_flagged`), rendered with literals, never bound values.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler

from ..records import Undecodable

__all__ = [
    "ACTIVE_STATE_VALUES",
    "LISTED",
    "OUTBOX_SEQUENCE",
    "OUTBOX_STATE_VALUES",
    "WATCHED",
    "StoredJSON",
    "UTCDateTime",
    "db_now",
    "db_now_plus",
    "effects",
    "events",
    "is_active",
    "is_dead",
    "is_flagged",
    "is_listed",
    "is_pending",
    "metadata",
    "operations",
    "outbox",
    "recon_files",
    "recon_providers",
    "recon_rows",
    "route_keys",
    "webhook_inbox",
]

ACTIVE_STATE_VALUES = ("in_progress", "outcome_unknown")
TERMINAL_STATE_VALUES = ("succeeded", "failed_final")
# ix_payorch_operations_created's predicate: true of every row (a literal instant, the same
# text on both dialects; SQLite compares the stored text, which sorts as the time does).
LISTED = "created_at > '2000-01-01 00:00:00+00'"
# ix_payorch_events_fallback's predicate: the events the routing watch reads.
WATCHED = "kind IN ('fallback', 'route_skipped')"


def _tolerant(inner: Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
    if inner is None:  # nothing to decode on this dialect (psycopg decodes JSON itself)
        return None

    def process(value: Any) -> Any:
        try:
            return inner(value)
        except (ValueError, TypeError) as exc:
            return Undecodable(value, exc)

    return process


class StoredJSON(sa.TypeDecorator[Any]):
    """``JSON`` whose undecodable stored text reads back as :class:`Undecodable`."""

    impl = sa.JSON
    cache_ok = True
    should_evaluate_none = True  # like JSON(): Python None is stored as JSON null, as before

    # Wrapping (not replacing) the impl's processor keeps its decoding, and PostgreSQL's
    # None (no Python-side work at all) stays None.
    def result_processor(self, dialect: Dialect, coltype: Any) -> Any:
        return _tolerant(super().result_processor(dialect, coltype))


class UTCDateTime(sa.TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every dialect (SQLite stores naive UTC text)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetimes are refused: pass an aware UTC datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)

    def result_processor(self, dialect: Dialect, coltype: Any) -> Any:
        # SQLite parses timestamps from text: a malformed one reads back as Undecodable.
        return _tolerant(super().result_processor(dialect, coltype))


class db_now(sa.sql.expression.FunctionElement[datetime]):
    """The database's clock: leases and due times are judged by one clock, not the hosts'.

    On PostgreSQL ``statement_timestamp()``: each statement's own reading (as a transaction
    of several statements needs), and STABLE, so Citus evaluates it once on the coordinator
    for a distributed modification, where it refuses a VOLATILE ``clock_timestamp()``."""

    type = UTCDateTime()
    inherit_cache = True


class db_now_plus(sa.sql.expression.FunctionElement[datetime]):
    """``db_now() + seconds``; ``seconds`` a bound parameter or a literal, never a column:
    Citus refuses a stable function over a column in a distributed modification."""

    type = UTCDateTime()
    inherit_cache = True


@compiles(db_now, "postgresql")
def _pg_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "statement_timestamp()"


@compiles(db_now)
def _sqlite_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    # Same text format SQLAlchemy writes for SQLite DATETIME, so comparisons are textual.
    return "(strftime('%Y-%m-%d %H:%M:%f', 'now') || '000')"


@compiles(db_now_plus, "postgresql")
def _pg_now_plus(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    (seconds,) = list(element.clauses)
    return f"(statement_timestamp() + make_interval(secs => {compiler.process(seconds, **kw)}))"


@compiles(db_now_plus)
def _sqlite_now_plus(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    (seconds,) = list(element.clauses)
    secs = compiler.process(seconds, **kw)
    return f"(strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', {secs})) || '000')"


metadata = sa.MetaData()

operations = sa.Table(
    "payorch_operations",
    metadata,
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
    sa.Column("request", StoredJSON()),
    sa.Column("response", StoredJSON()),
    sa.Column("error_code", sa.String(100)),
    sa.Column("resolution", sa.String(40)),
    sa.Column("retention_seconds", sa.Integer, nullable=False),
    sa.Column("possibly_sent", sa.Boolean, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("checks", sa.Integer, nullable=False),
    sa.Column("next_check_at", UTCDateTime()),
    sa.Column("needs_attention", sa.Boolean, nullable=False),
    sa.Column("lease_owner", sa.String(200)),
    sa.Column("lease_expires_at", UTCDateTime()),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    sa.Column("completed_at", UTCDateTime()),
    sa.Column("retain_until", UTCDateTime()),
    sa.Column("reaped_at", UTCDateTime()),
    # Replays are counted on the operation, not logged: the event log grows with state
    # changes, not with client retries.
    sa.Column("replays", sa.Integer, nullable=False, server_default=sa.text("0")),
    sa.Column("last_replayed_at", UTCDateTime()),
    # An uneventful operation's first two events, kept on its row instead of as event rows
    # (see ``_folded.py``): the claim's (actor, extra detail) and the executor's terminal
    # answer (id, kind, actor, detail), each written with the row's own write.
    sa.Column("claim_event", StoredJSON()),
    sa.Column("answer_event", StoredJSON()),
    # Someone waits on this operation (a duplicate request, on LISTEN): only then does its
    # write out of in_progress send a NOTIFY, which serialises commits server-wide.
    sa.Column("waited", sa.Boolean, nullable=False, server_default=sa.false()),
    # A routed operation's route (payorch.routing): the decision made before its first call
    # and every provider attempt; NULL when it was not routed.
    sa.Column("route", StoredJSON()),
    # Led by id: by-id statements (writes, rereads, ``ops show <id>`` with or without a
    # tenant) can use no other index; tenant_id in it so it shards.
    sa.PrimaryKeyConstraint("id", "tenant_id", name="pk_payorch_operations"),
    # The namespace, led by the key (the claim's conflict target takes any column order).
    sa.UniqueConstraint(
        "idempotency_key", "operation", "tenant_id", name="uq_payorch_operations_namespace"
    ),
    # Partial: a claim (no reference yet) adds no entry. ``provider_reference = x`` implies
    # the predicate on both planners.
    sa.Index(
        "ix_payorch_operations_provider_reference",
        "tenant_id",
        "provider",
        "provider_reference",
        postgresql_where=sa.text("provider_reference IS NOT NULL"),
        sqlite_where=sa.text("provider_reference IS NOT NULL"),
    ),
    # The listing, newest first per tenant: partial on a predicate always true of a row
    # (LISTED) that only the listing states, so no by-key statement can walk it.
    sa.Index(
        "ix_payorch_operations_created",
        "tenant_id",
        "created_at",
        postgresql_where=sa.text(LISTED),
        sqlite_where=sa.text(LISTED),
    ),
    # Webhooks find the operation by the downstream key that caused the event: since keys
    # come from the namespace, the key no longer names the operation id.
    sa.Index("ix_payorch_operations_downstream", "downstream_key", "provider", "tenant_id"),
    # The reconciler's scan reads only non-terminal rows: its cost follows stuck work.
    sa.Index(
        "ix_payorch_operations_active",
        "tenant_id",
        "next_check_at",
        postgresql_where=sa.text("state IN ('in_progress', 'outcome_unknown')"),
        sqlite_where=sa.text("state IN ('in_progress', 'outcome_unknown')"),
    ),
    # The reaper reads only terminal rows not yet reaped.
    sa.Index(
        "ix_payorch_operations_retention",
        "tenant_id",
        "retain_until",
        postgresql_where=sa.text("reaped_at IS NULL AND retain_until IS NOT NULL"),
        sqlite_where=sa.text("reaped_at IS NULL AND retain_until IS NOT NULL"),
    ),
    # The attention queue: only flagged rows, newest first per tenant; without a tenant
    # the (small) index is read whole and sorted.
    sa.Index(
        "ix_payorch_operations_attention",
        "tenant_id",
        "created_at",
        "id",
        postgresql_where=sa.text("needs_attention"),
        sqlite_where=sa.text("needs_attention = 1"),
    ),
)


def is_active() -> sa.ColumnElement[bool]:
    """``state IN ('in_progress', 'outcome_unknown')`` exactly as ``ix_payorch_operations_active``
    states it, with literals, so both planners may read that partial index."""
    return operations.c.state.in_([sa.literal_column(f"'{s}'") for s in ACTIVE_STATE_VALUES])


def is_listed() -> sa.ColumnElement[bool]:
    """``created_at > '2000-01-01 00:00:00+00'`` (true of every row) exactly as
    ``ix_payorch_operations_created`` states it: the listing's own index."""
    return operations.c.created_at > sa.literal_column(LISTED.split(" > ", 1)[1])


def is_flagged() -> sa.ColumnElement[bool]:
    """``needs_attention`` as ``ix_payorch_operations_attention`` states it on each dialect
    (PostgreSQL: the bare boolean; SQLite: ``= 1``), so its planner may read that index."""
    return sa.and_(operations.c.needs_attention)


events = sa.Table(
    "payorch_events",
    metadata,
    sa.Column("tenant_id", sa.String(64), nullable=False),
    sa.Column("id", sa.String(36), nullable=False),  # UUIDv7: time-ordered
    sa.Column("operation_id", sa.String(36), nullable=False),
    sa.Column("kind", sa.String(40), nullable=False),
    sa.Column("actor", sa.String(200), nullable=False),
    sa.Column("from_state", sa.String(20)),
    sa.Column("to_state", sa.String(20)),
    sa.Column("version", sa.Integer),
    sa.Column("detail", StoredJSON()),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.PrimaryKeyConstraint("tenant_id", "id", name="pk_payorch_events"),
    sa.Index("ix_payorch_events_operation", "tenant_id", "operation_id", "id"),
    sa.Index("ix_payorch_events_kind", "tenant_id", "kind", "created_at"),
    # Routed operations' moves to another provider, and routes that passed a provider over
    # as unhealthy, by time (payorch.routing): the watch that asks those providers again
    # reads only these.
    sa.Index(
        "ix_payorch_events_fallback",
        "created_at",
        "tenant_id",
        postgresql_where=sa.text(WATCHED),
        sqlite_where=sa.text(WATCHED),
    ),
)

webhook_inbox = sa.Table(
    "payorch_webhook_inbox",
    metadata,
    sa.Column("tenant_id", sa.String(64), nullable=False),
    sa.Column("provider", sa.String(64), nullable=False),
    sa.Column("event_id", sa.String(255), nullable=False),
    sa.Column("event_type", sa.String(100), nullable=False),
    sa.Column("operation_id", sa.String(36)),
    sa.Column("result", sa.String(40), nullable=False),
    sa.Column("body", sa.JSON),
    sa.Column("received_at", UTCDateTime(), nullable=False),
    sa.PrimaryKeyConstraint("tenant_id", "provider", "event_id", name="pk_payorch_webhook_inbox"),
    sa.Index("ix_payorch_webhook_inbox_result", "tenant_id", "result", "received_at"),
    # The reaper clears the bodies of one operation's deliveries.
    sa.Index("ix_payorch_webhook_inbox_operation", "tenant_id", "operation_id"),
)

# -- after the payment: the outbox and the effects done once --------------------------------

OUTBOX_STATE_VALUES = ("pending", "delivered", "dead")
OUTBOX_SEQUENCE = "payorch_outbox_seq"  # PostgreSQL: the staging order of outbox messages

# The transactional outbox. ``id``, ``aggregatetype``, ``aggregateid``, ``type`` and
# ``payload`` are the columns (and names) Debezium's outbox event router reads by default,
# so change data capture can publish this table with no per-column configuration.
outbox = sa.Table(
    "payorch_outbox",
    metadata,
    sa.Column("tenant_id", sa.String(64), nullable=False),
    sa.Column("id", sa.String(36), nullable=False),  # the message id: UUIDv7, stable
    sa.Column("aggregatetype", sa.String(128), nullable=False),
    sa.Column("aggregateid", sa.String(255), nullable=False),
    sa.Column("type", sa.String(128), nullable=False),
    sa.Column("payload", StoredJSON(), nullable=False),
    sa.Column("destination", sa.String(64), nullable=False),  # the sink a relay sends it to
    # The staging order (OUTBOX_SEQUENCE on PostgreSQL, the rowid on SQLite): one
    # aggregate's messages are delivered in it.
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("operation_id", sa.String(36)),  # the operation whose outcome staged it
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("next_attempt_at", UTCDateTime(), nullable=False),
    sa.Column("lease_owner", sa.String(200)),
    sa.Column("lease_expires_at", UTCDateTime()),
    sa.Column("last_error", sa.Text),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    sa.Column("delivered_at", UTCDateTime()),
    sa.PrimaryKeyConstraint("tenant_id", "id", name="pk_payorch_outbox"),
    # The relay's scan reads only pending rows: its cost follows the backlog.
    sa.Index(
        "ix_payorch_outbox_pending",
        "tenant_id",
        "next_attempt_at",
        postgresql_where=sa.text("state = 'pending'"),
        sqlite_where=sa.text("state = 'pending'"),
    ),
    # Order per aggregate: is an earlier message of this aggregate still pending?
    sa.Index(
        "ix_payorch_outbox_aggregate",
        "tenant_id",
        "aggregatetype",
        "aggregateid",
        "destination",
        "seq",
    ),
    sa.Index("ix_payorch_outbox_state", "tenant_id", "state", "created_at"),
    # The dead letters, counted at every scrape: only those rows.
    sa.Index(
        "ix_payorch_outbox_dead",
        "tenant_id",
        "created_at",
        postgresql_where=sa.text("state = 'dead'"),
        sqlite_where=sa.text("state = 'dead'"),
    ),
    # Operator look-up by message id alone (``outbox retry <id>``), as for operations.
    sa.Index("ix_payorch_outbox_id", "id"),
)


def is_pending() -> sa.ColumnElement[bool]:
    """``state = 'pending'`` as ``ix_payorch_outbox_pending`` states it (a literal)."""
    return outbox.c.state == sa.literal_column("'pending'")


def is_dead() -> sa.ColumnElement[bool]:
    """``state = 'dead'`` as ``ix_payorch_outbox_dead`` states it (a literal)."""
    return outbox.c.state == sa.literal_column("'dead'")


# Effects done once (payorch.once): a consumer's message or an idempotent function's call,
# claimed in its namespace (tenant, namespace, key) like an operation.
# The keys of attempts routed operations left (payorch.routing): the key a move left behind,
# and the key of each provider a route passed over as unhealthy. A webhook or a settlement
# row of that provider names it, and no operation row holds it any more: this finds its
# operation. Written only with a move or a skip note (rare), never on the hot path.
route_keys = sa.Table(
    "payorch_route_keys",
    metadata,
    sa.Column("tenant_id", sa.String(64), nullable=False),
    sa.Column("downstream_key", sa.String(255), nullable=False),
    sa.Column("provider", sa.String(64), nullable=False),
    sa.Column("operation_id", sa.String(36), nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.PrimaryKeyConstraint(
        "downstream_key", "provider", "tenant_id", "operation_id", name="pk_payorch_route_keys"
    ),
)

effects = sa.Table(
    "payorch_effects",
    metadata,
    sa.Column("tenant_id", sa.String(64), nullable=False),
    sa.Column("namespace", sa.String(128), nullable=False),
    sa.Column("key", sa.String(255), nullable=False),
    sa.Column("id", sa.String(36), nullable=False),
    sa.Column("fingerprint", sa.String(64), nullable=False),
    sa.Column("state", sa.String(20), nullable=False),
    sa.Column("possibly_sent", sa.Boolean, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("result", StoredJSON()),
    sa.Column("error", StoredJSON()),
    sa.Column("needs_attention", sa.Boolean, nullable=False),
    sa.Column("lease_owner", sa.String(200)),
    sa.Column("lease_expires_at", UTCDateTime()),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    sa.Column("completed_at", UTCDateTime()),
    sa.Column("retain_until", UTCDateTime()),
    sa.PrimaryKeyConstraint("tenant_id", "namespace", "key", name="pk_payorch_effects"),
    sa.Index("ix_payorch_effects_id", "id"),
    sa.Index(
        "ix_payorch_effects_attention",
        "tenant_id",
        "created_at",
        postgresql_where=sa.text("needs_attention"),
        sqlite_where=sa.text("needs_attention = 1"),
    ),
    sa.Index("ix_payorch_effects_retention", "tenant_id", "retain_until"),
)


# Settlement reports (payorch.recon): the files imported and their rows, judged. Keyed by
# provider and merchant account, not by tenant: a report is the account's, and its rows
# find their operations (of any tenant) by reference. On Citus they stay on the coordinator
# (docs/reconciliation.md): imported in batch by operators, never on a payment's path.
recon_files = sa.Table(
    "payorch_recon_files",
    metadata,
    sa.Column("provider", sa.String(64), nullable=False),
    sa.Column("account", sa.String(80), nullable=False),
    sa.Column("digest", sa.String(64), nullable=False),
    sa.Column("name", sa.String(255), nullable=False),
    sa.Column("format", sa.String(16), nullable=False),
    sa.Column("kind", sa.String(40), nullable=False),
    sa.Column("rows", sa.Integer, nullable=False),
    sa.Column("new_rows", sa.Integer, nullable=False),
    sa.Column("first_at", UTCDateTime()),
    sa.Column("last_at", UTCDateTime()),
    sa.Column("imported_at", UTCDateTime(), nullable=False),
    sa.PrimaryKeyConstraint("provider", "account", "digest", name="pk_payorch_recon_files"),
)

recon_rows = sa.Table(
    "payorch_recon_rows",
    metadata,
    sa.Column("provider", sa.String(64), nullable=False),
    sa.Column("account", sa.String(80), nullable=False),
    sa.Column("row_key", sa.String(128), nullable=False),
    sa.Column("file_digest", sa.String(64), nullable=False),
    sa.Column("line", sa.Integer, nullable=False),
    sa.Column("entry", sa.String(24), nullable=False),
    sa.Column("category", sa.String(80), nullable=False),
    sa.Column("batch", sa.String(80)),
    sa.Column("booked_at", UTCDateTime(), nullable=False),
    sa.Column("reference", sa.String(255)),
    sa.Column("payment_reference", sa.String(255)),
    sa.Column("merchant_reference", sa.String(255)),
    sa.Column("amount", sa.BigInteger),
    sa.Column("currency", sa.String(3)),
    sa.Column("net_currency", sa.String(3), nullable=False),
    sa.Column("net", sa.BigInteger, nullable=False),
    sa.Column("fee", sa.BigInteger),
    # None until judged (matched, mismatch, settles_unknown, contradiction, duplicate,
    # orphan, other): an import that stopped half-way is finished by the next one.
    sa.Column("class", sa.String(24)),
    sa.Column("tenant_id", sa.String(64)),
    sa.Column("operation_id", sa.String(36)),
    sa.Column("detail", StoredJSON()),
    sa.Column("imported_at", UTCDateTime(), nullable=False),
    sa.Column("judged_at", UTCDateTime()),
    sa.PrimaryKeyConstraint("provider", "account", "row_key", name="pk_payorch_recon_rows"),
    sa.Index("ix_payorch_recon_rows_file", "file_digest", "line"),
    sa.Index("ix_payorch_recon_rows_batch", "provider", "account", "batch"),
    sa.Index("ix_payorch_recon_rows_reference", "provider", "reference"),
    sa.Index("ix_payorch_recon_rows_payment", "provider", "payment_reference"),
    sa.Index("ix_payorch_recon_rows_class", "provider", "class"),
)

# Per provider, as the last import or report counted: its rows per class, and the operations
# that succeeded and no report has shown yet (the metrics read this, never the rows).
recon_providers = sa.Table(
    "payorch_recon_providers",
    metadata,
    sa.Column("provider", sa.String(64), nullable=False),
    sa.Column("since", UTCDateTime(), nullable=False),
    sa.Column("lag_seconds", sa.Integer, nullable=False),
    sa.Column("expected", sa.Integer, nullable=False),
    sa.Column("overdue", sa.Integer, nullable=False),
    sa.Column("oldest_expected_at", UTCDateTime()),
    # Rows per class, of every file (a tally the metrics read, so a scrape counts nothing).
    sa.Column("counts", StoredJSON(), nullable=False),
    sa.Column("checked_at", UTCDateTime(), nullable=False),
    sa.PrimaryKeyConstraint("provider", name="pk_payorch_recon_providers"),
)
