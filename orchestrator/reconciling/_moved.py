"""Routed operations by the key of an attempt they left (payorch.routing).

A routed operation's row holds its current attempt's downstream key only. A provider it
moved away from, or one its route passed over as unhealthy, names that attempt's key (a
webhook's, a settlement report's merchant reference or ``payorch_ref`` tag), which no row
holds. The move and the skip note record those keys (``payorch_route_keys``): one indexed
query finds the operations, each then read and checked against its route.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime, timedelta

from ..core import is_namespace_key
from ..errors import CorruptRecord, OperationNotFound
from ..records import OperationRecord
from ..routing import key_at, touched
from ..storage._route_keys import left_at
from ..storage._store import Store

__all__ = ["LOOKBACK", "left_here", "moved_from"]

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
    ``provider``, or passed it over, since ``since``, whose attempt there is one of ``keys``
    (a downstream key -> its operations)."""
    wanted = {k for k in keys if k and is_namespace_key(k)}
    if not wanted:
        return {}
    found: dict[str, list[OperationRecord]] = {}
    for tenant, operation_id in sorted(
        left_at(store, provider, wanted, since, tenant_id=tenant_id)
    ):
        try:
            record = store.get(tenant, operation_id)
        except (OperationNotFound, CorruptRecord):
            continue  # gone, or unreadable: what names it stays unmatched, listed
        key = key_at(record.route or {}, provider)
        if key is not None and key in wanted and left_here(record, provider):
            found.setdefault(key, []).append(record)
    return found


def left_here(record: OperationRecord, provider: str) -> bool:
    """Whether routed ``record`` sent an attempt to ``provider`` other than the one it
    stands at, or its route passed ``provider`` over: what that provider tells of the
    namespace is about an attempt the operation left, never its own outcome."""
    route = record.route
    if not route or provider == record.provider:
        return False
    key = key_at(route, provider)
    return (provider, key) in touched(route) or provider in (route.get("skipped") or ())
