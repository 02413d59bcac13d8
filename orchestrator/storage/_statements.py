"""The store's hot statements, built once with bind parameters.

SQLAlchemy then skips statement construction, coercion and cache-key work on every call;
each statement is still one round trip, fenced exactly as ``_store.py`` describes.

On PostgreSQL the executor's writes are single data-modifying statements, written here as
SQL text (``PG_CLAIM``, ``PG_REREAD``, :func:`pg_transition_sql`) and run in autocommit
with ``exec_driver_sql``: one round trip each, and no statement compilation or result
type processing on the client. They return ``OPERATION_COLUMNS`` in order
(:meth:`OperationRecord.from_pg`), preceded by a kind and followed by the database time.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, NamedTuple

import sqlalchemy as sa
import uuid6
from sqlalchemy.engine import Connection

from ..core import State
from ..records import OPERATION_COLUMNS, OperationRecord
from ._tables import (
    ACTIVE_STATE_VALUES,
    TERMINAL_STATE_VALUES,
    db_now,
    db_now_plus,
    events,
    operations,
)

__all__ = [
    "CLAIMED_COLUMNS",
    "CLAIM_INSERT",
    "CLAIM_REPLAY",
    "CLAIM_ROW",
    "EVENT_INSERT",
    "FLAG_WAITING",
    "PG_CLAIM",
    "PG_CLAIMED",
    "PG_CLAIM_DUE",
    "PG_CLAIM_DUE_TENANTS",
    "PG_DUE_CANDIDATES",
    "PG_DUE_CANDIDATES_TENANTS",
    "PG_EXISTING",
    "PG_FLAG_WAITING",
    "PG_LEASE_LOCKED",
    "PG_LOCK_CANDIDATES",
    "PG_NOTIFY",
    "PG_REPLAYED",
    "PG_REREAD",
    "REPLAY_BY_ID",
    "REPLAY_BY_NAMESPACE",
    "REREAD_REPLAY",
    "REREAD_ROW",
    "UPDATED_COLUMNS",
    "Shape",
    "add_event",
    "build_claim",
    "build_update",
    "event_insert",
    "lease_row",
    "new_id",
    "pg_transition_sql",
    "pg_update_sql",
]


def build_claim(insert: Any) -> Any:
    """The claim: INSERT … ON CONFLICT (namespace) DO NOTHING RETURNING, with bind params."""
    c = operations.c
    bound = {
        name: sa.bindparam(f"c_{name}", type_=c[name].type)
        for name in (
            "tenant_id",
            "id",
            "operation",
            "idempotency_key",
            "fingerprint",
            "state",
            "provider",
            "downstream_key",
            "amount",
            "currency",
            "request",
            "retention_seconds",
            "possibly_sent",
            "attempts",
            "lease_owner",
            "claim_event",
            "route",
        )
    }
    lease_s = sa.bindparam("c_lease_s", type_=sa.Float)
    return (
        insert(operations)
        .values(
            **bound,
            checks=0,
            needs_attention=False,
            version=1,
            lease_expires_at=db_now_plus(lease_s),
            next_check_at=db_now_plus(lease_s),
            created_at=db_now(),
            updated_at=db_now(),
        )
        .on_conflict_do_nothing(index_elements=["tenant_id", "operation", "idempotency_key"])
        .returning(*operations.c)
    )


def _replay(*where: sa.ColumnElement[bool]) -> Any:
    """Read a replayable operation and count the replay, in one statement.

    Replayable: terminal, same fingerprint, not reaped. ``version`` and ``updated_at`` stay
    as they are: a replay is not a change of the operation, and must not fence out an
    operator (or anyone) holding the version they read.
    """
    t = operations.c
    return (
        sa.update(operations)
        .where(
            *where,
            t.fingerprint == sa.bindparam("r_fingerprint", type_=t.fingerprint.type),
            t.state.in_(TERMINAL_STATE_VALUES),
            t.reaped_at.is_(None),
        )
        .values(replays=t.replays + 1, last_replayed_at=db_now())
        # The time the write read (Citus refuses a function in RETURNING).
        .returning(*operations.c, t.last_replayed_at.label("_now"))
    )


_t = operations.c
REPLAY_BY_NAMESPACE = _replay(
    _t.tenant_id == sa.bindparam("r_tenant_id", type_=_t.tenant_id.type),
    _t.operation == sa.bindparam("r_operation", type_=_t.operation.type),
    _t.idempotency_key == sa.bindparam("r_idempotency_key", type_=_t.idempotency_key.type),
)
REPLAY_BY_ID = _replay(
    _t.tenant_id == sa.bindparam("r_tenant_id", type_=_t.tenant_id.type),
    _t.id == sa.bindparam("r_id", type_=_t.id.type),
)

EVENT_INSERT = sa.insert(events).values(
    **{
        name: sa.bindparam(f"e_{name}", type_=events.c[name].type)
        for name in (
            "tenant_id",
            "id",
            "operation_id",
            "kind",
            "actor",
            "from_state",
            "to_state",
            "version",
            "detail",
        )
    },
    created_at=db_now(),
)


_LEASE_UPDATE = (
    sa.update(operations)
    .where(
        operations.c.tenant_id == sa.bindparam("l_tenant_id", type_=operations.c.tenant_id.type),
        operations.c.id == sa.bindparam("l_id", type_=operations.c.id.type),
        operations.c.version == sa.bindparam("l_version", type_=sa.Integer),
        operations.c.state.in_(("in_progress", "outcome_unknown")),
        sa.or_(operations.c.lease_expires_at.is_(None), operations.c.lease_expires_at <= db_now()),
    )
    .values(
        lease_owner=sa.bindparam("l_owner", type_=sa.String),
        lease_expires_at=db_now_plus(sa.bindparam("l_lease_s", type_=sa.Float)),
        version=operations.c.version + 1,
        updated_at=db_now(),
    )
    .returning(*operations.c, operations.c.updated_at.label("_now"))
)


def lease_row(
    conn: Connection, tenant_id: str, op_id: str, version: int, *, owner: str, lease_s: float
) -> tuple[OperationRecord, datetime] | None:
    """The fenced lease UPDATE: only an active operation whose lease is free or expired."""
    row = (
        conn.execute(
            _LEASE_UPDATE,
            {
                "l_tenant_id": tenant_id,
                "l_id": op_id,
                "l_version": version,
                "l_owner": owner,
                "l_lease_s": lease_s,
            },
        )
        .mappings()
        .first()
    )
    return (OperationRecord.from_row(row), row["_now"]) if row is not None else None


class Shape(NamedTuple):
    """What one fenced write of an operation sets, and what goes with it: the statement's
    form (built once per shape and kept)."""

    plain: tuple[str, ...]  # columns set to a parameter each (u_<name>)
    lease: bool  # (re)take the lease (u_lease_s), else release it
    next_check: bool  # next_check_at from u_next_s
    terminal: bool  # completed_at and retain_until stamped
    attempts: bool  # attempts + u_attempts
    checks: bool  # checks + u_checks
    event: bool  # an event row (else it is kept on the row: answer_event)
    notify: bool  # wake the operation's waiters, if any (the row's ``waited``)


def build_update(shape: Shape, guard: sa.ColumnElement[bool] | None) -> Any:
    """The fenced UPDATE for one shape of transition (see ``Store.transition``)."""
    plain, lease, next_check, terminal, attempts, checks = shape[:6]
    t = operations.c
    values: dict[str, Any] = {name: sa.bindparam(f"u_{name}", type_=t[name].type) for name in plain}
    values["state"] = sa.bindparam("u_state", type_=t.state.type)
    values["version"] = t.version + 1
    values["updated_at"] = db_now()
    if lease:
        lease_s = sa.bindparam("u_lease_s", type_=sa.Float)
        values["lease_expires_at"] = db_now_plus(lease_s)
        values["next_check_at"] = db_now_plus(lease_s)
    else:
        values["lease_owner"] = None
        values["lease_expires_at"] = None
        values["next_check_at"] = None
    if next_check:
        values["next_check_at"] = db_now_plus(sa.bindparam("u_next_s", type_=sa.Float))
    if terminal:
        values["completed_at"] = db_now()
        values["next_check_at"] = None
        values["retain_until"] = db_now_plus(sa.bindparam("u_retention_s", type_=sa.Float))
    if attempts:
        values["attempts"] = t.attempts + sa.bindparam("u_attempts", type_=sa.Integer)
    if checks:
        values["checks"] = t.checks + sa.bindparam("u_checks", type_=sa.Integer)
    # The waiters' NOTIFY (``notify``) is the caller's PG_NOTIFY in the same transaction:
    # Citus refuses a volatile function in RETURNING.
    return (
        sa.update(operations)
        .where(
            t.tenant_id == sa.bindparam("w_tenant_id", type_=t.tenant_id.type),
            t.id == sa.bindparam("w_id", type_=t.id.type),
            t.version == sa.bindparam("w_version", type_=t.version.type),
            guard if guard is not None else sa.true(),
        )
        .values(**values)
        .returning(*operations.c)
    )


# -- PostgreSQL: one statement per write, as SQL text ------------------------------------

PG_CLAIMED, PG_REPLAYED, PG_EXISTING = 1, 2, 3  # the first column of PG_CLAIM / PG_REREAD

_COLS = ", ".join(OPERATION_COLUMNS)
_OPS = operations.name
_EVENTS = events.name
_TERMINAL = ", ".join(f"'{s}'" for s in TERMINAL_STATE_VALUES)
_NAMESPACE = (
    "tenant_id = %(tenant_id)s AND operation = %(operation)s "
    "AND idempotency_key = %(idempotency_key)s"
)
_EVENT_COLUMNS = "tenant_id, id, operation_id, kind, actor, from_state, to_state, version, detail"


def _now_plus(param: str) -> str:
    return f"statement_timestamp() + make_interval(secs => %({param})s::float8)"


# A replay's count (replays, last_replayed_at) is bookkeeping, not an outcome: its commit
# does not wait for the WAL flush, so a storm of duplicates, serialised on the row's lock,
# is not also serialised on one disk flush each. Only a transaction that counted a replay
# (and wrote nothing else) is affected; a claim's commit stays synchronous.
_ASYNC_COMMIT = "set_config('synchronous_commit', 'off', true)"

# The parts of the claim and of a waiter's reread, each a statement of its own: PG_CLAIM and
# PG_REREAD join them into one; on Citus (_citus_writes) they run apart, in one transaction.
CLAIM_INSERT = f"""INSERT INTO {_OPS} (tenant_id, id, operation, idempotency_key, fingerprint,
        state, provider, downstream_key, amount, currency, request, retention_seconds,
        possibly_sent, attempts, checks, needs_attention, lease_owner, lease_expires_at,
        next_check_at, version, created_at, updated_at, claim_event, route)
    VALUES (%(tenant_id)s, %(id)s, %(operation)s, %(idempotency_key)s, %(fingerprint)s,
        'in_progress', %(provider)s, %(downstream_key)s, %(amount)s::bigint, %(currency)s,
        %(request)s::json, %(retention_seconds)s::integer, %(possibly_sent)s::boolean,
        %(attempts)s::integer, 0, false, %(owner)s, {_now_plus("lease_s")},
        {_now_plus("lease_s")}, 1, statement_timestamp(), statement_timestamp(),
        %(claim_event)s::json, %(route)s::json)
    ON CONFLICT (tenant_id, operation, idempotency_key) DO NOTHING"""  # noqa: S608
CLAIM_REPLAY = f"""UPDATE {_OPS} SET replays = replays + 1, last_replayed_at = statement_timestamp()
    WHERE {_NAMESPACE} AND fingerprint = %(fingerprint)s AND state IN ({_TERMINAL})
        AND reaped_at IS NULL"""  # noqa: S608
CLAIM_ROW = f"SELECT {_COLS}, statement_timestamp() FROM {_OPS} WHERE {_NAMESPACE}"  # noqa: S608
REREAD_REPLAY = f"""UPDATE {_OPS} SET replays = replays + %(replays)s,
        last_replayed_at = statement_timestamp()
    WHERE tenant_id = %(tenant_id)s AND id = %(id)s AND fingerprint = %(fingerprint)s
        AND state IN ({_TERMINAL}) AND reaped_at IS NULL"""  # noqa: S608
REREAD_ROW = f"SELECT {_COLS} FROM {_OPS} WHERE tenant_id = %(tenant_id)s AND id = %(id)s"  # noqa: S608


def event_insert(values: str) -> str:
    """An event row's INSERT, from ``values`` (a VALUES list or a SELECT)."""
    return f"INSERT INTO {_EVENTS} ({_EVENT_COLUMNS}, created_at) {values}"


# The claim, or the replay it counts, or the row as it stands: one statement. All of its
# parts see one snapshot: a conflicting row committed after it began (a racing duplicate) is
# seen by none of them, and the statement returns no row at all; the caller then reads it
# with fresh statements. A claim returns only what the database decided (its time and the
# lease's end; the other columns NULL): the caller knows the rest, it sent it. Its event is
# kept on the row (claim_event), not written as an event row.
CLAIMED_COLUMNS = ("lease_expires_at", "created_at")  # what a claim reads back
_CLAIMED_ROW = ", ".join(
    c if c in CLAIMED_COLUMNS else "1 AS version" if c == "version" else f"NULL AS {c}"
    for c in OPERATION_COLUMNS
)
PG_CLAIM = f"""WITH ins AS (
    {CLAIM_INSERT}
    RETURNING lease_expires_at, created_at
), rep AS (
    {CLAIM_REPLAY} AND NOT EXISTS (SELECT FROM ins)
    RETURNING {_COLS}
)
SELECT {PG_CLAIMED}, {_CLAIMED_ROW}, created_at, NULL FROM ins
UNION ALL SELECT {PG_REPLAYED}, {_COLS}, statement_timestamp(), {_ASYNC_COMMIT} FROM rep
UNION ALL SELECT {PG_EXISTING}, {_COLS}, statement_timestamp(), NULL FROM {_OPS}
    WHERE {_NAMESPACE} AND NOT EXISTS (SELECT FROM ins) AND NOT EXISTS (SELECT FROM rep)"""  # noqa: S608

# A waiter's look at the operation it waits for: counted as a replay if it is one by now.
PG_REREAD = f"""WITH rep AS (
    {REREAD_REPLAY}
    RETURNING {_COLS}
)
SELECT {PG_REPLAYED}, {_COLS}, statement_timestamp(), {_ASYNC_COMMIT} FROM rep
UNION ALL SELECT {PG_EXISTING}, {_COLS}, statement_timestamp(), NULL FROM {_OPS}
    WHERE tenant_id = %(tenant_id)s AND id = %(id)s AND NOT EXISTS (SELECT FROM rep)"""  # noqa: S608

# A waiter marks the operation it waits on (``waited``): its write out of in_progress then
# sends the NOTIFY. The mark is written only once (by the first waiter); the row is read in
# the statement's snapshot. First column: the mark holds (ours, or one committed before this
# snapshot, which every later write of the row sees).
FLAG_WAITING = f"""UPDATE {_OPS} SET waited = true
    WHERE tenant_id = %(tenant_id)s AND id = %(id)s AND state = 'in_progress' AND NOT waited"""  # noqa: S608
PG_FLAG_WAITING = f"""WITH f AS (
    {FLAG_WAITING}
    RETURNING 1
)
SELECT EXISTS (SELECT FROM f) OR waited, {_COLS} FROM {_OPS}
    WHERE tenant_id = %(tenant_id)s AND id = %(id)s"""  # noqa: S608

# The reconciler's lease of a batch: pick due operations (the active partial index, oldest
# next check first, rows other reconcilers hold skipped) and lease them, one statement.
# RETURNING: the pick's next_check_at (the batch's order), the columns, the database time.
_ACTIVE = ", ".join(f"'{s}'" for s in ACTIVE_STATE_VALUES)


def _claim_due_sql(some_tenants: bool) -> str:
    only = " AND tenant_id = ANY(%(tenant_ids)s)" if some_tenants else ""
    return f"""WITH picked AS (
    SELECT tenant_id, id, version, next_check_at FROM {_OPS}
    WHERE state IN ({_ACTIVE}) AND next_check_at <= statement_timestamp()
        AND (lease_expires_at IS NULL OR lease_expires_at <= statement_timestamp()){only}
    ORDER BY next_check_at LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {_OPS} AS o SET lease_owner = %(owner)s, lease_expires_at = {_now_plus("lease_s")},
    version = o.version + 1, updated_at = statement_timestamp()
FROM picked
WHERE o.tenant_id = picked.tenant_id AND o.id = picked.id AND o.version = picked.version
RETURNING picked.next_check_at, {", ".join(f"o.{c}" for c in OPERATION_COLUMNS)},
    statement_timestamp()"""  # noqa: S608


PG_CLAIM_DUE = _claim_due_sql(some_tenants=False)
PG_CLAIM_DUE_TENANTS = _claim_due_sql(some_tenants=True)  # a daemon per shard of tenants

# Distributed (Citus): a lock across shards is refused, so the pick is two steps. First a
# read that locks nothing (it fans out to every shard, each reading its active partial
# index); then, per tenant, one transaction of two single-shard statements: lock what is
# still due of what it found (rows another daemon holds skipped, "due" judged again under
# the lock), then lease those rows. (Not one UPDATE with the locking SELECT as its subquery:
# a subquery may run again for each row it is joined with, locking more than its LIMIT.)
# RETURNING: next_check_at (the lease leaves it as the pick found it), the columns, and
# updated_at (the time the lease was written at; Citus refuses a function in RETURNING).
_DUE = f"""state IN ({_ACTIVE}) AND next_check_at <= statement_timestamp()
        AND (lease_expires_at IS NULL OR lease_expires_at <= statement_timestamp())"""


def _due_candidates_sql(some_tenants: bool) -> str:
    only = " AND tenant_id = ANY(%(tenant_ids)s)" if some_tenants else ""
    return f"""SELECT tenant_id, id FROM {_OPS}
    WHERE {_DUE}{only}
    ORDER BY next_check_at LIMIT %(limit)s"""  # noqa: S608


PG_DUE_CANDIDATES = _due_candidates_sql(some_tenants=False)
PG_DUE_CANDIDATES_TENANTS = _due_candidates_sql(some_tenants=True)
PG_LOCK_CANDIDATES = f"""SELECT id FROM {_OPS}
WHERE tenant_id = %(tenant_id)s AND id = ANY(%(ids)s) AND {_DUE}
ORDER BY next_check_at LIMIT %(room)s
FOR UPDATE SKIP LOCKED"""  # noqa: S608
PG_LEASE_LOCKED = f"""UPDATE {_OPS} SET lease_owner = %(owner)s,
    lease_expires_at = {_now_plus("lease_s")}, version = version + 1,
    updated_at = statement_timestamp()
WHERE tenant_id = %(tenant_id)s AND id = ANY(%(locked)s)
RETURNING next_check_at, {_COLS}, updated_at"""  # noqa: S608

# (S608 below: the f-strings splice in names and literals of this module only; every value
# is a bound parameter.)

# Parameters whose type the server cannot take from where they stand.
_CASTS = {
    "response": "::json",
    "request": "::json",
    "route": "::json",
    "possibly_sent": "::boolean",
    "needs_attention": "::boolean",
}


# The waiters' wake-up, as its own statement in a write's transaction (on Citus, where a
# distributed statement's own NOTIFY would be sent by a worker, to no listener).
PG_NOTIFY = "SELECT pg_notify(%(u_channel)s, %(w_tenant_id)s || ':' || %(w_id)s)"


def _sets(shape: Shape) -> str:
    plain, lease, next_check, terminal, attempts, checks = shape[:6]
    values: dict[str, str] = {n: f"%(u_{n})s{_CASTS.get(n, '')}" for n in plain}
    values["state"] = "%(u_state)s"
    values["version"] = "version + 1"
    values["updated_at"] = "statement_timestamp()"
    if lease:
        values["lease_expires_at"] = values["next_check_at"] = _now_plus("u_lease_s")
    else:
        values["lease_owner"] = values["lease_expires_at"] = values["next_check_at"] = "NULL"
    if next_check:
        values["next_check_at"] = _now_plus("u_next_s")
    if terminal:
        values["completed_at"] = "statement_timestamp()"
        values["next_check_at"] = "NULL"
        values["retain_until"] = _now_plus("u_retention_s")
    if attempts:
        values["attempts"] = "attempts + %(u_attempts)s::integer"
    if checks:
        values["checks"] = "checks + %(u_checks)s::integer"
    return ", ".join(f"{name} = {expr}" for name, expr in values.items())


# What a fenced write reads back: what the database decided (its clock, the counters it
# added to); the caller knows the rest, it sent it. ``waited``: whether to wake anyone.
UPDATED_COLUMNS = (
    "updated_at",
    "lease_expires_at",
    "next_check_at",
    "completed_at",
    "retain_until",
    "attempts",
    "checks",
    "waited",
)
_UPDATED = ", ".join(UPDATED_COLUMNS)


def pg_update_sql(shape: Shape) -> str:
    """:func:`build_update`'s UPDATE (same shape, same parameters) as SQL text, alone;
    RETURNING ``UPDATED_COLUMNS``."""
    return f"""UPDATE {_OPS} SET {_sets(shape)}
    WHERE tenant_id = %(w_tenant_id)s AND id = %(w_id)s AND version = %(w_version)s::integer
    RETURNING {_UPDATED}"""  # noqa: S608


def pg_transition_sql(shape: Shape) -> str:
    """:func:`pg_update_sql` with its event row (unless kept on the row) and, when the shape
    says so and someone waits, the waiters' NOTIFY: one statement."""
    # Waiters wake on the NOTIFY, sent when this commits. Only for an operation someone
    # waits on: a NOTIFY takes a lock held to the end of the commit, server-wide.
    note = (
        ", CASE WHEN waited THEN pg_notify(%(u_channel)s, %(w_tenant_id)s || ':' || %(w_id)s) END"
        if shape.notify
        else ""
    )
    event = (
        f"""), ev AS (
    {_TRANSITION_EVENT}"""
        if shape.event
        else ""
    )
    return f"""WITH upd AS (
    {pg_update_sql(shape)}, state, version
{event})
SELECT {_UPDATED}{note} FROM upd"""  # noqa: S608


_TRANSITION_EVENT = event_insert(
    "SELECT %(w_tenant_id)s, %(e_id)s, %(w_id)s, %(e_kind)s, %(e_actor)s, %(e_from_state)s, "
    "state, version, %(e_detail)s::json, statement_timestamp() FROM upd"
)


def new_id() -> str:
    """A time-ordered UUID (v7): ids sort by creation, indexes stay append-mostly."""
    return str(uuid6.uuid7())


def add_event(
    conn: Connection,
    record: OperationRecord,
    *,
    kind: str,
    actor: str,
    from_state: State | None,
    to_state: State | None,
    detail: Mapping[str, Any] | None,
    event_id: str | None = None,
) -> None:
    """Append one event of ``record`` inside the caller's transaction."""
    conn.execute(
        EVENT_INSERT,
        {
            "e_tenant_id": record.tenant_id,
            "e_id": event_id or new_id(),
            "e_operation_id": record.id,
            "e_kind": kind,
            "e_actor": actor,
            "e_from_state": from_state.value if from_state else None,
            "e_to_state": to_state.value if to_state else None,
            "e_version": record.version if to_state is not None else None,
            "e_detail": dict(detail) if detail is not None else None,
        },
    )
