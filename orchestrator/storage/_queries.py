"""Read-only queries for operators: listing operations and the numbers behind ``payorch stats``.

Times are judged by the database clock, like everything else. Listings page with a keyset
cursor on ``(created_at, id)`` (newest first), so a page stays stable while new operations
arrive, and its cost does not grow with the page number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core import State, canonical_idempotency_key, validate_tenant
from ..errors import CorruptRecord, InvalidRequest
from ..records import OperationRecord
from ._engine import read_in_transaction
from ._store import Store
from ._tables import db_now, db_now_plus, events, is_flagged, is_listed, operations

__all__ = [
    "CONFLICT_EVENT",
    "Page",
    "Stats",
    "decode_cursor",
    "encode_cursor",
    "list_operations",
    "stats",
]

# The event the store appends on the existing operation when a claim refuses a changed
# fingerprint; ``stats`` counts them over a window. Replays are not events: they are counted
# on the operation (``replays``, ``last_replayed_at``).
CONFLICT_EVENT = "key_reused"
MAX_PAGE = 1000


@dataclass(frozen=True, kw_only=True)
class Page:
    """One page of operations, newest first, with the database time it was read at.

    ``unreadable``: rows of this page that could not be read (corrupt), left out of
    ``items`` so one bad row never hides the others.
    """

    items: list[OperationRecord]
    has_more: bool
    next_cursor: str | None
    now: datetime
    unreadable: list[CorruptRecord] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Stats:
    now: datetime
    window: timedelta
    by_state: dict[str, int]
    oldest_unknown_created_at: datetime | None
    needs_attention: int
    by_provider: dict[str, dict[str, int]]
    replays: int  # all replays counted on the operations still stored, ever
    replayed_operations: int  # operations replayed at least once within the window
    conflicts: int
    tenant_id: str | None = None

    @property
    def total(self) -> int:
        return sum(self.by_state.values())

    @property
    def oldest_unknown_age(self) -> timedelta | None:
        if self.oldest_unknown_created_at is None:
            return None
        return self.now - self.oldest_unknown_created_at

    def to_dict(self) -> dict[str, Any]:
        age = self.oldest_unknown_age
        return {
            "now": self.now.isoformat(),
            "tenant_id": self.tenant_id,
            "window_seconds": self.window.total_seconds(),
            "total": self.total,
            "by_state": dict(self.by_state),
            "oldest_unknown_created_at": (
                self.oldest_unknown_created_at.isoformat()
                if self.oldest_unknown_created_at
                else None
            ),
            "oldest_unknown_age_seconds": age.total_seconds() if age is not None else None,
            "needs_attention": self.needs_attention,
            "by_provider": {p: dict(s) for p, s in self.by_provider.items()},
            "replays": self.replays,
            "replayed_operations": self.replayed_operations,
            "conflicts": self.conflicts,
        }


def encode_cursor(record: OperationRecord) -> str:
    return _cursor(record.created_at, record.id)


def _cursor(created_at: datetime, op_id: str) -> str:
    return f"{created_at.isoformat()}~{op_id}"


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """Parse what :func:`encode_cursor` wrote; ``InvalidRequest`` if it is not that."""
    created, sep, op_id = cursor.partition("~")
    try:
        when = datetime.fromisoformat(created)
    except ValueError:
        when = None
    if not sep or not op_id or when is None or when.tzinfo is None:
        raise InvalidRequest(f"not a listing cursor: {cursor!r}")
    return when, op_id


def list_operations(
    store: Store,
    *,
    state: State | None = None,
    tenant_id: str | None = None,
    operation: str | None = None,
    provider: str | None = None,
    older_than: timedelta | None = None,
    needs_attention: bool | None = None,
    provider_reference: str | None = None,
    idempotency_key: str | None = None,
    limit: int = 50,
    cursor: str | None = None,
) -> Page:
    """Operations matching every given filter, newest first; ``cursor`` continues a listing.

    ``older_than`` keeps operations created at least that long ago (database clock).
    ``provider_reference`` finds the operation behind an id seen in a provider's dashboard.
    """
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequest(f"limit must be between 1 and {MAX_PAGE}")
    if older_than is not None and older_than < timedelta(0):
        raise InvalidRequest("older_than must not be negative")
    t = operations.c
    where: list[sa.ColumnElement[bool]] = [is_listed()]  # the listing index's predicate
    if state is not None:
        where.append(t.state == state.value)
    if tenant_id is not None:
        where.append(t.tenant_id == validate_tenant(tenant_id))
    if provider_reference is not None:
        where.append(t.provider_reference == provider_reference)
    if idempotency_key is not None:
        where.append(t.idempotency_key == canonical_idempotency_key(idempotency_key))
    if operation is not None:
        where.append(t.operation == operation)
    if provider is not None:
        where.append(t.provider == provider)
    if needs_attention:
        where.append(is_flagged())  # as ix_payorch_operations_attention states it
    elif needs_attention is not None:
        where.append(sa.not_(t.needs_attention))
    if older_than is not None:
        where.append(t.created_at <= db_now_plus(sa.literal(-older_than.total_seconds())))
    if cursor is not None:
        created, op_id = decode_cursor(cursor)
        where.append(sa.or_(t.created_at < created, sa.and_(t.created_at == created, t.id < op_id)))
    query = (
        sa.select(operations)
        .where(*where)
        .order_by(t.created_at.desc(), t.id.desc())
        .limit(limit + 1)  # one more than asked: tells whether another page exists
    )

    def read(conn: Connection) -> Page:
        now = conn.execute(sa.select(db_now())).scalar_one()
        rows = conn.execute(query).mappings().all()
        items: list[OperationRecord] = []
        unreadable: list[CorruptRecord] = []
        for row in rows[:limit]:
            try:
                items.append(OperationRecord.from_row(row))
            except CorruptRecord as exc:
                unreadable.append(exc)
        has_more = len(rows) > limit
        return Page(
            items=items,
            has_more=has_more,
            next_cursor=_next_cursor(rows[:limit]) if has_more else None,
            now=now,
            unreadable=unreadable,
        )

    return read_in_transaction(store.engine, read)


def _next_cursor(rows: Sequence[Any]) -> str | None:
    """The cursor after the last row whose keyset columns can be read, corrupt or not."""
    for row in reversed(rows):
        created, op_id = row["created_at"], row["id"]
        if isinstance(created, datetime) and isinstance(op_id, str):
            return _cursor(created, op_id)
    return None


def stats(store: Store, *, window: timedelta, tenant_id: str | None = None) -> Stats:
    """Counts by state and provider, the oldest unknown, and replays/conflicts in ``window``."""
    if window <= timedelta(0):
        raise InvalidRequest("the stats window must be positive")
    t = operations.c
    e = events.c

    def scoped(column: sa.ColumnElement[str]) -> list[sa.ColumnElement[bool]]:
        return [column == tenant_id] if tenant_id is not None else []

    def read(conn: Connection) -> Stats:
        now = conn.execute(sa.select(db_now())).scalar_one()
        by_state = {s.value: 0 for s in State}
        by_provider: dict[str, dict[str, int]] = {}
        grouped = conn.execute(
            sa.select(t.provider, t.state, sa.func.count())
            .where(*scoped(t.tenant_id))
            .group_by(t.provider, t.state)
        ).all()
        for provider_value, state_value, count in grouped:
            # str(): a corrupt row may hold anything; it is counted under what it holds.
            state, provider = str(state_value), str(provider_value)
            by_state[state] = by_state.get(state, 0) + int(count)
            counts = by_provider.setdefault(provider, {})
            counts[state] = counts.get(state, 0) + int(count)
        oldest = conn.execute(
            sa.select(sa.func.min(t.created_at)).where(
                t.state == State.OUTCOME_UNKNOWN.value, *scoped(t.tenant_id)
            )
        ).scalar_one()
        attention = conn.execute(
            sa.select(sa.func.count())
            .select_from(operations)
            .where(is_flagged(), *scoped(t.tenant_id))
        ).scalar_one()
        since = db_now_plus(sa.literal(-window.total_seconds()))
        replays, replayed = conn.execute(
            sa.select(
                sa.func.coalesce(sa.func.sum(t.replays), 0),
                sa.func.count(t.last_replayed_at).filter(t.last_replayed_at >= since),
            ).where(*scoped(t.tenant_id))
        ).one()
        # ix_payorch_events_kind (tenant_id, kind, created_at) serves this per tenant.
        conflicts = conn.execute(
            sa.select(sa.func.count())
            .select_from(events)
            .where(e.kind == CONFLICT_EVENT, e.created_at >= since, *scoped(e.tenant_id))
        ).scalar_one()
        return Stats(
            now=now,
            window=window,
            tenant_id=tenant_id,
            by_state=by_state,
            oldest_unknown_created_at=oldest,
            needs_attention=int(attention),
            by_provider=by_provider,
            replays=int(replays),
            replayed_operations=int(replayed),
            conflicts=int(conflicts),
        )

    return read_in_transaction(store.engine, read)
