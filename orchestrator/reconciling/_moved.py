"""Routed operations by the key of an attempt they left (payorch.routing).

A routed operation's row holds its current attempt's downstream key only. A provider it
moved away from, or one its route passed over as unhealthy, names that attempt's key (a
webhook's, a settlement report's merchant reference or ``payorch_ref`` tag), which no row
holds. Each move records the key it left (``fallback``: ``from_provider``, ``from_key``) and
each note of a passed-over provider the key there (``route_skipped``: ``keys``); both are
found through the events' partial index of moves, back to a bound, the keys compared by the
database: one query per look-up, whatever the number of moves.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
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

# How far back a move away from a provider is looked for: its attempt's effect may surface
# there late (a stand-in approval, then its capture and its settlement days later).
LOOKBACK = timedelta(days=60)
_CHUNK = 500  # keys per statement


def moved_from(
    store: Store,
    provider: str,
    keys: Collection[str],
    since: datetime,
    *,
    tenant_id: str | None = None,
) -> dict[str, list[OperationRecord]]:
    """The operations (of ``tenant_id``, else of any tenant) that moved away from
    ``provider``, or passed it over, since ``since``, whose attempt there is one of ``keys``
    (a downstream key -> its operations)."""
    wanted = sorted({k for k in keys if k and is_namespace_key(k)})
    if not wanted:
        return {}
    found: dict[str, list[OperationRecord]] = {}
    for tenant, operation_id in sorted(_left(store, provider, wanted, since, tenant_id)):
        try:
            record = store.get(tenant, operation_id)
        except (OperationNotFound, CorruptRecord):
            continue  # gone, or unreadable: what names it stays unmatched, listed
        route = record.route or {}
        key = key_at(route, provider)
        there = (provider, key) in touched(route) or provider in (route.get("skipped") or ())
        if key in wanted and there and key is not None:
            found.setdefault(key, []).append(record)
    return found


def _left(
    store: Store, provider: str, keys: Sequence[str], since: datetime, tenant_id: str | None
) -> set[tuple[str, str]]:
    """(tenant, operation id) of the moves away from ``provider`` and the notes passing it
    over, since ``since``, under one of ``keys``."""
    e = events.c
    left: set[tuple[str, str]] = set()
    for start in range(0, len(keys), _CHUNK):
        chunk = keys[start : start + _CHUNK]
        # The partial index's predicate first: no other event's detail is looked into.
        query = sa.select(e.tenant_id, e.operation_id).where(
            sa.text(WATCHED),
            e.created_at > since,
            sa.or_(
                sa.and_(
                    e.kind == "fallback",
                    e.detail["from_provider"].as_string() == provider,
                    e.detail["from_key"].as_string().in_(chunk),
                ),
                sa.and_(
                    e.kind == "route_skipped",
                    e.detail[("keys", provider)].as_string().in_(chunk),
                ),
            ),
        )
        if tenant_id is not None:
            query = query.where(e.tenant_id == tenant_id)
        rows = read_in_transaction(store.engine, functools.partial(_rows, query))
        left.update((str(r[0]), str(r[1])) for r in rows)
    return left


def _rows(query: sa.Select[Any], conn: Connection) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in conn.execute(query)]
