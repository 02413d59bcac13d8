"""Routed operations by the key of an attempt they moved on from (payorch.routing).

A routed operation's row holds its current attempt's downstream key only. A provider it left
names the earlier attempt's key (a webhook's, a settlement report's merchant reference or
``payorch_ref`` tag), which no row holds. The moves away from a provider are few (each
followed a proof that its attempt failed), so they are read from the events' partial index
of moves, back to a bound, and each moved operation's key there is derived from its route.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core import is_namespace_key
from ..errors import CorruptRecord, OperationNotFound
from ..records import OperationRecord
from ..routing import key_at, touched
from ..storage._engine import read_in_transaction
from ..storage._store import Store
from ..storage._tables import WATCHED, events

__all__ = ["LOOKBACK", "moved_from"]

_PAGE = 1000  # moves read per query
# How far back a move away from a provider is looked for: its attempt's effect may surface
# there late (a stand-in approval, then its capture and its settlement days later).
LOOKBACK = timedelta(days=60)


def moved_from(
    store: Store,
    provider: str,
    keys: Collection[str],
    since: datetime,
    *,
    tenant_id: str | None = None,
) -> dict[str, list[OperationRecord]]:
    """The operations (of ``tenant_id``, else of any tenant) that moved away from
    ``provider`` since ``since`` whose attempt there was sent under one of ``keys`` (a
    downstream key -> its operations)."""
    wanted = {k for k in keys if k and is_namespace_key(k)}
    if not wanted:
        return {}
    found: dict[str, list[OperationRecord]] = {}
    for tenant, operation_id in sorted(_moves(store, provider, since, tenant_id)):
        try:
            record = store.get(tenant, operation_id)
        except (OperationNotFound, CorruptRecord):
            continue  # gone, or unreadable: its row stays an orphan, listed
        key = key_at(record.route, provider) if record.route else None
        if key in wanted and (provider, key) in touched(record.route):
            found.setdefault(key, []).append(record)
    return found


def _moves(
    store: Store, provider: str, since: datetime, tenant_id: str | None
) -> set[tuple[str, str]]:
    """(tenant, operation id) of every move away from ``provider`` made after ``since``,
    read a page at a time."""
    e = events.c
    moves: set[tuple[str, str]] = set()
    after: tuple[datetime, Any] | None = None
    while True:
        query = (
            sa.select(e.tenant_id, e.operation_id, e.created_at, e.id, e.kind, e.detail)
            .where(sa.text(WATCHED), e.created_at > since)
            .order_by(e.created_at, e.id)
            .limit(_PAGE)
        )
        if after is not None:
            query = query.where(sa.tuple_(e.created_at, e.id) > sa.tuple_(*after))
        if tenant_id is not None:
            query = query.where(e.tenant_id == tenant_id)
        rows = read_in_transaction(store.engine, functools.partial(_rows, query))
        moves.update(
            (str(row[0]), str(row[1]))
            for row in rows
            if row[4] == "fallback"
            and isinstance(row[5], dict)
            and row[5].get("from_provider") == provider
        )
        if len(rows) < _PAGE:
            return moves
        after = (rows[-1][2], rows[-1][3])


def _rows(query: sa.Select[Any], conn: Connection) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in conn.execute(query)]
