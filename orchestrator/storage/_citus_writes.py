"""The hot writes on a distributed schema (Citus): the same effects as ``_pg_writes``, each
statement a single-shard (router) query.

On one PostgreSQL a claim or a transition is one data-modifying statement with CTEs, one
round trip. Citus plans a modifying CTE recursively: each part becomes a subplan whose rows
travel through the coordinator as intermediate results, so one claim costs several hops
between the coordinator and a worker. Here the parts are plain statements in one
transaction, each routed by ``tenant_id`` to the worker holding the tenant's shard over the
one connection the transaction keeps to it: a few round trips to the coordinator, one hop
each, one single-shard commit (no two-phase commit). The waiters' NOTIFY is the
coordinator's, in the same transaction (a worker's would reach no listener).

The rows come back in ``_pg_writes``'s shapes (a kind, the columns, the database time), so
the store reads them alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.engine import Connection, Engine

from ..records import OPERATION_COLUMNS
from ._engine import run_in_transaction
from ._statements import (
    CLAIM_INSERT,
    CLAIM_REPLAY,
    CLAIM_ROW,
    CLAIMED_COLUMNS,
    FLAG_WAITING,
    PG_CLAIMED,
    PG_EXISTING,
    PG_NOTIFY,
    PG_REPLAYED,
    REREAD_REPLAY,
    REREAD_ROW,
    UPDATED_COLUMNS,
    Shape,
    event_insert,
    pg_update_sql,
)

__all__ = ["claim", "flag_waiting", "reread", "reread_for", "transition"]

# The parts PG_CLAIM and PG_REREAD join, apart. RETURNING: the columns, then the time the
# write stamped (Citus refuses a function there).
_COLS = ", ".join(OPERATION_COLUMNS)
_CLAIM_INSERT = f"{CLAIM_INSERT}\nRETURNING {', '.join(CLAIMED_COLUMNS)}"
_CLAIM_REPLAY = f"{CLAIM_REPLAY}\nRETURNING {_COLS}, last_replayed_at"
_FLAGGED_ROW = REREAD_ROW.replace("SELECT ", "SELECT waited, ", 1)
_REREAD_REPLAY = f"{REREAD_REPLAY}\nRETURNING {_COLS}"
_WAITED = UPDATED_COLUMNS.index("waited")
_TRANSITION_EVENT = event_insert(
    "VALUES (%(w_tenant_id)s, %(e_id)s, %(w_id)s, %(e_kind)s, %(e_actor)s, %(e_from_state)s, "
    "%(u_state)s, %(w_version)s::integer + 1, %(e_detail)s::json, statement_timestamp())"
)


def claim(engine: Engine, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The claim, or the replay counted, or the row as it stands, in one
    transaction; a row shaped as ``PG_CLAIM``'s (kind, columns, time), or None if the
    namespace held no row either time it looked (reaped meanwhile)."""

    def txn(conn: Connection) -> tuple[Any, ...] | None:
        row = conn.exec_driver_sql(_CLAIM_INSERT, params).first()
        if row is not None:  # shaped as PG_CLAIM's claimed row: the stamped columns only
            stamped = dict(zip(CLAIMED_COLUMNS, row, strict=True))
            return (PG_CLAIMED, *(stamped.get(c) for c in OPERATION_COLUMNS), stamped["created_at"])
        row = conn.exec_driver_sql(_CLAIM_REPLAY, params).first()
        if row is not None:
            return (PG_REPLAYED, *row)
        row = conn.exec_driver_sql(CLAIM_ROW, params).first()
        return (PG_EXISTING, *row) if row is not None else None

    return run_in_transaction(engine, txn)


def flag_waiting(engine: Engine, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """``PG_FLAG_WAITING``'s parts in one transaction: the mark, then the row as it stands
    (under our row lock if we marked it); shaped as its row (the mark holds, the columns)."""

    def txn(conn: Connection) -> tuple[Any, ...] | None:
        conn.exec_driver_sql(FLAG_WAITING, params)
        row = conn.exec_driver_sql(_FLAGGED_ROW, params).first()
        return tuple(row) if row is not None else None

    return run_in_transaction(engine, txn)


def reread(engine: Engine, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The operation now, its replays counted if it is terminal; shaped as ``PG_REREAD``'s
    rows (a kind first)."""

    def txn(conn: Connection) -> tuple[Any, ...] | None:
        row = conn.exec_driver_sql(_REREAD_REPLAY, params).first()
        if row is not None:
            return (PG_REPLAYED, *row)
        row = conn.exec_driver_sql(REREAD_ROW, params).first()
        return (PG_EXISTING, *row) if row is not None else None

    return run_in_transaction(engine, txn)


def reread_for(driver_connection: Any, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """:func:`reread` on the waiters' listener connection (psycopg, autocommit): two
    statements, not one transaction; a terminal operation read by the second without its
    replays counted only leaves a statistic one short."""
    row = driver_connection.execute(_REREAD_REPLAY, params).fetchone()
    if row is not None:
        return (PG_REPLAYED, *row)
    row = driver_connection.execute(REREAD_ROW, params).fetchone()
    return (PG_EXISTING, *row) if row is not None else None


def transition(
    engine: Engine,
    cache: dict[Any, str],
    shape: Shape,
    params: Mapping[str, Any],
) -> tuple[Any, ...] | None:
    """The fenced UPDATE of ``shape``, its event (unless kept on the row) and, when the
    shape says so and someone waits, the waiters' NOTIFY, in one transaction;
    ``UPDATED_COLUMNS`` as the UPDATE returned them, or None if the version moved."""
    key = ("citus", shape)
    sql = cache.get(key)
    if sql is None:
        sql = cache[key] = pg_update_sql(shape)

    def txn(conn: Connection) -> tuple[Any, ...] | None:
        row = conn.exec_driver_sql(sql, params).first()
        if row is None:
            return None
        if shape.event:
            conn.exec_driver_sql(_TRANSITION_EVENT, params)
        if shape.notify and row[_WAITED]:
            conn.exec_driver_sql(PG_NOTIFY, params)
        return tuple(row)

    return run_in_transaction(engine, txn)
