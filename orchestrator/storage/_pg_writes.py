"""PostgreSQL's hot writes, one statement and one round trip each (see ``_statements.py``).

The store decides what to write and what an answer means; this module fills the parameters
of the SQL-text statements, runs each in autocommit
(:func:`~payorch.storage._driver_sql.run_sql`) and turns the row into a record. Timestamps
come from the database; ids from the caller.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.engine import Connection, Engine

from ..core import State
from ..errors import CorruptRecord, StaleVersion, StorageError
from ..records import OPERATION_COLUMNS, NewOperation, OperationRecord
from . import _citus_writes as citus_writes
from ._claims import claim_detail
from ._distribution import is_distributed
from ._driver_sql import run_sql, run_sql_rows
from ._engine import run_in_transaction
from ._folded import claim_event
from ._replication import gate
from ._statements import (
    PG_CLAIM,
    PG_CLAIM_DUE,
    PG_CLAIM_DUE_TENANTS,
    PG_CLAIMED,
    PG_DUE_CANDIDATES,
    PG_DUE_CANDIDATES_TENANTS,
    PG_FLAG_WAITING,
    PG_LEASE_LOCKED,
    PG_LOCK_CANDIDATES,
    PG_REREAD,
    UPDATED_COLUMNS,
    Shape,
    pg_transition_sql,
)

__all__ = [
    "claim",
    "claim_due",
    "flag_waiting",
    "json_param",
    "reread",
    "reread_for",
    "reread_for_distributed",
    "transition",
]

_NOW = len(OPERATION_COLUMNS) + 1  # after the kind and the columns: the database time
_LEASE_AT = OPERATION_COLUMNS.index("lease_expires_at") + 1


def json_param(value: Any) -> str:
    """A JSON parameter (``None`` as JSON null, as SQLAlchemy's JSON type writes it),
    compact: it is stored as written."""
    return json.dumps(dict(value) if isinstance(value, Mapping) else value, separators=_COMPACT)


_COMPACT = (",", ":")


def claim(
    engine: Engine,
    new: NewOperation,
    *,
    op_id: str,
    owner: str,
    lease_s: float,
    possibly_sent: bool,
) -> tuple[int, OperationRecord, datetime] | None:
    """``PG_CLAIM``: (its kind, the record, the database time), or None if it saw no row.

    Raises ``CommitUncertain`` if the statement (the claim's commit) went unanswered, and
    ``SyncStandbyUnavailable`` (nothing sent) if the store requires a synchronous standby
    and none streams.
    """
    request = json_param(new.request)
    params = {
        "tenant_id": new.tenant_id,
        "id": op_id,
        "operation": new.operation,
        "idempotency_key": new.idempotency_key,
        "fingerprint": new.fingerprint,
        "provider": new.provider,
        "downstream_key": new.downstream_key,
        "amount": new.amount,
        "currency": new.currency,
        "request": request,
        "retention_seconds": int(new.retention.total_seconds()),
        "possibly_sent": possibly_sent,
        "attempts": 1 if possibly_sent else 0,
        "owner": owner,
        "lease_s": lease_s,
        "claim_event": json_param(claim_event(owner, claim_detail(new))),
        # SQL NULL when unrouted (no bytes on the row), as the column reads back None.
        "route": json_param(new.route) if new.route is not None else None,
    }
    gate(engine)  # with PAYORCH_REQUIRE_SYNC_STANDBY: no claim without a synchronous standby
    if is_distributed(engine):
        row = citus_writes.claim(engine, params)
    else:
        row = run_sql(engine, PG_CLAIM, params)
    if row is None:
        return None
    now = row[_NOW].astimezone(UTC)
    if row[0] != PG_CLAIMED:
        return row[0], OperationRecord.from_pg(row[1:]), now
    record = OperationRecord.claimed(
        new,
        op_id=op_id,
        owner=owner,
        possibly_sent=possibly_sent,
        request=json.loads(request),  # as the row reads back
        created_at=now,
        lease_expires_at=row[_LEASE_AT].astimezone(UTC),
    )
    return PG_CLAIMED, record, now


def reread(engine: Engine, record: OperationRecord, replays: int = 1) -> OperationRecord:
    """``PG_REREAD``: the operation now, ``replays`` counted if it is terminal."""
    params = _reread_params(record, replays)
    if is_distributed(engine):
        return _reread_record(citus_writes.reread(engine, params), record)
    # A lost answer only leaves a replay count in doubt: nothing to tell the client.
    return _reread_record(run_sql(engine, PG_REREAD, params, write=False), record)


def flag_waiting(engine: Engine, record: OperationRecord) -> OperationRecord | None:
    """``PG_FLAG_WAITING`` (Citus: its two parts in one transaction): the operation as read,
    if it is in progress and marked as waited on, else None."""
    params = {"tenant_id": record.tenant_id, "id": record.id}
    if is_distributed(engine):
        row = citus_writes.flag_waiting(engine, params)
    else:
        row = run_sql(engine, PG_FLAG_WAITING, params)
    if row is None or not row[0]:
        return None
    found = OperationRecord.from_pg(row[1:])
    return found if found.state is State.IN_PROGRESS else None


def reread_for(driver_connection: Any, record: OperationRecord, waiters: int) -> OperationRecord:
    """``PG_REREAD`` on a psycopg connection in autocommit (the waiters' listener), for
    ``waiters`` requests at once: that many replays are counted if it is terminal."""
    row = driver_connection.execute(PG_REREAD, _reread_params(record, waiters)).fetchone()
    return _reread_record(row, record)


def reread_for_distributed(
    driver_connection: Any, record: OperationRecord, waiters: int
) -> OperationRecord:
    """:func:`reread_for` on a distributed schema (Citus: statements of one shard each)."""
    row = citus_writes.reread_for(driver_connection, _reread_params(record, waiters))
    return _reread_record(row, record)


def _reread_record(row: tuple[Any, ...] | None, record: OperationRecord) -> OperationRecord:
    if row is None:  # pragma: no cover - the operation is never deleted, only reaped
        raise StorageError(f"operation {record.id} vanished")
    return OperationRecord.from_pg(row[1:])


def _reread_params(record: OperationRecord, replays: int) -> dict[str, Any]:
    return {
        "tenant_id": record.tenant_id,
        "id": record.id,
        "fingerprint": record.fingerprint,
        "replays": replays,
    }


def transition(
    engine: Engine,
    cache: dict[Any, str],
    record: OperationRecord,
    *,
    shape: Shape,
    params: Mapping[str, Any],
    event: Mapping[str, Any] | None,
    distributed: bool = False,
) -> OperationRecord:
    """``pg_transition_sql(shape)`` (built once per shape, kept in ``cache``): the fenced
    UPDATE with the store's ``params``, its event (``event``: id, kind, actor, detail; None
    when the shape keeps it on the row) and the NOTIFY if anyone waits; StaleVersion if the
    version moved. ``distributed`` (Citus): the same as single-shard statements in one
    transaction (:mod:`payorch.storage._citus_writes`)."""
    params = dict(params)
    if event is not None:
        params.update(
            e_id=event["id"],
            e_kind=event["kind"],
            e_actor=event["actor"],
            e_from_state=record.state.value,
            e_detail=json_param(event["detail"]),
        )
    written: dict[str, Any] = {}
    for name in shape.plain:  # what the write sets, as the row will read back
        value = params[f"u_{name}"]
        if name in _JSON:  # SQL text: JSON as text, as SQLAlchemy's would
            text = params[f"u_{name}"] = json_param(value)
            value = json.loads(text) if name != "answer_event" else None
        if name != "answer_event":
            written[name] = value
    if distributed:
        row = citus_writes.transition(engine, cache, shape, params)
    else:
        sql = cache.get(shape)
        if sql is None:
            sql = cache[shape] = pg_transition_sql(shape)
        row = run_sql(engine, sql, params)
    if row is None:
        raise StaleVersion(
            f"operation {record.id} changed since version {record.version}",
            operation_id=record.id,
        )
    written["state"] = State(params["u_state"])
    if not shape.lease:
        written["lease_owner"] = None
    for name, value in zip(UPDATED_COLUMNS[:-1], row, strict=False):
        stamped = value
        if value is not None and value.__class__ is datetime and value.tzinfo is not UTC:
            stamped = value.astimezone(UTC)
        written[name] = stamped
    return record.written(written)


_JSON = frozenset({"response", "request", "answer_event", "route"})


Unreadable = tuple[CorruptRecord, tuple[str, str, int]]  # the error; tenant, id, version
_WHERE = tuple(OPERATION_COLUMNS.index(name) + 1 for name in ("tenant_id", "id", "version"))


def claim_due(
    engine: Engine,
    *,
    owner: str,
    lease_s: float,
    limit: int,
    tenant_ids: Collection[str] | None,
    distributed: bool = False,
) -> tuple[list[tuple[OperationRecord, datetime]], list[Unreadable]]:
    """``PG_CLAIM_DUE``: up to ``limit`` due operations leased to ``owner`` in one statement
    (``distributed``: a read, then a lease per tenant, :func:`_lease_by_tenant`); with the
    database time, oldest next check first. Rows that cannot be read come back apart, with
    the (tenant, id, version) the lease left them at, to be quarantined."""
    params: dict[str, Any] = {"owner": owner, "lease_s": lease_s, "limit": limit}
    if distributed:
        found = _lease_by_tenant(engine, params, tenant_ids)
    else:
        sql = PG_CLAIM_DUE
        if tenant_ids is not None:
            sql, params["tenant_ids"] = PG_CLAIM_DUE_TENANTS, sorted(tenant_ids)
        found = run_sql_rows(engine, sql, params, replan=True)
    rows = sorted(found, key=lambda row: row[0])
    leased: list[tuple[OperationRecord, datetime]] = []
    corrupt: list[Unreadable] = []
    for row in rows:
        try:
            leased.append((OperationRecord.from_pg(row[1:-1]), row[-1].astimezone(UTC)))
        except CorruptRecord as exc:
            tenant_id, op_id, version = (row[i] for i in _WHERE)
            corrupt.append((exc, (tenant_id, op_id, version)))
    return leased, corrupt


# Daemons that read the same oldest due rows lose some to each other (SKIP LOCKED): each
# reads this many times its batch, so a batch still fills while others lease beside it.
OVERREAD = 2


def _lease_by_tenant(
    engine: Engine, params: dict[str, Any], tenant_ids: Collection[str] | None
) -> list[Any]:
    """The pick without a lock across shards: ``PG_DUE_CANDIDATES`` (a read, oldest next
    check first, every shard), then per tenant in the order its oldest candidate came, one
    transaction on its shard: ``PG_LOCK_CANDIDATES`` (rows held by others skipped, "due"
    judged again under the lock) and ``PG_LEASE_LOCKED``, until the batch is full."""
    limit = params["limit"]
    read: dict[str, Any] = {"limit": limit * OVERREAD}
    sql = PG_DUE_CANDIDATES
    if tenant_ids is not None:
        sql, read["tenant_ids"] = PG_DUE_CANDIDATES_TENANTS, sorted(tenant_ids)
    by_tenant: dict[str, list[str]] = {}
    for tenant_id, op_id in run_sql_rows(engine, sql, read, replan=True):
        by_tenant.setdefault(tenant_id, []).append(op_id)
    rows: list[Any] = []
    for tenant_id, ids in by_tenant.items():
        room = limit - len(rows)
        if room <= 0:
            break
        # Every candidate of the tenant, at most ``room`` leased: the rows another daemon
        # is leasing right now are skipped for the next ones, not waited for.
        lease = {**params, "tenant_id": tenant_id, "ids": ids, "room": room}
        rows.extend(run_in_transaction(engine, functools.partial(_lock_and_lease, lease)))
    return rows


def _lock_and_lease(lease: dict[str, Any], conn: Connection) -> list[tuple[Any, ...]]:
    locked = [row[0] for row in conn.exec_driver_sql(PG_LOCK_CANDIDATES, lease)]
    if not locked:
        return []
    leased = conn.exec_driver_sql(PG_LEASE_LOCKED, {**lease, "locked": locked})
    return [tuple(row) for row in leased]
