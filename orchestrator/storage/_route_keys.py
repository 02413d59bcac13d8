"""The keys of attempts routed operations left (``payorch_route_keys``, payorch.routing).

A move away from a provider, and a route that passed a provider over as unhealthy, record
that provider's downstream key for the operation in their own transaction. A webhook or a
settlement row of that provider names the key; :func:`left_at` finds the operations by it,
one indexed query (the table's primary key leads with the key).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..records import OperationRecord
from ._engine import read_in_transaction
from ._store import Store
from ._tables import db_now, route_keys

__all__ = ["left_at", "remember"]

_CHUNK = 500  # keys per statement


def remember(
    store: Store, keys: Sequence[tuple[str, str]]
) -> Callable[[Connection, OperationRecord], None]:
    """An ``also`` for the write that leaves (provider, downstream key) ``keys`` behind: the
    rows, in that write's transaction (written twice, kept once)."""

    def insert(conn: Connection, record: OperationRecord) -> None:
        rows = [
            {
                "tenant_id": record.tenant_id,
                "downstream_key": key,
                "provider": provider,
                "operation_id": record.id,
                "created_at": db_now(),
            }
            for provider, key in keys
            if key
        ]
        if rows:
            conn.execute(store._insert(route_keys).values(rows).on_conflict_do_nothing())

    return insert


def left_at(
    store: Store,
    provider: str,
    keys: Collection[str],
    since: datetime,
    *,
    tenant_id: str | None = None,
) -> set[tuple[str, str]]:
    """(tenant, operation id) of the operations (of ``tenant_id``, else of any tenant) that
    left ``provider`` behind under one of ``keys`` since ``since``."""
    r = route_keys.c
    wanted = sorted(set(keys))
    found: set[tuple[str, str]] = set()
    for start in range(0, len(wanted), _CHUNK):
        query = sa.select(r.tenant_id, r.operation_id).where(
            r.downstream_key.in_(wanted[start : start + _CHUNK]),
            r.provider == provider,
            r.created_at > since,
        )
        if tenant_id is not None:
            query = query.where(r.tenant_id == tenant_id)
        found.update(read_in_transaction(store.engine, functools.partial(_pairs, query)))
    return found


def _pairs(query: sa.Select[Any], conn: Connection) -> set[tuple[str, str]]:
    return {(str(row[0]), str(row[1])) for row in conn.execute(query)}
