"""Reads that count a replay: a waiter's look, a flight's joiners. A mixin of
:class:`~payorch.storage._store.Store`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..records import OperationRecord
from . import _pg_writes as pg_writes
from ._engine import run_in_transaction
from ._statements import REPLAY_BY_ID
from ._tables import operations

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

__all__ = ["Replays"]


class Replays:
    """A replay is counted on the row (``replays``, ``last_replayed_at``), never logged."""

    if TYPE_CHECKING:
        engine: Engine

        @property
        def is_postgres(self) -> bool: ...

    def count_replays(self, record: OperationRecord, replays: int) -> None:
        """Count ``replays`` answers given from ``record`` (terminal) without reading it
        (joiners of a flight: :mod:`payorch.execution._flights`). PostgreSQL only; a lost answer
        only leaves the count in doubt."""
        pg_writes.reread(self.engine, record, replays)

    def flag_waiting(self, record: OperationRecord) -> OperationRecord | None:
        """Mark ``record`` as waited on (its write out of ``in_progress`` then sends the
        NOTIFY its waiters sleep on) and read it: the record if it is in progress and the
        NOTIFY is sure to come, else None (read it again: it moved). PostgreSQL only; call
        it once LISTEN is registered for it (see :mod:`payorch.storage._waiting`)."""
        return pg_writes.flag_waiting(self.engine, record)

    def _reread(self, record: OperationRecord) -> OperationRecord:
        """``record`` as it is now, its replay counted if it is terminal (a waiter's look):
        one statement on PostgreSQL."""
        if self.is_postgres:
            return pg_writes.reread(self.engine, record)

        def txn(conn: Connection) -> OperationRecord:
            counted = self._count_replay(conn, record)
            if counted is not None:
                return counted
            row = (
                conn.execute(
                    sa.select(operations).where(
                        operations.c.tenant_id == record.tenant_id,
                        operations.c.id == record.id,
                    )
                )
                .mappings()
                .one()
            )
            return OperationRecord.from_row(row)

        return run_in_transaction(self.engine, txn)

    def _count_replay(self, conn: Connection, record: OperationRecord) -> OperationRecord | None:
        """Count one replay of ``record`` (terminal, not reaped); the row as it is now."""
        row = (
            conn.execute(
                REPLAY_BY_ID,
                {
                    "r_tenant_id": record.tenant_id,
                    "r_id": record.id,
                    "r_fingerprint": record.fingerprint,
                },
            )
            .mappings()
            .first()
        )
        return OperationRecord.from_row(row) if row is not None else None
