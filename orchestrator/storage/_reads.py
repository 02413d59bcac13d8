"""The store's reads: one operation by key, id, namespace or reference; its timeline; the
database clock. A mixin of :class:`~payorch.storage._store.Store`."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core import canonical_idempotency_key
from ..errors import OperationNotFound
from ..records import EventRecord, OperationRecord
from ._engine import read_in_transaction
from ._folded import FOLDED_COLUMNS, merged, unfold
from ._tables import db_now, events, operations

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

__all__ = ["Reads", "timeline_order"]


def timeline_order(dialect: str, *, newest_first: bool = False) -> list[sa.ColumnElement[Any]]:
    """How an operation's events sort in the order they were written.

    Not by event id: a UUIDv7 is made from the writing host's clock, so two hosts whose
    clocks disagree by minutes interleave their events out of order. ``created_at`` is the
    database's time of the write (``db_now()`` in every insert), and writes that move an
    operation are serialised by its row (a fenced write waits for the previous one to
    commit before it reads the clock). Ties are broken without a host clock: on SQLite, one
    writer at a time and a millisecond clock, by ``rowid`` (allocation order, which is write
    order); on PostgreSQL, whose ``statement_timestamp()`` has microseconds and gives each
    statement its own reading, by the operation's ``version`` the event was written at
    (events that move nothing carry none: last), and only then by id, which can decide
    only between concurrent writes that nothing ordered.
    """
    c = events.c
    if dialect == "sqlite":
        keys: list[sa.ColumnElement[Any]] = [
            c.created_at,
            sa.literal_column(f"{events.name}.rowid"),
        ]
        return [k.desc() for k in keys] if newest_first else keys
    if newest_first:
        return [c.created_at.desc(), c.version.desc().nulls_first(), c.id.desc()]
    return [c.created_at, c.version.nulls_last(), c.id]


class Reads:
    """Reads that never write: each one short read transaction."""

    if TYPE_CHECKING:
        engine: Engine

    def _one(self, *where: sa.ColumnElement[bool]) -> OperationRecord | None:
        def read(conn: Connection) -> OperationRecord | None:
            row = conn.execute(sa.select(operations).where(*where)).mappings().first()
            return OperationRecord.from_row(row) if row is not None else None

        return read_in_transaction(self.engine, read)

    def get(self, tenant_id: str, operation_id: str) -> OperationRecord:
        t = operations.c
        found = self._one(t.tenant_id == tenant_id, t.id == operation_id)
        if found is None:
            raise OperationNotFound(f"no operation {operation_id} for tenant {tenant_id}")
        return found

    def find(self, operation_id: str) -> OperationRecord:
        """Look an operation up by id alone (operator tools; a cross-tenant read)."""
        found = self._one(operations.c.id == operation_id)
        if found is None:
            raise OperationNotFound(f"no operation {operation_id}")
        return found

    def get_by_namespace(self, tenant_id: str, operation: str, key: str) -> OperationRecord:
        """The operation of a namespace; ``key`` in either of its forms (quoted or bare)."""
        key = canonical_idempotency_key(key)
        t = operations.c
        found = self._one(
            t.tenant_id == tenant_id, t.operation == operation, t.idempotency_key == key
        )
        if found is None:
            raise OperationNotFound(f"no operation {operation} with key {key!r} for {tenant_id}")
        return found

    def find_by_reference(
        self, tenant_id: str, provider: str, reference: str
    ) -> OperationRecord | None:
        t = operations.c
        return self._one(
            t.tenant_id == tenant_id, t.provider == provider, t.provider_reference == reference
        )

    def find_by_downstream_key(
        self, tenant_id: str, provider: str, key: str
    ) -> OperationRecord | None:
        """The operation that sent ``key`` (``ix_payorch_operations_downstream``)."""
        t = operations.c
        return self._one(t.tenant_id == tenant_id, t.provider == provider, t.downstream_key == key)

    def events(self, tenant_id: str, operation_id: str) -> list[EventRecord]:
        """The operation's timeline, in the order its events were written (see
        :func:`timeline_order`), whatever the writing hosts' clocks said: its event rows
        and the events kept on its row (see ``_folded.py``)."""
        order = timeline_order(self.engine.dialect.name)
        t = operations.c

        def read(conn: Connection) -> list[EventRecord]:
            rows = conn.execute(
                sa.select(events)
                .where(events.c.tenant_id == tenant_id, events.c.operation_id == operation_id)
                .order_by(*order)
            ).mappings()
            logged = [EventRecord.from_row(r) for r in rows]
            row = (
                conn.execute(
                    sa.select(*(t[name] for name in FOLDED_COLUMNS)).where(
                        t.tenant_id == tenant_id, t.id == operation_id
                    )
                )
                .mappings()
                .first()
            )
            return merged(unfold(row), logged) if row is not None else logged

        return read_in_transaction(self.engine, read)

    def db_time(self) -> datetime:
        """The database's clock now (the one every lease and window is judged by)."""
        return read_in_transaction(
            self.engine, lambda conn: conn.execute(sa.select(db_now())).scalar_one()
        )
