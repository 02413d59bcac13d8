"""The reconciler's work queue: lease due operations, hand them back, set corrupt rows aside.

A mixin of :class:`~payorch.storage._store.Store`; it uses the store's engine and event log.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..errors import CorruptRecord, StaleVersion
from ..records import OperationRecord
from . import _pg_writes as pg_writes
from ._engine import run_in_transaction
from ._statements import EVENT_INSERT, add_event, lease_row, new_id
from ._tables import db_now, db_now_plus, is_active, operations

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

__all__ = ["QUARANTINE_EVENT", "QUARANTINE_HOLD", "WorkQueue"]

# A row that cannot be read is set aside, not retried every pass: an operator must repair
# it. After the hold it is picked (and, if still corrupt, quarantined) again.
QUARANTINE_EVENT = "quarantined"
QUARANTINE_HOLD = timedelta(hours=1)


class WorkQueue:
    """Due operations for reconcilers: ``claim_due``, ``lease_one``, ``release``, renewal."""

    if TYPE_CHECKING:
        engine: Engine

        @property
        def is_postgres(self) -> bool: ...

        @property
        def distributed(self) -> bool: ...

    def claim_due(
        self,
        *,
        owner: str,
        lease: timedelta,
        limit: int,
        tenant_ids: Collection[str] | None = None,
        quarantine: timedelta = QUARANTINE_HOLD,
        on_quarantine: Callable[[CorruptRecord], None] | None = None,
    ) -> list[tuple[OperationRecord, datetime]]:
        """Lease up to ``limit`` due operations for ``owner``; return them with the DB time.

        Due: ``outcome_unknown`` whose next check has come, or ``in_progress`` whose lease
        expired. PostgreSQL picks with ``FOR UPDATE SKIP LOCKED`` so daemons on many hosts
        take disjoint batches; the lease then keeps others off until it expires. On
        distributed tables (Citus) the pick reads without a lock, then leases per tenant
        (single-shard, ``SKIP LOCKED``).
        ``tenant_ids`` limits the scan to those tenants (a daemon per shard or per tenant).

        A picked row that cannot be read (:class:`CorruptRecord`) is quarantined (in the
        lease's transaction on SQLite; on PostgreSQL right after the one-statement lease,
        fenced by that lease): flagged ``needs_attention``, a ``quarantined`` event, not due
        again for ``quarantine``; it is left out of the batch (``on_quarantine`` hears of it)
        and the rest of the batch is leased as usual.
        """
        t = operations.c
        lease_s = lease.total_seconds()
        corrupt: list[CorruptRecord] = []

        def txn(conn: Connection) -> list[tuple[OperationRecord, datetime]]:
            pick = (
                sa.select(t.tenant_id, t.id, t.version)
                .where(
                    is_active(),  # literals: the partial index's predicate, as written
                    t.next_check_at <= db_now(),
                    sa.or_(t.lease_expires_at.is_(None), t.lease_expires_at <= db_now()),
                    t.tenant_id.in_(sorted(tenant_ids)) if tenant_ids is not None else sa.true(),
                )
                .order_by(t.next_check_at)
                .limit(limit)
            )
            picked = conn.execute(pick).all()  # SQLite: one writer, nothing to skip
            out: list[tuple[OperationRecord, datetime]] = []
            corrupt.clear()  # a retried transaction starts over
            for tenant_id, op_id, version in picked:
                try:
                    leased = lease_row(
                        conn, tenant_id, op_id, version, owner=owner, lease_s=lease_s
                    )
                except CorruptRecord as exc:
                    # The lease UPDATE applied (version + 1) before the row failed to decode.
                    where = (tenant_id, op_id, version + 1)
                    self._quarantine(conn, exc, where, owner=owner, hold=quarantine)
                    corrupt.append(exc)
                    continue
                if leased is not None:
                    out.append(leased)
            return out

        if self.is_postgres:
            # One statement picks and leases the batch (one round trip, no per-row UPDATE);
            # an unreadable row is set aside after it, fenced by the lease just taken.
            batch, unreadable = pg_writes.claim_due(
                self.engine,
                owner=owner,
                lease_s=lease_s,
                limit=limit,
                tenant_ids=tenant_ids,
                distributed=self.distributed,
            )
            for exc, where in unreadable:
                quarantine_one = functools.partial(
                    self._quarantine, exc=exc, where=where, owner=owner, hold=quarantine
                )
                run_in_transaction(self.engine, quarantine_one)
                corrupt.append(exc)
        else:
            batch = run_in_transaction(self.engine, txn)
        if on_quarantine is not None:
            for exc in corrupt:
                on_quarantine(exc)
        return batch

    def lease_one(
        self,
        record: OperationRecord,
        *,
        owner: str,
        lease: timedelta,
        kind: str,
        actor: str,
        detail: Mapping[str, Any],
    ) -> tuple[OperationRecord, datetime]:
        """Lease one active operation whose lease is free or expired, with an event.

        Raises StaleVersion if it changed since ``record`` was read or someone holds it, and
        CorruptRecord (after quarantining it, as ``claim_due`` does) if it cannot be read.
        """

        def txn(conn: Connection) -> tuple[OperationRecord, datetime] | CorruptRecord:
            try:
                leased = lease_row(
                    conn,
                    record.tenant_id,
                    record.id,
                    record.version,
                    owner=owner,
                    lease_s=lease.total_seconds(),
                )
            except CorruptRecord as exc:
                where = (record.tenant_id, record.id, record.version + 1)
                self._quarantine(conn, exc, where, owner=owner, hold=QUARANTINE_HOLD)
                return exc  # raised once the quarantine has committed
            if leased is None:
                raise StaleVersion(
                    f"operation {record.id} changed or was leased meanwhile; try again",
                    operation_id=record.id,
                )
            add_event(
                conn,
                leased[0],
                kind=kind,
                actor=actor,
                from_state=None,
                to_state=None,
                detail=detail,
            )
            return leased

        result = run_in_transaction(self.engine, txn)
        if isinstance(result, CorruptRecord):
            raise result
        return result

    def release(self, record: OperationRecord) -> None:
        """Give a lease back untouched (graceful shutdown): due again at once."""
        t = operations.c

        def txn(conn: Connection) -> None:
            conn.execute(
                sa.update(operations)
                .where(
                    t.tenant_id == record.tenant_id,
                    t.id == record.id,
                    t.version == record.version,
                )
                .values(
                    lease_owner=None,
                    lease_expires_at=None,
                    next_check_at=db_now(),
                    version=t.version + 1,
                    updated_at=db_now(),
                )
            )

        run_in_transaction(self.engine, txn)

    def renew_lease(
        self, record: OperationRecord, *, owner: str, lease: timedelta
    ) -> tuple[OperationRecord, datetime]:
        """Restart ``owner``'s lease on ``record`` (``lease`` from now); with the DB time.

        Fenced by version and owner, even when the lease has lapsed: a lapsed lease nobody
        took meanwhile is still ours. Raises StaleVersion if anyone else wrote it.
        """
        t = operations.c
        renew = (
            sa.update(operations)
            .where(
                t.tenant_id == record.tenant_id,
                t.id == record.id,
                t.version == record.version,
                t.lease_owner == owner,
                t.state.in_(("in_progress", "outcome_unknown")),
            )
            .values(
                lease_expires_at=db_now_plus(sa.literal(lease.total_seconds())),
                version=t.version + 1,
                updated_at=db_now(),
            )
            .returning(*operations.c, t.updated_at.label("_now"))
        )

        def txn(conn: Connection) -> tuple[OperationRecord, datetime]:
            row = conn.execute(renew).mappings().first()
            if row is None:
                raise StaleVersion(f"operation {record.id} changed", operation_id=record.id)
            return OperationRecord.from_row(row), row["_now"]

        return run_in_transaction(self.engine, txn)

    def _quarantine(
        self,
        conn: Connection,
        exc: CorruptRecord,
        where: tuple[str, str, int],
        *,
        owner: str,
        hold: timedelta,
    ) -> None:
        """Set an unreadable row aside: flagged, lease released, next check after ``hold``.

        Only the columns this writes are touched; the corrupt ones stay as evidence for
        whoever repairs the row. ``where`` (tenant, id, version) fences it to the lease just
        taken, by the values the pick read rather than what the broken row decoded to.
        """
        t = operations.c
        tenant_id, op_id, version = where
        moved = conn.execute(
            sa.update(operations)
            .where(
                t.tenant_id == tenant_id,
                t.id == op_id,
                t.version == version,
                t.lease_owner == owner,
            )
            .values(
                needs_attention=True,
                lease_owner=None,
                lease_expires_at=None,
                next_check_at=db_now_plus(sa.literal(hold.total_seconds())),
                version=t.version + 1,
                updated_at=db_now(),
            )
        )
        if moved.rowcount != 1:  # pragma: no cover - the lease was taken in this transaction
            return
        conn.execute(
            EVENT_INSERT,
            {
                "e_tenant_id": tenant_id,
                "e_id": new_id(),
                "e_operation_id": op_id,
                "e_kind": QUARANTINE_EVENT,
                "e_actor": owner,
                "e_from_state": None,
                "e_to_state": None,
                "e_version": None,
                "e_detail": {"error": type(exc).__name__, "problem": exc.problem},
            },
        )
