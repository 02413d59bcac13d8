"""The store's hot statements, built once with bind parameters.

SQLAlchemy then skips statement construction, coercion and cache-key work on every call;
each statement is still one round trip, fenced exactly as ``store.py`` describes.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .records import OperationRecord
from .tables import TERMINAL_STATE_VALUES, db_now, db_now_plus, events, operations

__all__ = [
    "EVENT_INSERT",
    "REPLAY_BY_ID",
    "REPLAY_BY_NAMESPACE",
    "build_claim",
    "build_update",
    "lease_row",
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
        .returning(*operations.c, db_now().label("_now"))
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
    .returning(*operations.c, db_now().label("_now"))
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


def build_update(shape: tuple[Any, ...], guard: sa.ColumnElement[bool] | None) -> Any:
    """The fenced UPDATE for one shape of transition (see ``Store.transition``)."""
    plain, lease, next_check, terminal, attempts, checks, notify = shape
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
        values["retain_until"] = db_now_plus(t.retention_seconds)
    if attempts:
        values["attempts"] = t.attempts + sa.bindparam("u_attempts", type_=sa.Integer)
    if checks:
        values["checks"] = t.checks + sa.bindparam("u_checks", type_=sa.Integer)
    returning: list[Any] = list(operations.c)
    if notify:
        # Waiters wake on this; RETURNING carries it, saving a round trip per transition.
        payload = sa.func.concat(t.tenant_id, ":", t.id)
        returning.append(
            sa.func.pg_notify(sa.bindparam("u_channel", type_=sa.String), payload).label("_n")
        )
    return (
        sa.update(operations)
        .where(
            t.tenant_id == sa.bindparam("w_tenant_id", type_=t.tenant_id.type),
            t.id == sa.bindparam("w_id", type_=t.id.type),
            t.version == sa.bindparam("w_version", type_=t.version.type),
            guard if guard is not None else sa.true(),
        )
        .values(**values)
        .returning(*returning)
    )
