"""The outbox's reading side: lease due messages, mark what a sink did, and the operators'
reads and retries. Every time is the database's.

A message is leased (``lease_owner``, ``lease_expires_at``) before a sink sees it, and its
``attempts`` counted then: a relay killed after reading, after sending or before marking
leaves a lease that expires, and the message is delivered again (at least once) by whoever
leases it next; a message that kills every relay that reads it dies after ``max_attempts``.
Only the oldest pending message of an aggregate (per destination) is leasable, so one
aggregate's messages reach a sink in the order they were staged.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..core import safe_text
from ..errors import InvalidRequest, MessageNotFound, StateConflict
from ..records import json_ready
from ..storage._distribution import is_distributed
from ..storage._engine import run_in_transaction
from ..storage._outbox import HOOK_FAILED
from ..storage._statements import new_id
from ..storage._tables import (
    OUTBOX_STATE_VALUES,
    db_now,
    db_now_plus,
    events,
    is_pending,
    outbox,
)
from ._sinks import LeaseClock, OutboxMessage

__all__ = [
    "RETRY_EVENT",
    "StoredMessage",
    "delivered",
    "failed",
    "find",
    "lease_due",
    "listing",
    "purge",
    "release",
    "retry",
    "stats",
]

RETRY_EVENT = "outbox_retry"
_ERROR_LIMIT = 2000

_o = outbox.c


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """An outbox row as operators read it."""

    tenant_id: str
    id: str
    type: str
    aggregate_type: str
    aggregate_id: str
    destination: str
    state: str
    attempts: int
    next_attempt_at: datetime
    lease_owner: str | None
    lease_expires_at: datetime | None
    last_error: str | None
    operation_id: str | None
    created_at: datetime
    delivered_at: datetime | None
    payload: Mapping[str, Any]

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> StoredMessage:
        return cls(
            tenant_id=row["tenant_id"],
            id=row["id"],
            type=row["type"],
            aggregate_type=row["aggregatetype"],
            aggregate_id=row["aggregateid"],
            destination=row["destination"],
            state=row["state"],
            attempts=row["attempts"],
            next_attempt_at=row["next_attempt_at"],
            lease_owner=row["lease_owner"],
            lease_expires_at=row["lease_expires_at"],
            last_error=row["last_error"],
            operation_id=row["operation_id"],
            created_at=row["created_at"],
            delivered_at=row["delivered_at"],
            payload=row["payload"] if isinstance(row["payload"], Mapping) else {},
        )

    def as_json(self) -> dict[str, Any]:
        return json_ready(self)


def _earlier_pending() -> sa.ColumnElement[bool]:
    """An earlier pending message of the same aggregate and destination exists."""
    e = outbox.alias("earlier")
    return sa.exists().where(
        e.c.tenant_id == _o.tenant_id,
        e.c.aggregatetype == _o.aggregatetype,
        e.c.aggregateid == _o.aggregateid,
        e.c.destination == _o.destination,
        e.c.state == sa.literal_column("'pending'"),
        e.c.seq < _o.seq,
    )


def lease_due(
    engine: Engine,
    *,
    owner: str,
    lease_s: float,
    limit: int,
    destinations: Collection[str],
    max_attempts: int,
    tenant_ids: Collection[str] | None = None,
) -> tuple[list[OutboxMessage], int]:
    """Lease up to ``limit`` due messages for ``destinations`` to ``owner`` (attempts
    counted), skipping rows other relays hold (``SKIP LOCKED`` on PostgreSQL); with how
    many were dead-lettered instead. A message that has had ``max_attempts`` already and
    comes back (every relay that read it died or hung before recording a failure) is dead
    here, in the same statement: the bound holds even when ``failed`` is never reached.

    On distributed tables (Citus), where a lock across shards is refused, the due messages
    are found by a read that locks nothing, then leased (and the spent ones dead-lettered)
    per tenant, single-shard, with the same conditions judged again under the lock."""
    conditions = _due_now(destinations)
    if tenant_ids is not None:
        conditions.append(_o.tenant_id.in_(sorted(tenant_ids)))
    due = sa.select(_o.tenant_id, _o.id).where(*conditions).order_by(_o.next_attempt_at, _o.seq)
    params = {
        "lease_s": lease_s,
        "max_attempts": max_attempts,
        "spent_error": f"no relay finished it in {max_attempts} attempts (killed or hung "
        "while delivering it)",
    }
    if is_distributed(engine):
        rows = _lease_by_tenant(engine, due, conditions, params, owner=owner, limit=limit)
    else:
        picked = due.limit(limit).with_for_update(skip_locked=True)
        stmt = _lease(sa.tuple_(_o.tenant_id, _o.id).in_(picked), owner, spent=None)

        def txn(conn: Connection) -> list[Any]:
            return list(conn.execute(stmt, params).mappings().all())

        rows = run_in_transaction(engine, txn)
    # Read once per batch, beside the local monotonic clock at (about) the same moment.
    clock = LeaseClock(rows[0]["_now"], time.monotonic()) if rows else None
    leased = [_message(row, clock) for row in rows if row["state"] == "pending"]
    return sorted(leased, key=lambda m: (m.created_at, m.id)), len(rows) - len(leased)


def _due_now(destinations: Collection[str]) -> list[sa.ColumnElement[bool]]:
    return [
        is_pending(),
        _o.next_attempt_at <= db_now(),
        sa.or_(_o.lease_expires_at.is_(None), _o.lease_expires_at <= db_now()),
        _o.destination.in_(sorted(destinations)),
        ~_earlier_pending(),
    ]


def _lease(where: sa.ColumnElement[bool], owner: str, *, spent: bool | None) -> Any:
    """The lease UPDATE of the rows ``where`` picks. ``spent`` None: one statement decides
    per row (a CASE); True/False: the rows already split (Citus refuses a function inside a
    CASE), the spent ones dead-lettered, the others leased."""
    is_spent = _o.attempts >= sa.bindparam("max_attempts")
    until = db_now_plus(sa.bindparam("lease_s"))
    if spent is None:
        values: dict[str, Any] = {
            "state": sa.case((is_spent, "dead"), else_="pending"),
            "lease_owner": sa.case((is_spent, None), else_=owner),
            "lease_expires_at": sa.case((is_spent, None), else_=until),
            "attempts": sa.case((is_spent, _o.attempts), else_=_o.attempts + 1),
            "last_error": sa.case((is_spent, sa.bindparam("spent_error")), else_=_o.last_error),
        }
    elif spent:
        values = {
            "state": "dead",
            "lease_owner": None,
            "lease_expires_at": None,
            "last_error": sa.bindparam("spent_error"),
        }
    else:
        values = {"lease_owner": owner, "lease_expires_at": until, "attempts": _o.attempts + 1}
    return (
        sa.update(outbox)
        .where(where)
        .values(**values, updated_at=db_now())
        # The database's time with the lease (the row's updated_at: Citus refuses a function
        # in RETURNING): what the sinks stamp (LeaseClock), so a relay whose host clock is
        # off still signs with a time its receivers accept.
        .returning(*outbox.c, _o.updated_at.label("_now"))
    )


def _lock_and_lease(
    lock: Any, tenant_id: str, params: dict[str, Any], owner: str, conn: Connection
) -> list[Any]:
    """One tenant's shard, one transaction: lock what is still due, then dead-letter the
    locked messages past their attempts and lease the others."""
    locked = conn.execute(lock).all()
    spent = [m for m, attempts in locked if attempts >= params["max_attempts"]]
    live = [m for m, attempts in locked if attempts < params["max_attempts"]]
    rows: list[Any] = []
    for ids, is_spent in ((spent, True), (live, False)):
        if ids:
            where = sa.and_(_o.tenant_id == tenant_id, _o.id.in_(ids))
            stmt = _lease(where, owner, spent=is_spent)
            rows.extend(conn.execute(stmt, params).mappings().all())
    return rows


def _lease_by_tenant(
    engine: Engine,
    due: Any,
    conditions: list[sa.ColumnElement[bool]],
    params: dict[str, Any],
    *,
    owner: str,
    limit: int,
) -> list[Any]:
    """Distributed: read up to twice the batch (relays reading the same oldest rows lose
    some to each other), then per tenant, oldest first, lock what is still due and lease
    it (:func:`_lock_and_lease`)."""

    def candidates(conn: Connection) -> list[Any]:
        return list(conn.execute(due.limit(limit * 2)).all())

    by_tenant: dict[str, list[str]] = {}
    for tenant_id, message_id in run_in_transaction(engine, candidates, write=False):
        by_tenant.setdefault(tenant_id, []).append(message_id)
    rows: list[Any] = []
    for tenant_id, ids in by_tenant.items():
        room = limit - len(rows)
        if room <= 0:
            break
        # Every candidate of the tenant, at most ``room`` locked: the rows another relay is
        # leasing right now are skipped for the next ones, not waited for.
        lock = (
            sa.select(_o.id, _o.attempts)
            .where(_o.tenant_id == tenant_id, _o.id.in_(ids), *conditions)
            .order_by(_o.next_attempt_at, _o.seq)
            .limit(room)
            .with_for_update(skip_locked=True)
        )
        rows.extend(
            run_in_transaction(
                engine, functools.partial(_lock_and_lease, lock, tenant_id, params, owner)
            )
        )
    return rows


def release(engine: Engine, message: OutboxMessage, *, owner: str) -> bool:
    """Hand back a leased message that was not sent (a relay stopping): due at once for
    the next relay, its attempt not counted."""
    stmt = (
        sa.update(outbox)
        .where(
            _o.tenant_id == message.tenant_id,
            _o.id == message.id,
            is_pending(),
            _o.lease_owner == owner,
            _o.attempts == message.attempt,
        )
        .values(
            lease_owner=None,
            lease_expires_at=None,
            attempts=_o.attempts - 1,
            updated_at=db_now(),
        )
    )
    return bool(run_in_transaction(engine, lambda conn: conn.execute(stmt).rowcount))


def _message(row: Mapping[Any, Any], clock: LeaseClock | None = None) -> OutboxMessage:
    payload = row["payload"]
    return OutboxMessage(
        tenant_id=row["tenant_id"],
        id=row["id"],
        type=row["type"],
        aggregate_type=row["aggregatetype"],
        aggregate_id=row["aggregateid"],
        payload=payload if isinstance(payload, Mapping) else {},
        destination=row["destination"],
        attempt=row["attempts"],
        operation_id=row["operation_id"],
        created_at=row["created_at"],
        clock=clock,
    )


def delivered(engine: Engine, message: OutboxMessage) -> bool:
    """Mark ``message`` delivered (whoever leases it now: delivery is a fact). False if it
    was no longer pending (an operator dead-lettered it, or another relay marked it)."""
    stmt = (
        sa.update(outbox)
        .where(_o.tenant_id == message.tenant_id, _o.id == message.id, is_pending())
        .values(
            state="delivered",
            delivered_at=db_now(),
            updated_at=db_now(),
            lease_owner=None,
            lease_expires_at=None,
            last_error=None,
        )
    )
    return bool(run_in_transaction(engine, lambda conn: conn.execute(stmt).rowcount))


def failed(
    engine: Engine,
    message: OutboxMessage,
    *,
    owner: str,
    error: str,
    delay_s: float,
    max_attempts: int,
) -> str | None:
    """Record a failed attempt of ``message`` while ``owner`` still leases it: due again
    after ``delay_s``, or ``dead`` once ``max_attempts`` attempts were made. Returns the
    state it is now in, or None if the lease was lost meanwhile (nothing written)."""
    dead = message.attempt >= max_attempts
    stmt = (
        sa.update(outbox)
        .where(
            _o.tenant_id == message.tenant_id,
            _o.id == message.id,
            is_pending(),
            _o.lease_owner == owner,
            _o.attempts == message.attempt,  # this attempt's lease, not a later one's
        )
        .values(
            state="dead" if dead else "pending",
            next_attempt_at=db_now_plus(sa.bindparam("delay_s")),
            updated_at=db_now(),
            lease_owner=None,
            lease_expires_at=None,
            last_error=safe_text(error)[:_ERROR_LIMIT],
        )
    )
    params = {"delay_s": delay_s}
    rows = run_in_transaction(engine, lambda conn: conn.execute(stmt, params).rowcount)
    if not rows:
        return None
    return "dead" if dead else "pending"


def listing(
    engine: Engine,
    *,
    state: str | None = None,
    tenant_id: str | None = None,
    limit: int = 50,
) -> list[StoredMessage]:
    """Messages newest first, of one state and one tenant when given."""
    if state is not None and state not in OUTBOX_STATE_VALUES:
        raise InvalidRequest(f"no outbox state {state!r}; use {', '.join(OUTBOX_STATE_VALUES)}")
    query = sa.select(outbox)
    if state is not None:
        query = query.where(_o.state == state)
    if tenant_id is not None:
        query = query.where(_o.tenant_id == tenant_id)
    query = query.order_by(_o.created_at.desc(), _o.seq.desc()).limit(limit)
    rows = run_in_transaction(
        engine, lambda conn: conn.execute(query).mappings().all(), write=False
    )
    return [StoredMessage.from_row(row) for row in rows]


def find(engine: Engine, message_id: str, *, tenant_id: str | None = None) -> StoredMessage:
    """The message with this id; ``MessageNotFound``, or ``InvalidRequest`` when the id is
    held by several tenants and none was named."""
    query = sa.select(outbox).where(_o.id == message_id)
    if tenant_id is not None:
        query = query.where(_o.tenant_id == tenant_id)
    rows = run_in_transaction(
        engine, lambda conn: conn.execute(query.limit(2)).mappings().all(), write=False
    )
    if not rows:
        raise MessageNotFound(f"no outbox message {message_id}")
    if len(rows) > 1:
        raise InvalidRequest(f"message id {message_id} is held by several tenants: pass --tenant")
    return StoredMessage.from_row(rows[0])


def retry(
    engine: Engine,
    message_id: str,
    *,
    actor: str,
    reason: str,
    tenant_id: str | None = None,
) -> StoredMessage:
    """Make a dead (or backing-off) message due now with a fresh count of attempts, with an
    audited ``outbox_retry`` event. A delivered or leased message is refused."""
    if not reason.strip():
        raise InvalidRequest("a retry needs a reason")
    found = find(engine, message_id, tenant_id=tenant_id)
    if found.state == "delivered":
        raise StateConflict(f"message {found.id} was delivered already")
    if found.type == HOOK_FAILED:
        raise StateConflict(
            f"message {found.id} stands for a hook that failed ({found.last_error}): fix the "
            "hook and stage its messages by hand; it is never delivered itself"
        )
    stmt = (
        sa.update(outbox)
        .where(
            _o.tenant_id == found.tenant_id,
            _o.id == found.id,
            _o.state.in_(["pending", "dead"]),
            sa.or_(_o.lease_expires_at.is_(None), _o.lease_expires_at <= db_now()),
        )
        .values(
            state="pending",
            attempts=0,
            next_attempt_at=db_now(),
            updated_at=db_now(),
            lease_owner=None,
            lease_expires_at=None,
        )
        .returning(*outbox.c)
    )

    def txn(conn: Connection) -> StoredMessage:
        row = conn.execute(stmt).mappings().first()
        if row is None:
            raise StateConflict(f"message {found.id} is being delivered now; try again later")
        after = StoredMessage.from_row(row)
        # Filed in the event log under the message's id, as an operation's under its own.
        conn.execute(
            events.insert().values(
                tenant_id=after.tenant_id,
                id=new_id(),
                operation_id=after.id,
                kind=RETRY_EVENT,
                actor=actor,
                detail={"reason": reason, "was": found.state, "attempts": found.attempts},
                created_at=db_now(),
            )
        )
        return after

    return run_in_transaction(engine, txn)


def stats(engine: Engine, *, tenant_id: str | None = None) -> dict[str, Any]:
    """Counts by state (pending split into due and waiting), and the age in seconds of the
    oldest pending message, by the database clock; of one tenant when given."""
    now = db_now()
    query = sa.select(
        _o.state,
        sa.func.count(),
        sa.func.min(_o.created_at),
        sa.func.sum(sa.case((_o.next_attempt_at <= now, 1), else_=0)),
        now,
    ).group_by(_o.state)
    if tenant_id is not None:
        query = query.where(_o.tenant_id == tenant_id)
    rows = run_in_transaction(engine, lambda conn: conn.execute(query).all(), write=False)
    counts = dict.fromkeys(OUTBOX_STATE_VALUES, 0)
    out: dict[str, Any] = {"due": 0, "oldest_pending_seconds": 0.0}
    for state, count, oldest, due, db_time in rows:
        counts[state] = count
        if state == "pending":
            out["due"] = int(due or 0)
            if oldest is not None and db_time is not None:
                age = _aware(db_time) - _aware(oldest)
                out["oldest_pending_seconds"] = max(0.0, age.total_seconds())
    out.update(counts)
    return out


def _aware(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def purge(engine: Engine, *, older_than: timedelta, dry_run: bool = False) -> int:
    """Delete the messages delivered more than ``older_than`` ago (how many; with
    ``dry_run``, how many would be). Pending and dead messages are kept: they still need a
    relay or an operator."""
    seconds = older_than.total_seconds()
    if seconds <= 0:
        raise InvalidRequest("the age of the messages to purge must be positive")
    old = sa.and_(
        _o.state == sa.literal_column("'delivered'"),
        _o.delivered_at < db_now_plus(sa.literal(-seconds)),
    )
    if dry_run:
        query = sa.select(sa.func.count()).select_from(outbox).where(old)
        return int(
            run_in_transaction(engine, lambda conn: conn.execute(query).scalar_one(), write=False)
        )
    stmt = sa.delete(outbox).where(old)
    return int(run_in_transaction(engine, lambda conn: conn.execute(stmt).rowcount))
