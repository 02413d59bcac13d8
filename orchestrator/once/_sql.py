"""Every statement payorch.once runs on ``payorch_effects``.

The claim is ``INSERT … ON CONFLICT DO NOTHING RETURNING`` on the namespace key (tenant,
namespace, key): the check and the claim are one statement guarded by the primary key.
Every later write is ``UPDATE … WHERE version = :v RETURNING`` (a lost compare-and-set is
``StaleVersion`` and changes nothing). Times are the database's (``db_now``). On PostgreSQL
each write is one statement in autocommit (one round trip); SQLite runs it in a
transaction (BEGIN IMMEDIATE). Errors are mapped by ``storage._engine``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, RowMapping

from ..core import State
from ..errors import CommitUncertain, StaleVersion
from ..storage._engine import read_in_transaction, run_in_transaction, run_statement
from ..storage._statements import new_id
from ..storage._store import Store
from ..storage._tables import db_now, db_now_plus, effects
from ._values import EffectRecord, Policy, Target

__all__ = [
    "claim_row",
    "find_rows",
    "flagged",
    "read_row",
    "update_row",
]

T = TypeVar("T")
_c = effects.c


def _write(store: Store, fn: Callable[[Connection], T]) -> T:
    # One statement: its own COMMIT on PostgreSQL, BEGIN IMMEDIATE on SQLite.
    if store.is_postgres:
        return run_statement(store.engine, fn)
    return run_in_transaction(store.engine, fn)


def _read(store: Store, fn: Callable[[Connection], T]) -> T:
    # PostgreSQL: one autocommit statement (no BEGIN/COMMIT); SQLite: a WAL snapshot.
    if store.is_postgres:
        return run_statement(store.engine, fn, write=False)
    return read_in_transaction(store.engine, fn)


def _namespace(tenant_id: str, namespace: str, key: str) -> sa.ColumnElement[bool]:
    return sa.and_(_c.tenant_id == tenant_id, _c.namespace == namespace, _c.key == key)


def _with_now(row: Mapping[Any, Any]) -> tuple[EffectRecord, datetime]:
    return EffectRecord.from_row(row), row["_now"]


def claim_row(store: Store, policy: Policy, target: Target) -> tuple[EffectRecord, datetime, bool]:
    """Claim the key, or read what holds it: (record, database time, created).

    A new row is ``in_progress``, leased to ``policy.owner``, and not yet possibly sent:
    the caller marks it just before it runs the effect, so a worker that dies in between
    left nothing that needs an operator. A commit that may have happened raises
    ``CommitUncertain`` naming the effect id it would have: retry the same key.
    """
    effect_id = new_id()
    insert = (postgresql.insert if store.is_postgres else sqlite.insert)(effects)
    claim = (
        insert.values(
            tenant_id=target.tenant_id,
            namespace=policy.namespace,
            key=target.key,
            id=effect_id,
            fingerprint=target.fingerprint,
            state=State.IN_PROGRESS.value,
            possibly_sent=False,
            attempts=0,
            result=None,
            error=None,
            needs_attention=False,
            lease_owner=policy.owner,
            lease_expires_at=db_now_plus(policy.lease.total_seconds()),
            version=1,
            created_at=db_now(),
            updated_at=db_now(),
        )
        .on_conflict_do_nothing(index_elements=["tenant_id", "namespace", "key"])
        .returning(*effects.c, effects.c.updated_at.label("_now"))
    )
    where = _namespace(target.tenant_id, policy.namespace, target.key)
    query = sa.select(effects, db_now().label("_now")).where(where)

    def insert_only(conn: Connection) -> RowMapping | None:
        return conn.execute(claim).mappings().first()

    def read_only(conn: Connection) -> RowMapping | None:
        return conn.execute(query).mappings().first()

    seen: list[RowMapping] = []  # what a transaction that only read found

    def both(conn: Connection) -> tuple[RowMapping | None, bool]:
        seen.clear()  # a retried transaction starts over
        row = insert_only(conn)
        if row is not None:
            return row, True
        found = read_only(conn)
        if found is not None:
            seen.append(found)
        return found, False

    for _ in range(3):  # a row seen in conflict and gone before the read (purged): again
        try:
            if store.is_postgres:
                # The INSERT waits for a racing claim to commit; the read that follows is a
                # new statement, so it sees that row.
                row = _write(store, insert_only)
                created = row is not None
                if row is None:
                    row = _read(store, read_only)
            else:
                row, created = run_in_transaction(store.engine, both)
        except CommitUncertain as exc:
            if seen:  # it inserted nothing: only a read was in doubt
                record, now = _with_now(seen[0])
                return record, now, False
            raise CommitUncertain(
                f"the claim of key {target.key!r} in namespace {policy.namespace!r} may have "
                f"committed as effect {effect_id}; retry with the same key later",
                operation_id=effect_id,
                retry_after=1.0,
            ) from exc
        if row is not None:
            record, now = _with_now(row)
            return record, now, created
    raise CommitUncertain(  # pragma: no cover - a row deleted three times over
        f"the key {target.key!r} keeps changing; retry with the same key later",
        retry_after=1.0,
    )


def read_row(
    store: Store, tenant_id: str, namespace: str, key: str
) -> tuple[EffectRecord, datetime] | None:
    query = sa.select(effects, db_now().label("_now")).where(_namespace(tenant_id, namespace, key))

    def read(conn: Connection) -> RowMapping | None:
        return conn.execute(query).mappings().first()

    row = _read(store, read)
    return _with_now(row) if row is not None else None


def update_row(
    store: Store,
    record: EffectRecord,
    values: Mapping[str, Any],
    *,
    lease: timedelta | None = None,
    terminal: bool = False,
    retention: timedelta | None = None,
    lapsed: bool = False,
    attempts_delta: int = 0,
) -> EffectRecord:
    """The fenced write: ``values`` on ``record`` if nobody wrote it since it was read.

    ``lease`` (re)takes the lease for that long (else ``values`` says what the lease
    becomes); ``terminal`` stamps ``completed_at`` and ``retain_until`` (now +
    ``retention``); ``lapsed`` also requires, at write time, that no live lease holds it.
    Raises ``StaleVersion`` when the compare-and-set is lost.
    """
    sets: dict[str, Any] = dict(values)
    sets["version"] = _c.version + 1
    sets["updated_at"] = db_now()
    if lease is not None:
        sets["lease_expires_at"] = db_now_plus(lease.total_seconds())
    if terminal:
        sets["completed_at"] = db_now()
        sets["retain_until"] = db_now_plus((retention or timedelta(0)).total_seconds())
        sets["lease_owner"] = sets["lease_expires_at"] = None
    if attempts_delta:
        sets["attempts"] = _c.attempts + attempts_delta
    conditions = [
        _namespace(record.tenant_id, record.namespace, record.key),
        _c.version == record.version,
    ]
    if lapsed:
        conditions.append(sa.or_(_c.lease_expires_at.is_(None), _c.lease_expires_at <= db_now()))
    stmt = sa.update(effects).where(*conditions).values(**sets).returning(*effects.c)

    def write(conn: Connection) -> RowMapping | None:
        return conn.execute(stmt).mappings().first()

    row = _write(store, write)
    if row is None:
        raise StaleVersion(
            f"effect {record.id} changed since version {record.version}", operation_id=record.id
        )
    return EffectRecord.from_row(row)


def find_rows(store: Store, effect_id: str, tenant_id: str | None) -> list[EffectRecord]:
    """The effect with this id (at most two: ids are unique in practice, not by law)."""
    where = [_c.id == effect_id]
    if tenant_id is not None:
        where.append(_c.tenant_id == tenant_id)
    query = sa.select(effects).where(*where).limit(2)

    def read(conn: Connection) -> list[RowMapping]:
        return list(conn.execute(query).mappings().all())

    return [EffectRecord.from_row(r) for r in _read(store, read)]


def flagged(
    store: Store, *, tenant_id: str | None, namespace: str | None, limit: int
) -> list[EffectRecord]:
    """Effects waiting for an operator, oldest first: the attention partial index (its
    predicate as the index states it, a literal, so both planners may use it)."""
    flag = sa.and_(_c.needs_attention)
    where: list[sa.ColumnElement[bool]] = [flag]
    if tenant_id is not None:
        where.append(_c.tenant_id == tenant_id)
    if namespace is not None:
        where.append(_c.namespace == namespace)
    query = (
        sa.select(effects).where(*where).order_by(_c.tenant_id, _c.created_at, _c.id).limit(limit)
    )

    def read(conn: Connection) -> list[RowMapping]:
        return list(conn.execute(query).mappings().all())

    return [EffectRecord.from_row(r) for r in _read(store, read)]
