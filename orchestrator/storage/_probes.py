"""The database reads of monitoring: scrape-time gauges and readiness probes.

Plain reads of a store; a scrape or a probe waits for one at most a time-out
(:class:`payorch.observing._bounded.OneAtATime` runs them), so they need not be quick.

An ``AsyncStore`` reads only on its event loop, under the greenlet bridge; observing cannot
know a store, so :func:`watch` and :func:`asgi_app` (``payorch.metrics``) hand it the
gauges of one as an :class:`~payorch.observing._metrics.AsyncGaugeSource`.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from ..core import State
from ..errors import DatabaseReadOnly
from ..observing import _metrics
from ._bridge import run_bridged
from ._engine import read_in_transaction
from ._replication import MODES, Guard, Status
from ._tables import (
    db_now,
    effects,
    is_active,
    is_dead,
    is_flagged,
    is_pending,
    operations,
    outbox,
    recon_providers,
)

__all__ = [
    "AsyncGauges",
    "AsyncProbed",
    "Probed",
    "asgi_app",
    "read_gauges",
    "replication",
    "watch",
]


class Probed(Protocol):
    """What a probe reads through (a :class:`~payorch.Store`)."""

    @property
    def engine(self) -> Engine: ...

    @property
    def is_postgres(self) -> bool: ...

    @property
    def replication(self) -> Guard: ...


def read_gauges(store: Probed) -> dict[str, Any]:
    """The scrape-time numbers, by the database clock, in one read transaction.

    Non-terminal rows only (``is_active()``: the active partial index, so the cost follows
    the stuck work, not the table); the attention count reads its own partial index.
    Terminal counts are left out on purpose: counting them reads the whole table.
    """
    t = operations.c
    due = sa.and_(
        t.next_check_at <= db_now(),
        sa.or_(t.lease_expires_at.is_(None), t.lease_expires_at <= db_now()),
    )
    active = (
        sa.select(t.state, sa.func.count(), sa.func.count().filter(due), sa.func.min(t.created_at))
        .where(is_active())
        .group_by(t.state)
    )
    flagged = sa.select(sa.func.count()).select_from(operations).where(is_flagged())
    o = outbox.c
    # The outbox's backlog and dead letters (each its own partial index), and the effects
    # of payorch.once waiting for a human.
    pending = sa.select(
        sa.func.count(),
        sa.func.count().filter(o.next_attempt_at <= db_now()),
        sa.func.min(o.created_at),
    ).where(is_pending())
    dead = sa.select(sa.func.count()).select_from(outbox).where(is_dead())
    effects_flagged = (
        sa.select(sa.func.count()).select_from(effects).where(sa.and_(effects.c.needs_attention))
    )

    # Settlement reconciliation, as the last import or report counted it: one row per
    # provider (its rows per class, what its settlements still owe), never the rows.
    owed = sa.select(recon_providers)

    clock = sa.select(db_now())
    if store.is_postgres:
        # Planned on each scrape for the tables as they are (transaction-local): a cached
        # generic plan, chosen while a fresh table was empty, could count a partial index's
        # rows with a scan of the whole table until the first ANALYZE.
        clock = clock.add_columns(sa.func.set_config("plan_cache_mode", "force_custom_plan", True))

    def read(conn: sa.Connection) -> dict[str, Any]:
        now = conn.execute(clock).one()[0]
        by_state = {State.IN_PROGRESS.value: 0, State.OUTCOME_UNKNOWN.value: 0}
        due_now, oldest_unknown = 0, None
        for state, count, due_count, oldest in conn.execute(active).all():
            by_state[str(state)] = int(count)
            due_now += int(due_count)
            if state == State.OUTCOME_UNKNOWN.value:
                oldest_unknown = oldest
        age = (now - oldest_unknown).total_seconds() if oldest_unknown is not None else 0.0
        waiting, due_messages, oldest_message = conn.execute(pending).one()
        message_age = (now - oldest_message).total_seconds() if oldest_message else 0.0
        return {
            "by_state": by_state,
            "due": due_now,
            "attention": int(conn.execute(flagged).scalar_one()),
            "oldest_unknown_age": max(age, 0.0),
            "outbox": {
                "pending": int(waiting),
                "due": int(due_messages),
                "dead": int(conn.execute(dead).scalar_one()),
                "oldest_pending_age": max(message_age, 0.0),
            },
            "effects_attention": int(conn.execute(effects_flagged).scalar_one()),
            "recon": {
                "providers": [
                    {
                        "provider": row["provider"],
                        "counts": dict(row["counts"] or {}),
                        "expected": int(row["expected"]),
                        "overdue": int(row["overdue"]),
                        "oldest_expected_age": max(
                            (now - row["oldest_expected_at"]).total_seconds(), 0.0
                        )
                        if row["oldest_expected_at"] is not None
                        else 0.0,
                    }
                    for row in conn.execute(owed).mappings()
                ],
            },
        }

    values = read_in_transaction(store.engine, read)
    if store.is_postgres:  # the replication gauges: one statement more
        status = replication(store)
        values["replication"] = {
            "mode": status.mode,
            "modes": MODES,
            "sync_standbys": status.sync_standbys_streaming,
            "standbys": status.standbys_streaming,
        }
    return values


def replication(store: Probed) -> Status:
    """The store's replication status; ``read_only`` (not an error) for a standby or a
    read-only session, so a probe can say so."""
    try:
        return store.replication.status()
    except DatabaseReadOnly:
        return Status(mode="read_only")


class AsyncProbed(Protocol):
    """An ``AsyncStore``: its async engine and the sync store it drives under the bridge."""

    @property
    def engine(self) -> AsyncEngine: ...

    @property
    def sync(self) -> Probed: ...


class AsyncGauges:
    """The gauges of an ``AsyncStore``, awaited: the same read as a :class:`Store`'s, each
    round trip awaiting on the event loop (never blocking it)."""

    def __init__(self, store: AsyncProbed) -> None:
        self.store = store

    async def read_gauges(self) -> dict[str, Any]:
        return await run_bridged(read_gauges, self.store.sync)


def gauge_source(store: object) -> Any:
    """What :func:`payorch.observing._metrics.watch` reads for ``store``: an ``AsyncStore``
    becomes an :class:`AsyncGauges`; anything else goes as it is (refused there when it is
    no gauge source)."""
    if callable(getattr(store, "read_gauges", None)):
        return store  # a Store, or a source that reads its own gauges (sync or async)
    engine, sync = getattr(store, "engine", None), getattr(store, "sync", None)
    if isinstance(engine, AsyncEngine) and callable(getattr(sync, "read_gauges", None)):
        return AsyncGauges(cast(AsyncProbed, store))
    return store


def watch(
    store: _metrics.GaugeSource | _metrics.AsyncGaugeSource | AsyncProbed, *, timeout: float = 5.0
) -> _metrics.StoreGauges | None:
    """Export the state gauges of ``store`` (a ``Store`` or an ``AsyncStore``) in
    ``payorch.metrics.registry``, read at most ``timeout`` per scrape; replaces an earlier one.

    A sync store is read when the registry is collected. An async one is read by
    ``await payorch.metrics.refresh()``, which :func:`asgi_app` awaits before each scrape;
    a plain ``generate_latest`` shows what the last refresh read.
    """
    return _metrics.watch(gauge_source(store), timeout=timeout)


def asgi_app(
    *,
    store: _metrics.GaugeSource | _metrics.AsyncGaugeSource | AsyncProbed | None = None,
    timeout: float = 5.0,
) -> _metrics.MetricsApp:
    """An ASGI app answering ``payorch.metrics.registry`` at the path it is routed to,
    refreshing the gauges of ``store`` (watched first, when given) before each scrape."""
    source = None if store is None else gauge_source(store)
    return _metrics.asgi_app(store=source, timeout=timeout)
