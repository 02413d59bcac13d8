"""The store's reads: one operation by key, id, namespace or reference; its timeline; the
database clock. A mixin of :class:`~payorch.storage._store.Store`."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core import canonical_idempotency_key
from ..errors import OperationNotFound
from ..records import EventRecord, OperationRecord
from ._engine import read_in_transaction
from ._tables import db_now, events, operations

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

__all__ = ["Reads"]


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
        def read(conn: Connection) -> list[EventRecord]:
            rows = conn.execute(
                sa.select(events)
                .where(events.c.tenant_id == tenant_id, events.c.operation_id == operation_id)
                .order_by(events.c.id)
            ).mappings()
            return [EventRecord.from_row(r) for r in rows]

        return read_in_transaction(self.engine, read)

    def db_time(self) -> datetime:
        """The database's clock now (the one every lease and window is judged by)."""
        return read_in_transaction(
            self.engine, lambda conn: conn.execute(sa.select(db_now())).scalar_one()
        )
