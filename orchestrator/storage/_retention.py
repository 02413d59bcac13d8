"""The reaper: past its retention window a namespace keeps only a tombstone.

A terminal operation whose ``retain_until`` has passed (database clock) loses every body it
holds: its request and response, the details of its events and the bodies of the webhook
deliveries filed under it, all in one transaction. What stays is the tombstone (namespace,
fingerprint, final state, operation id), so a later claim of that key gets
``IdempotencyKeyExpired`` and nothing runs, and the shape of the audit trail: each event's
kind, actor, states and time, each delivery's id, type and result.

An operation flagged ``needs_attention`` is never reaped: a human still has to look at it,
with its evidence. Once acknowledged or resolved it is reaped on the next pass.

The scan reads the partial index ``ix_payorch_operations_retention`` (terminal rows not yet
reaped) tenant by tenant, since the index leads with ``tenant_id``; the tenants themselves
are found with a loose index scan, so the cost follows the due rows, not the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..errors import InvalidRequest
from ._distribution import is_distributed
from ._engine import read_in_transaction, run_in_transaction
from ._folded import stripped
from ._store import Store, new_id
from ._tables import TERMINAL_STATE_VALUES, db_now, events, operations, webhook_inbox

__all__ = ["REAP_EVENT", "ReapReport", "Tombstone", "reap"]

REAP_EVENT = "reaped"
_STRIPPED = ("request", "response", "event_details", "webhook_bodies")


@dataclass(frozen=True, kw_only=True)
class Tombstone:
    """What remains of a reaped namespace (or, in a dry run, what would remain)."""

    tenant_id: str
    operation_id: str
    operation: str
    idempotency_key: str
    fingerprint: str
    state: str
    retain_until: datetime

    def to_dict(self) -> dict[str, Any]:
        return {
            "tenant_id": self.tenant_id,
            "operation_id": self.operation_id,
            "operation": self.operation,
            "idempotency_key": self.idempotency_key,
            "fingerprint": self.fingerprint,
            "state": self.state,
            "retain_until": self.retain_until.isoformat(),
        }


@dataclass(kw_only=True)
class ReapReport:
    dry_run: bool
    items: list[Tombstone] = field(default_factory=list)  # reaped, or due in a dry run
    skipped: int = 0  # changed under us between the scan and the write (fenced out)

    @property
    def reaped(self) -> int:
        return 0 if self.dry_run else len(self.items)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "reaped": self.reaped,
            "due": len(self.items),
            "skipped": self.skipped,
            "items": [i.to_dict() for i in self.items],
        }


def _retained() -> sa.ColumnElement[bool]:
    # Exactly the partial index's predicate, so both PostgreSQL and SQLite may use it.
    t = operations.c
    return sa.and_(t.reaped_at.is_(None), t.retain_until.is_not(None))


def _tenants_with_retained_rows(conn: Connection) -> list[str]:
    """Distinct tenants in the retention index, one index probe per tenant (a recursive
    walk; on distributed tables, which Citus cannot walk so, each shard's own DISTINCT)."""
    t = operations.c
    if is_distributed(conn.engine):
        found = sa.select(t.tenant_id).where(_retained()).distinct().order_by(t.tenant_id)
        return [str(r) for r in conn.execute(found).scalars()]
    seed = sa.select(sa.func.min(t.tenant_id).label("tenant_id")).where(_retained())
    walk = seed.cte("retained_tenants", recursive=True)
    step = (
        sa.select(sa.func.min(t.tenant_id))
        .where(_retained(), t.tenant_id > walk.c.tenant_id)
        .scalar_subquery()
    )
    walk = walk.union_all(sa.select(step).where(walk.c.tenant_id.is_not(None)))
    query = sa.select(walk.c.tenant_id).where(walk.c.tenant_id.is_not(None))
    return [str(r) for r in conn.execute(query).scalars()]


def _due(conn: Connection, tenant_id: str, limit: int) -> list[Any]:
    t = operations.c
    return list(
        conn.execute(
            sa.select(
                t.tenant_id,
                t.id,
                t.version,
                t.operation,
                t.idempotency_key,
                t.fingerprint,
                t.state,
                t.retain_until,
                t.claim_event,
                t.answer_event,
            )
            .where(
                t.tenant_id == tenant_id,
                _retained(),
                t.retain_until <= db_now(),
                sa.not_(t.needs_attention),  # a flagged one waits for its human
            )
            .order_by(t.retain_until)
            .limit(limit)
        )
        .mappings()
        .all()
    )


def _tombstone(row: Any) -> Tombstone:
    return Tombstone(
        tenant_id=row["tenant_id"],
        operation_id=row["id"],
        operation=row["operation"],
        idempotency_key=row["idempotency_key"],
        fingerprint=row["fingerprint"],
        state=row["state"],
        retain_until=row["retain_until"],
    )


def _strip_evidence(conn: Connection, tenant_id: str, op_id: str) -> dict[str, int]:
    """Null the event details and webhook bodies of one operation; how many of each.

    Both read an index led by (tenant_id, operation_id). SQL NULL (``sa.null()``), not a
    JSON null: nothing of the body is left, not even its type.
    """
    e, i = events.c, webhook_inbox.c
    details = conn.execute(
        sa.update(events)
        .where(e.tenant_id == tenant_id, e.operation_id == op_id, e.detail.is_not(None))
        .values(detail=sa.null())
    ).rowcount
    bodies = conn.execute(
        sa.update(webhook_inbox)
        .where(i.tenant_id == tenant_id, i.operation_id == op_id, i.body.is_not(None))
        .values(body=sa.null())
    ).rowcount
    return {"event_details": int(details), "webhook_bodies": int(bodies)}


def _reap_rows(conn: Connection, rows: list[Any], actor: str) -> tuple[list[Tombstone], int]:
    """Reap ``rows`` (each one fenced UPDATE plus its event); returns reaped and skipped."""
    t = operations.c
    reaped: list[Tombstone] = []
    skipped = 0
    for row in rows:
        # The events kept on the row lose their bodies like the event rows (_folded.py).
        claim, claim_stripped = stripped(row["claim_event"])
        answer, answer_stripped = stripped(row["answer_event"])
        updated = conn.execute(
            sa.update(operations)
            .where(
                t.tenant_id == row["tenant_id"],
                t.id == row["id"],
                t.version == row["version"],
                t.state.in_(TERMINAL_STATE_VALUES),
                t.reaped_at.is_(None),
                sa.not_(t.needs_attention),
            )
            .values(
                request=sa.null(),
                response=sa.null(),
                claim_event=claim if claim is not None else sa.null(),
                answer_event=answer if answer is not None else sa.null(),
                reaped_at=db_now(),
                version=t.version + 1,
                updated_at=db_now(),
            )
            .returning(t.version)
        ).first()
        if updated is None:
            skipped += 1
            continue
        cleared = _strip_evidence(conn, row["tenant_id"], row["id"])
        cleared["event_details"] += claim_stripped + answer_stripped
        conn.execute(
            sa.insert(events).values(
                tenant_id=row["tenant_id"],
                id=new_id(),
                operation_id=row["id"],
                kind=REAP_EVENT,
                actor=actor,
                from_state=None,
                to_state=None,
                version=None,
                detail={
                    "retain_until": row["retain_until"].isoformat(),
                    "stripped": list(_STRIPPED),
                    "version": updated[0],
                    **cleared,
                },
                created_at=db_now(),
            )
        )
        reaped.append(_tombstone(row))
    return reaped, skipped


def reap(
    store: Store,
    *,
    limit: int = 1000,
    dry_run: bool = False,
    batch_size: int = 100,
    tenant_id: str | None = None,
    actor: str = "reaper",
) -> ReapReport:
    """Strip the bodies of up to ``limit`` operations past retention, ``batch_size`` per
    transaction; with ``dry_run`` only list them. ``tenant_id`` limits it to one tenant."""
    if limit < 1 or batch_size < 1:
        raise InvalidRequest("limit and batch size must be at least 1")
    report = ReapReport(dry_run=dry_run)
    if tenant_id is not None:
        tenants = [tenant_id]
    else:
        tenants = read_in_transaction(store.engine, _tenants_with_retained_rows)
    for tenant in tenants:
        left = limit - len(report.items)
        if left <= 0:
            break
        if dry_run:

            def listing(conn: Connection, tenant: str = tenant, n: int = left) -> list[Any]:
                return _due(conn, tenant, n)

            rows = read_in_transaction(store.engine, listing)
            report.items.extend(_tombstone(r) for r in rows)
            continue
        while left > 0:
            want = min(batch_size, left)

            def batch(
                conn: Connection, tenant: str = tenant, want: int = want
            ) -> tuple[int, list[Tombstone], int]:
                rows = _due(conn, tenant, want)
                return len(rows), *_reap_rows(conn, rows, actor)

            # The report grows only after a commit: a retried transaction must not count twice.
            seen, reaped, skipped = run_in_transaction(store.engine, batch)
            report.items.extend(reaped)
            report.skipped += skipped
            left -= len(reaped)
            if seen < want or not reaped:
                break  # this tenant has nothing more due (or only rows others are changing)
    return report
